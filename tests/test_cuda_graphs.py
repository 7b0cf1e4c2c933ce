"""`GraphCache`'s bookkeeping (when to record, what to replay, what to drop), on CPU.

CI has no GPU: a stand-in "graph" that re-runs the function into the recorded output buffer takes
the place of `torch.cuda.CUDAGraph`; the real recording is exercised by `bench/diffusion.py
--cuda-graphs` on a GPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from omni_core.stages.cuda_graphs import GraphCache, _Graph


class _Replay:
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], static_in: torch.Tensor, static_out: torch.Tensor) -> None:
        self.fn, self.static_in, self.static_out = fn, static_in, static_out

    def replay(self) -> None:
        self.static_out.copy_(self.fn(self.static_in))


class CpuGraphs(GraphCache):
    def _recordable(self, x: torch.Tensor) -> bool:
        return True

    def _record(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, keepalive: Any) -> _Graph:
        static_in = x.clone()
        static_out = fn(static_in)
        self.recorded += 1
        return _Graph(_Replay(fn, static_in, static_out), static_in, static_out, keepalive)


def test_records_on_the_second_call_of_a_key_then_replays() -> None:
    graphs, calls = CpuGraphs(size=2), []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2

    x = torch.arange(4.0)
    assert torch.equal(graphs.run("a", double, x), x * 2) and graphs.recorded == 0  # first sight: eager
    assert torch.equal(graphs.run("a", double, x + 1), (x + 1) * 2) and graphs.recorded == 1
    assert torch.equal(graphs.run("a", double, x + 2), (x + 2) * 2)  # replayed with the new input
    assert graphs.recorded == 1 and graphs.replayed == 2


def test_a_new_shape_or_key_is_a_new_graph_and_old_ones_are_dropped() -> None:
    graphs = CpuGraphs(size=2)
    keep = object()
    for key, size in [("a", 4), ("a", 4), ("a", 5), ("a", 5), ("b", 4), ("b", 4)]:
        out = graphs.run(key, lambda t: t + 1, torch.zeros(size), keepalive=keep)
        assert torch.equal(out, torch.ones(size))
    assert graphs.recorded == 3 and len(graphs._graphs) == 2  # ("a", 4) was the least recently used
    assert all(entry.keepalive is keep for entry in graphs._graphs.values())


def test_alternating_keys_stay_eager() -> None:
    graphs = CpuGraphs()
    for i in range(6):
        graphs.run("ab"[i % 2], lambda t: t, torch.zeros(2))
    assert graphs.recorded == 0 and graphs.replayed == 0


def test_off_cuda_the_real_cache_only_calls_the_function() -> None:
    graphs = GraphCache()
    for _ in range(3):
        assert torch.equal(graphs.run("a", lambda t: t * 3, torch.ones(2)), torch.full((2,), 3.0))
    assert graphs.recorded == 0
