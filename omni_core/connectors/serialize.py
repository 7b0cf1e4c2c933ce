"""Split a payload into its tensor bytes and a small pickled skeleton, and join them back.

Connectors that move tensor bytes themselves (shared memory, RDMA) pickle everything else of the
payload. A pickler with ``persistent_id`` swaps every torch tensor and numpy array for the index
of its slot wherever it sits (dicts, lists, tuples, attrs objects...), so no hand-written tree
walk has to know every container type, and the unpickler puts views of the moved bytes back.

The skeleton is the table of slots (plain tuples, pickled first) followed by the payload's pickle
whose persistent ids are indexes into that table: an int costs the pickler nothing to save, where
an object per tensor would be pickled field by field through ``persistent_id`` again. The common
payload of a stage, a flat dict of tensors and plain values, skips the pickler's per-object
callbacks altogether (`_split_flat`): small payloads cross a connector on every step, and this
split/join is most of what a connector adds to the bytes' own transfer there.

torch is never imported here: a tensor is recognised only if the caller already imported torch.
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
from typing import Any

import attrs
import numpy as np

from omni_core.outputs import Payload

TENSOR_ALIGNMENT = 64
"""Every tensor starts at a multiple of this many bytes (cache line; SIMD loads)."""

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_FLAT = 1
"""First byte of a flat-dict skeleton; a pickled table (protocol >= 2) starts with 0x80."""
_FLAT_PREFIX = bytes((_FLAT,))
_LEAF_TYPES = frozenset({str, bytes, int, float, bool, type(None)})
"""Values a flat dict may hold besides tensors: pickled as themselves, nothing inside to split."""


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


class _Slots:
    """The slots of one split, laid out from offset 0 in the order the tensors are met."""

    def __init__(self, tensor_type: type | None) -> None:
        self.tensor_type = tensor_type
        self.tensors: list[Any] = []
        self.slots: list[TensorSlot] = []
        self.table: list[tuple[str, Any, tuple[int, ...], int, int]] = []
        self.end = 0

    def add(self, obj: Any) -> int | None:
        """The slot index of `obj` when it is a tensor or a numpy array of bytes, else None."""
        if self.tensor_type is not None and isinstance(obj, self.tensor_type):
            # The subclass check keeps torch.nn.Parameter and friends on the fast path too.
            kind, dtype, nbytes = "torch", str(obj.dtype)[6:], obj.nbytes  # "torch.float32" -> "float32"
            token: Any = dtype
        elif type(obj) is np.ndarray and not obj.dtype.hasobject:
            # Object arrays hold Python references, not bytes: they are pickled like any object.
            kind, dtype, nbytes = "numpy", obj.dtype, obj.nbytes
            # A builtin dtype travels as its short string ("<f4"), exact and cheaper to pickle.
            token = dtype.str if dtype.isbuiltin == 1 else dtype
        else:
            return None
        offset = (self.end + TENSOR_ALIGNMENT - 1) // TENSOR_ALIGNMENT * TENSOR_ALIGNMENT
        self.end = offset + nbytes
        shape = tuple(obj.shape)
        self.tensors.append(obj)
        self.slots.append(TensorSlot(kind, dtype, shape, offset, nbytes))
        self.table.append((kind, token, shape, offset, nbytes))
        return len(self.table) - 1

    def reset(self) -> None:
        """Forget every slot (a split that gave up, to start over)."""
        self.tensors, self.slots, self.table, self.end = [], [], [], 0

    def split(self, skeleton: bytes) -> SplitPayload:
        return SplitPayload(skeleton, self.tensors, self.slots, self.end)


def split_payload(payload: Payload) -> SplitPayload:
    """Pickle `payload` with every tensor replaced by a slot laid out from offset 0."""
    slots = _Slots(_torch_tensor_type())
    flat = _split_flat(payload, slots)
    if flat is not None:
        return slots.split(flat)
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=_PROTOCOL)
    pickler.persistent_id = slots.add  # type: ignore[method-assign]  # the C pickler's hook
    pickler.dump(payload)
    return slots.split(pickle.dumps(tuple(slots.table), protocol=_PROTOCOL) + buffer.getvalue())


def _split_flat(payload: Payload, slots: _Slots) -> bytes | None:
    """The skeleton of a dict whose values are tensors, arrays or plain leaves; None for any other
    payload (it takes the pickler's path)."""
    if type(payload) is not dict:
        return None
    keys: list[str] = []
    values: list[Any] = []
    positions: list[int] = []
    for key, value in payload.items():
        if type(key) is not str:
            slots.reset()
            return None
        if type(value) not in _LEAF_TYPES:
            if slots.add(value) is None:  # a container or another object: the pickler walks it
                slots.reset()
                return None
            positions.append(len(values))
            value = None
        keys.append(key)
        values.append(value)
    return _FLAT_PREFIX + pickle.dumps((slots.table, keys, values, positions), protocol=_PROTOCOL)


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
    return _view(block, slot.kind, slot.dtype, slot.shape, slot.offset, slot.nbytes)


def _view(block: np.ndarray, kind: str, dtype: Any, shape: tuple[int, ...], offset: int, nbytes: int) -> Any:
    if kind == "numpy":
        if nbytes == 0:
            return np.empty(shape, dtype=np.dtype(dtype))
        return np.ndarray(shape, dtype, block, offset)  # one call: slicing, viewing and reshaping cost three
    import torch

    numpy_dtype, torch_dtype = _torch_view_dtypes(dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
    # Typed and shaped by numpy, then one from_numpy (sharing the memory): a third of the cost of
    # viewing a torch uint8 tensor twice. A dtype numpy lacks (bfloat16, float8) is viewed as the
    # integer of its width first; the 64-byte alignment satisfies every element size.
    tensor = torch.from_numpy(np.ndarray(shape, numpy_dtype, block, offset))
    return tensor if tensor.dtype is torch_dtype else tensor.view(torch_dtype)


@functools.cache
def _torch_view_dtypes(name: str) -> tuple[np.dtype, Any]:
    """``(numpy dtype to view the bytes as, torch dtype)`` for the torch dtype called `name`."""
    import torch

    torch_dtype = getattr(torch, name)
    try:
        return torch.empty(0, dtype=torch_dtype).numpy().dtype, torch_dtype
    except TypeError:  # no numpy twin: the integer of the same width, then a torch view
        width = torch.empty(0, dtype=torch_dtype).element_size()
        return np.dtype({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[width]), torch_dtype


def join_payload(skeleton: bytes | memoryview, block: np.ndarray) -> Payload:
    """Unpickle `skeleton`, putting back views of `block` for its tensor slots."""
    data = memoryview(skeleton)
    if data[0] == _FLAT:
        table, keys, values, positions = pickle.loads(data[1:])
        if not positions:
            return dict(zip(keys, values))
        for position, entry in zip(positions, table):
            values[position] = _view(block, *entry)
        return dict(zip(keys, values))
    file = io.BytesIO(data)
    views = [_view(block, *entry) for entry in pickle.load(file)]

    def persistent_load(pid: Any) -> Any:
        if type(pid) is not int or not 0 <= pid < len(views):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return views[pid]

    unpickler = pickle.Unpickler(file)
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]  # the C unpickler's hook
    return unpickler.load()
