"""Split a payload into its tensor bytes and a small pickled skeleton, and join them back.

Connectors that move tensor bytes themselves (shared memory, RDMA) pickle everything else of the
payload. A pickler with ``persistent_id`` swaps every torch tensor and numpy array for a
`TensorSlot` wherever it sits (dicts, lists, tuples, attrs objects...), so no hand-written tree
walk has to know every container type, and the unpickler puts views of the moved bytes back.

torch is never imported here: a tensor is recognised only if the caller already imported torch.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any, Callable

import attrs
import numpy as np

from omni_core.outputs import Payload

TENSOR_ALIGNMENT = 64
"""Every tensor starts at a multiple of this many bytes (cache line; SIMD loads)."""


def align_up(value: int, alignment: int) -> int:
    """Round `value` up to a multiple of `alignment`."""
    return (value + alignment - 1) // alignment * alignment


@attrs.frozen
class TensorSlot:
    """Where one tensor's bytes are in the block: ``kind`` is ``"torch"`` or ``"numpy"``.

    `dtype` is the torch dtype's name (``"bfloat16"``) or a numpy dtype; `offset` is relative to
    the start of the block the connector allocated.
    """

    kind: str
    dtype: Any
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@attrs.frozen
class SplitPayload:
    """A payload taken apart: `skeleton` (pickle with slots), the source tensors and the layout."""

    skeleton: bytes
    tensors: list[Any]
    slots: list[TensorSlot]
    data_bytes: int


def _torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


class _SplittingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensor_type: type | None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensor_type = tensor_type
        self.tensors: list[Any] = []
        self.slots: list[TensorSlot] = []
        self.end = 0

    def persistent_id(self, obj: Any) -> TensorSlot | None:  # noqa: D401 - pickle hook
        if self._tensor_type is not None and isinstance(obj, self._tensor_type):
            # The subclass check keeps torch.nn.Parameter and friends on the fast path too.
            slot = self._slot("torch", str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                              obj.numel() * obj.element_size())
        elif type(obj) is np.ndarray and not obj.dtype.hasobject:
            # Object arrays hold Python references, not bytes: they are pickled like any object.
            slot = self._slot("numpy", obj.dtype, tuple(obj.shape), obj.nbytes)
        else:
            return None
        self.tensors.append(obj)
        self.slots.append(slot)
        return slot

    def _slot(self, kind: str, dtype: Any, shape: tuple[int, ...], nbytes: int) -> TensorSlot:
        offset = align_up(self.end, TENSOR_ALIGNMENT)
        self.end = offset + nbytes
        return TensorSlot(kind, dtype, shape, offset, nbytes)


def split_payload(payload: Payload) -> SplitPayload:
    """Pickle `payload` with every tensor replaced by a `TensorSlot` laid out from offset 0."""
    buffer = io.BytesIO()
    pickler = _SplittingPickler(buffer, _torch_tensor_type())
    pickler.dump(payload)
    return SplitPayload(buffer.getvalue(), pickler.tensors, pickler.slots, pickler.end)


def copy_tensor_into(block: np.ndarray, slot: TensorSlot, source: Any) -> None:
    """Copy `source` into `block` (a uint8 array) at `slot` with one memcpy-like pass.

    Non-contiguous sources are gathered by the copy itself, not by an extra `.contiguous()`.
    """
    if slot.nbytes == 0:
        return
    target = tensor_view(block, slot)
    if slot.kind == "torch":
        # A tensor that requires grad cannot be copied into a view without autograd tracking it.
        target.copy_(source.detach())
    else:
        np.copyto(target, source, casting="no")


def tensor_view(block: np.ndarray, slot: TensorSlot) -> Any:
    """A zero-copy view of `slot` in `block`: a torch tensor or numpy array as it was put."""
    raw = block[slot.offset : slot.offset + slot.nbytes]
    if slot.kind == "numpy":
        dtype = np.dtype(slot.dtype)
        if slot.nbytes == 0:
            return np.empty(slot.shape, dtype=dtype)
        return raw.view(dtype).reshape(slot.shape)
    import torch

    dtype = getattr(torch, slot.dtype)
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=dtype)
    # from_numpy shares memory; viewing the uint8 run as `dtype` covers dtypes numpy lacks
    # (bfloat16, float8); the 64-byte alignment satisfies every element size.
    return torch.from_numpy(raw).view(dtype).view(slot.shape)


class _JoiningUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, load_slot: Callable[[TensorSlot], Any]) -> None:
        super().__init__(file)
        self._load_slot = load_slot

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, TensorSlot):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._load_slot(pid)


def join_payload(skeleton: bytes | memoryview, block: np.ndarray) -> Payload:
    """Unpickle `skeleton`, putting back views of `block` for its tensor slots."""
    return _JoiningUnpickler(io.BytesIO(skeleton), lambda slot: tensor_view(block, slot)).load()
