"""How a payload lies in the bytes a Mooncake connector moves: tensor bytes, then (when large) the
pickled skeleton. Small skeletons travel in the handle instead, which saves nothing in bytes but
keeps the object one contiguous transfer without a second round trip for the metadata."""

from __future__ import annotations

import ctypes
from typing import Any

import attrs
import numpy as np

from omni_core.connectors.serialize import (
    TENSOR_ALIGNMENT,
    SplitPayload,
    align_up,
    copy_tensor_into,
    join_payload,
    split_payload,
)
from omni_core.outputs import Payload

_EMPTY = np.empty(0, dtype=np.uint8)


@attrs.frozen
class PayloadLayout:
    """A payload split for transfer: `nbytes` to move, its skeleton inline (`meta`) or at
    ``meta_offset`` (``meta_len`` bytes) after the tensor bytes."""

    split: SplitPayload
    nbytes: int
    meta: bytes | None
    meta_offset: int
    meta_len: int


def lay_out(payload: Payload, inline_meta_bytes: int) -> PayloadLayout:
    """Split `payload` and decide where its skeleton goes."""
    split = split_payload(payload)
    if len(split.skeleton) <= inline_meta_bytes:
        return PayloadLayout(split, split.data_bytes, split.skeleton, 0, 0)
    offset = align_up(split.data_bytes, TENSOR_ALIGNMENT)
    return PayloadLayout(split, offset + len(split.skeleton), None, offset, len(split.skeleton))


def plain_bytes(tensor: Any) -> bool:
    """Whether `tensor`'s memory holds exactly its values, in order: a contiguous CPU tensor
    without a lazy conjugate or negation bit (``z.conj()``, ``z.conj().imag`` are views whose
    memory holds the unconjugated values), so that copying its bytes copies it."""
    return bool(tensor.is_cpu and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg())


def write_payload(block: np.ndarray, address: int, layout: PayloadLayout) -> None:
    """Copy the tensors (and a skeleton that does not travel inline) into `block` (uint8, at
    least ``layout.nbytes`` long, 64-byte aligned, at `address`): one pass over the tensor bytes."""
    for slot, tensor in zip(layout.split.slots, layout.split.tensors):
        if slot.kind == "torch" and slot.nbytes and plain_bytes(tensor):
            # The common case (a contiguous CPU tensor) as one memmove between addresses: no
            # torch or numpy views to build, which on a small payload cost more than the copy
            # (and ctypes lets go of the GIL while it copies). `data_ptr` includes the offset.
            ctypes.memmove(address + slot.offset, tensor.data_ptr(), slot.nbytes)
        else:
            copy_tensor_into(block, slot, tensor)
    if layout.meta is None:
        block[layout.meta_offset : layout.meta_offset + layout.meta_len] = np.frombuffer(layout.split.skeleton, dtype=np.uint8)


def read_payload(block: np.ndarray | None, meta: bytes | None, meta_offset: int, meta_len: int) -> Payload:
    """The payload whose bytes are in `block`, its tensors zero-copy views of it."""
    block = _EMPTY if block is None else block
    skeleton: Any = meta if meta is not None else memoryview(block[meta_offset : meta_offset + meta_len])
    return join_payload(skeleton, block)
