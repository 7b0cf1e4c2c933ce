"""CUDA graph replay of a model part's repeated forward (e.g. a denoiser's transformer stack).

A diffusion step of a small model at a moderate batch is bound by the host launching its kernels
(hundreds per step), not by the GPU. `GraphCache.run(key, fn, x)` records ``fn(x)`` as a CUDA
graph and replays it while the same `key` comes back: one launch per step. Recording costs about
two forwards, so a key is recorded only when it is seen twice in a row (a batch whose composition
changes every step stays eager). Off CUDA, `run` just calls ``fn``.

The graph reads its inputs at the addresses they had when recorded: ``fn`` may only read `x` (copied
into the graph's own input buffer on every replay) and tensors that `keepalive` holds, which the
cache keeps alive as long as the graph; the key must change whenever those tensors change.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch


@attrs.define(eq=False)
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: torch.Tensor
    keepalive: Any


class GraphCache:
    """Recorded graphs by key, least recently used dropped past `size`."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._last: Hashable | None = None
        self.recorded = 0  # graphs recorded so far (tests, benchmarks)
        self.replayed = 0

    def run(self, key: Hashable, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, keepalive: Any = None) -> torch.Tensor:
        """``fn(x)``, replayed from a graph when `key` was seen on the previous call too.

        The returned tensor is the graph's output buffer: read it before the next `run` of this key.
        """
        if not self._recordable(x):
            return fn(x)
        key = (key, tuple(x.shape), x.dtype)
        entry = self._graphs.get(key)
        if entry is None:
            if self._last != key:
                self._last = key
                return fn(x)
            entry = self._record(fn, x, keepalive)
            self._graphs[key] = entry
            while len(self._graphs) > self.size:
                self._graphs.popitem(last=False)
        self._last = key
        self._graphs.move_to_end(key)
        entry.static_in.copy_(x)
        entry.graph.replay()
        self.replayed += 1
        return entry.static_out

    def _recordable(self, x: torch.Tensor) -> bool:
        return x.is_cuda

    def _record(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, keepalive: Any) -> _Graph:
        import torch

        static_in = x.clone()
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
            fn(static_in)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn(static_in)
        self.recorded += 1
        return _Graph(graph, static_in, static_out, keepalive)

    def clear(self) -> None:
        self._graphs.clear()
        self._last = None
