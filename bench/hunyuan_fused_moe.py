"""Fused MoE expert GEMMs in Triton against what HunyuanImage-3.0's ``dit`` runs (not a test; an experiment).

    TRITON_INTERPRET=1 python bench/hunyuan_fused_moe.py --device cpu --dtype float32 --hidden 64 --intermediate 32 --experts 8 --tokens 50
                       # a CPU smoke test in Triton's interpreter (pip install triton: scripts/install.sh removes it)
    OMNI_BENCH=hunyuan_fused_moe bash bench/gpu/run.sh gpu                      # a CUDA machine

`MoE.grouped_experts` (omni_hunyuan/layers.py) runs a routed layer's experts as: the experts' input
rows in expert order (`LayerKernels.rows`: the compiled `scatter_rows`, or ``index_select``), one
cuBLAS matmul per expert for the ``[up; gate]`` projection, the compiled SwiGLU, one cuBLAS matmul
per expert for the down projection. This file holds the fusion that would remove the two
memory-bound passes around the first GEMM: `gathered_swiglu`, one Triton kernel that loads each
pair's token row by index, multiplies it with its expert's up and gate rows into two fp32
accumulators and writes ``up * silu(gate)`` (each rounded to bf16 first, as the unfused path rounds
the GEMM's output); and `expert_mm`, the down projection as one Triton kernel (no host sync). Tiles
never straddle experts: `tile_map` lays each expert's rows out in tiles on the GPU.

At HunyuanImage-3.0's widths (hidden 4096, 64 experts of 3072, top 8), for the tokens of a denoising
forward at concurrency 1 and 4 (CFG: 2 and 8 rows of 1 + 4096 tokens), it times each `Blocks`
configuration against the unfused path and its parts, the row gathers against each other, and prints
milliseconds, TFLOP/s, the ratio to the unfused path and the largest difference to it (in units of
the output's bf16 spacing). Written to ``$OUT/hunyuan-fused-moe-<preset>.md``.

Measured on an H100 (bench/results/hunyuan-fused-moe-h100.md): the best configuration of the first
projection ran at 0.958x the unfused path at concurrency 4 (587 TFLOP/s against cuBLAS's 695 for the
GEMM alone), the down projection at 0.886x cuBLAS: Triton's GEMM here is ~15% short of cuBLAS, more
than the two passes it saves. Not used by the plugin. The row gathers: `scatter_rows` 1.63x
``index_select`` at concurrency 4 (the plugin's compiled pieces use it).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from diffusion import write_table
from omni_hunyuan.layers import gather_rows, per_expert_mm, scatter_rows, swiglu


@attrs.frozen
class Tiles:
    """Where the programs' row tiles lie (`tile_map`): tile ``t`` is expert ``expert[t]``'s rows
    ``begin[t]`` up to ``min(begin[t] + block_m, end[t])``; ``count`` (a one-element tensor) says how
    many of the ``len(expert)`` slots are tiles."""

    expert: torch.Tensor
    begin: torch.Tensor
    end: torch.Tensor
    count: torch.Tensor


def tile_map(ends: torch.Tensor, rows: int, block_m: int) -> Tiles:
    """`Tiles` of ``block_m`` rows for experts whose pairs end at ``ends`` (int32 ``[E]``, sorted
    order), ``rows`` pairs in all. Computed on the device of ``ends``: no host sync."""
    experts = ends.shape[0]
    ends = ends.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    last = tiles.cumsum(0)
    slots = torch.arange(-(-rows // block_m) + experts, device=ends.device)
    expert = torch.searchsorted(last, slots, right=True).clamp_(max=experts - 1)
    begin = starts[expert] + (slots - (last - tiles)[expert]) * block_m
    return Tiles(expert.to(torch.int32), begin.to(torch.int32), ends[expert].to(torch.int32), last[-1:].to(torch.int32))


@attrs.frozen
class Blocks:
    """One launch configuration of `gathered_swiglu` and `expert_mm`."""

    block_m: int = 128
    block_n: int = 128  # columns of up (and as many of gate) a program computes
    block_k: int = 64
    group_m: int = 8  # row tiles that walk the columns together (their weights stay in L2)
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False  # the weights through a TMA descriptor (Hopper), the rows by index

    def fits(self, hidden: int, intermediate: int) -> bool:
        return hidden % self.block_k == 0 and intermediate % self.block_n == 0

    @classmethod
    def for_shape(cls, hidden: int, intermediate: int) -> Blocks:
        """The default tiles, narrowed where the widths do not divide by them (small checkpoints)."""
        block_n = next((n for n in (128, 64, 32, 16) if intermediate % n == 0), None)
        block_k = next((k for k in (64, 32, 16) if hidden % k == 0), None)
        if block_n is None or block_k is None:
            raise ValueError(f"gathered_swiglu needs H ({hidden}) and I ({intermediate}) divisible by 16")
        return cls(block_n=block_n, block_k=block_k)


def gathered_swiglu(
    tokens: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor, blocks: Blocks | None = None
) -> torch.Tensor:
    """``swiglu(tokens[rows] @ weights[e].T)`` for each expert e's slice of ``rows`` (``ends``: int32
    ``[E]``, where each expert's rows end), in one kernel: ``[len(rows), I]``.

    ``tokens`` ``[T, H]``, ``rows`` ``[N]`` (the token of each pair, in expert order), ``weights``
    ``[E, 2I, H]`` with rows ``[up; gate]`` (the release's ``gate_and_up_proj``), all contiguous on one
    device."""
    return _launch(tokens, rows, weights, ends, weights.shape[1] // 2, blocks, swiglu=True)


def expert_mm(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor, blocks: Blocks | None = None) -> torch.Tensor:
    """``x[rows of e] @ weights[e].T`` for each expert e's rows of ``x`` ``[N, K]`` (in expert order;
    ``ends`` as `gathered_swiglu`'s), ``weights`` ``[E, out, K]``: ``[N, out]``, no host sync (the
    second projection after `gathered_swiglu`)."""
    return _launch(x, None, weights, ends, weights.shape[1], blocks, swiglu=False)


def _launch(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    weights: torch.Tensor,
    ends: torch.Tensor,
    width: int,
    blocks: Blocks | None,
    swiglu: bool,
) -> torch.Tensor:
    experts, stacked, depth = weights.shape
    blocks = Blocks.for_shape(depth, width) if blocks is None else blocks
    if not blocks.fits(depth, width):
        raise ValueError(f"expert GEMM: K={depth} and N={width} must divide by {blocks.block_k} and {blocks.block_n}")
    if not (x.is_contiguous() and weights.is_contiguous() and x.shape[1] == depth):
        raise ValueError(f"expert GEMM: contiguous x [*, {depth}] and weights [E, *, {depth}], not {tuple(x.shape)}")
    pairs = x.shape[0] if rows is None else rows.shape[0]
    out = x.new_empty(pairs, width)
    if pairs == 0:
        return out
    tiles = tile_map(ends, pairs, blocks.block_m)
    columns = width // blocks.block_n
    grid = (tiles.expert.shape[0] * columns,)
    if blocks.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w = TensorDescriptor.from_tensor(weights.view(experts * stacked, depth), [blocks.block_n, blocks.block_k])
    else:
        w = weights
    _kernel()[grid](
        x, x if rows is None else rows, w, out, tiles.expert, tiles.begin, tiles.end, tiles.count,
        depth, width, stacked, columns,
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, GROUP_M=blocks.group_m,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", TMA=blocks.tma,
        GATHER=rows is not None, SWIGLU=swiglu,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    return out


@functools.cache
def _kernel():  # noqa: C901 (one Triton program)
    import triton
    import triton.language as tl

    @triton.jit
    def expert_gemm_kernel(
        x_ptr, rows_ptr, w_ptr, out_ptr, expert_ptr, begin_ptr, end_ptr, count_ptr,
        depth, width, stacked, columns,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PRECISION: tl.constexpr, TMA: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        count = tl.load(count_ptr)
        # Grouped order: GROUP_M row tiles take each column block in turn.
        span = GROUP_M * columns
        first = (pid // span) * GROUP_M
        if first >= count:
            return
        size = tl.minimum(count - first, GROUP_M)
        if pid % span >= size * columns:  # (the grid is sized for the most tiles a routing can need)
            return
        tile = first + (pid % span) % size
        column = (pid % span) // size

        expert = tl.load(expert_ptr + tile)
        begin = tl.load(begin_ptr + tile)
        end = tl.load(end_ptr + tile)
        pair = begin + tl.arange(0, BLOCK_M)
        valid = pair < end
        if GATHER:
            row = tl.load(rows_ptr + pair, mask=valid, other=0).to(tl.int64)
        else:
            row = pair.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        x = x_ptr + row[:, None] * depth + offs_k[None, :]
        # This tile's first weight row (of up, for SwiGLU; gate's are `width` rows further).
        first_w = expert * stacked + column * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N) if SWIGLU else (16, 16), dtype=tl.float32)
        if not TMA:
            w = w_ptr + (first_w.to(tl.int64) + tl.arange(0, BLOCK_N))[None, :] * depth + offs_k[:, None]
        for k in range(0, depth, BLOCK_K):
            a = tl.load(x, mask=valid[:, None], other=0.0)
            if TMA:
                acc = tl.dot(a, w_ptr.load([first_w, k]).T, acc, input_precision=PRECISION)
                if SWIGLU:
                    acc_gate = tl.dot(a, w_ptr.load([first_w + width, k]).T, acc_gate, input_precision=PRECISION)
            else:
                acc = tl.dot(a, tl.load(w), acc, input_precision=PRECISION)
                if SWIGLU:
                    acc_gate = tl.dot(a, tl.load(w + width * depth), acc_gate, input_precision=PRECISION)
                w += BLOCK_K
            x += BLOCK_K

        if SWIGLU:
            # Rounded to the output dtype first, as the GEMM's output is before the unfused SwiGLU.
            up = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            gate = acc_gate.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = up * (gate / (1.0 + tl.exp(-gate)))
        offs_n = column * BLOCK_N + tl.arange(0, BLOCK_N)
        out = out_ptr + pair.to(tl.int64)[:, None] * width + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None])

    return expert_gemm_kernel


CONFIGS = (
    Blocks(128, 128, 64, 8, 8, 3),
    Blocks(128, 128, 64, 8, 8, 4),
    Blocks(128, 128, 32, 8, 8, 4),
    Blocks(128, 128, 64, 16, 8, 3),
    Blocks(128, 64, 64, 8, 4, 4),
    Blocks(64, 128, 64, 8, 4, 4),
    Blocks(128, 64, 64, 8, 8, 4),
    Blocks(128, 128, 64, 8, 8, 3, tma=True),
    Blocks(128, 128, 64, 8, 8, 4, tma=True),
    Blocks(128, 128, 64, 16, 8, 4, tma=True),
    Blocks(128, 256, 64, 8, 8, 3),
    Blocks(128, 256, 64, 8, 8, 3, tma=True),
)


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median milliseconds of `fn` over `repeats` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return sorted(times)[len(times) // 2]


def routing(tokens: int, experts: int, topk: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A random top-k routing as `MoE.dispatch` sorts it: each pair's token and place, each expert's end, the counts."""
    chosen = torch.randn(tokens, experts, device=device).topk(topk, dim=-1).indices
    experts_sorted, order = chosen.reshape(-1).sort(stable=True)
    ends = torch.searchsorted(experts_sorted, torch.arange(experts, device=device, dtype=experts_sorted.dtype), right=True)
    ends = ends.to(torch.int32)
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    return order // topk, inverse, ends, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--preset", default="h200", help="only names the output file")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="*", default=[2 * 4097, 8 * 4097], help="tokens a forward (c1, c4)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--gathers-only", action="store_true", help="time the row gathers only (no Triton)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    configs = () if args.gathers_only else CONFIGS if device.type == "cuda" else (Blocks(16, 16, 16, 2, 4, 1),)
    act = torch.compile(swiglu, dynamic=None) if device.type == "cuda" else swiglu
    scatter = torch.compile(scatter_rows, dynamic=None)
    weights = (torch.randn(args.experts, 2 * args.intermediate, args.hidden, device=device) / args.hidden**0.5).to(dtype)
    lines = [
        f"# gathered_swiglu against gather + per-expert cuBLAS + compiled SwiGLU ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'})",
        "",
        f"hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top {args.topk}, {args.dtype}; median of {args.repeats}.",
        "",
        "| tokens | pairs | what | ms | TFLOP/s | x unfused | max diff (bf16 ulps) |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    def each_config(
        name: str, run: Callable[[Blocks], torch.Tensor], want: torch.Tensor, flops: float, base: float, count: int
    ) -> list[str]:
        """A table row for `run` in each configuration: ms, TFLOP/s, x `base` (ms), the largest
        difference to `want` in bf16 spacings."""
        ulp = want.float().abs().clamp_min(1e-30).log2().floor().exp2() * 2.0**-7
        found = []
        for blocks in configs:
            label = f"| {count} | {want.shape[0]} | {name} {blocks.block_m}x{blocks.block_n}x{blocks.block_k} g{blocks.group_m} " + (
                f"w{blocks.num_warps} s{blocks.num_stages}{' tma' if blocks.tma else ''}"
            )
            try:
                diff = ((run(blocks).float() - want.float()).abs() / ulp).max().item()
                ms = timed(lambda blocks=blocks: run(blocks), args.repeats, device)
            except Exception as error:  # a configuration that does not compile or fit: reported, the rest go on
                found.append(f"{label} | failed: {type(error).__name__}: {str(error)[:80]} | | | |")
            else:
                found.append(f"{label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {base / ms:.3f} | {diff:.1f} |")
            print(found[-1], flush=True)
        return found

    for count in args.tokens:
        tokens = torch.randn(count, args.hidden, device=device).to(dtype)
        rows, inverse, ends, counts = routing(count, args.experts, args.topk, device)
        gathered = gather_rows(tokens, rows, inverse, args.topk)  # (the unfused path's first part: timed here)
        assert torch.equal(scatter(tokens, rows, inverse, args.topk), gathered)
        index_ms = timed(lambda: gather_rows(tokens, rows, inverse, args.topk), args.repeats, device)
        scatter_ms = timed(lambda: scatter(tokens, rows, inverse, args.topk), args.repeats, device)
        moved = rows.shape[0] * args.hidden * tokens.element_size() / 1e9  # GB written (and read once at best)
        lines.append(f"| {count} | {rows.shape[0]} | rows: index_select (gather_rows) | {index_ms:.3f} | | {index_ms / index_ms:.3f} | "
                     f"{moved / index_ms * 1e3:.0f} GB/s written |")
        lines.append(f"| {count} | {rows.shape[0]} | rows: compiled scatter_rows | {scatter_ms:.3f} | | {index_ms / scatter_ms:.3f} | "
                     f"{moved / scatter_ms * 1e3:.0f} GB/s written |")
        print("\n".join(lines[-2:]), flush=True)
        if args.gathers_only:
            continue
        flops = 2.0 * rows.shape[0] * args.hidden * 2 * args.intermediate

        def unfused(tokens=tokens, rows=rows, counts=counts) -> torch.Tensor:
            return act(per_expert_mm(tokens.index_select(0, rows), weights, counts))

        reference = unfused()
        fused_out = per_expert_mm(gathered, weights, counts)
        base = timed(unfused, args.repeats, device)
        parts = {
            "unfused (all three)": base,
            "  per-expert cuBLAS": timed(lambda: per_expert_mm(gathered, weights, counts), args.repeats, device),
            "  compiled swiglu": timed(lambda: act(fused_out), args.repeats, device),
        }
        for name, ms in parts.items():
            tflops = flops / ms / 1e9 if "cuBLAS" in name or name.startswith("unfused") else float("nan")
            lines.append(f"| {count} | {rows.shape[0]} | {name} | {ms:.3f} | {tflops:.0f} | {base / ms:.3f} | |")
        lines += each_config("fused", lambda b: gathered_swiglu(tokens, rows, weights, ends, b), reference, flops, base, count)
        # The second projection ([N, I] in expert order times [E, H, I]): cuBLAS per expert, torch's grouped kernel, ours.
        down = (torch.randn(args.experts, args.hidden, args.intermediate, device=device) / args.intermediate**0.5).to(dtype)
        flops = 2.0 * rows.shape[0] * args.hidden * args.intermediate
        want = per_expert_mm(reference, down, counts)
        base = timed(lambda: per_expert_mm(reference, down, counts), args.repeats, device)
        lines.append(f"| {count} | {rows.shape[0]} | down: per-expert cuBLAS | {base:.3f} | {flops / base / 1e9:.0f} | 1.000 | |")
        if device.type == "cuda":
            ms = timed(lambda: torch._grouped_mm(reference, down.transpose(1, 2), offs=ends), args.repeats, device)
            lines.append(f"| {count} | {rows.shape[0]} | down: torch._grouped_mm | {ms:.3f} | {flops / ms / 1e9:.0f} | {base / ms:.3f} | |")
        lines += each_config("down: expert_mm", lambda b: expert_mm(reference, down, ends, b), want, flops, base, count)
    write_table(lines, Path(os.environ.get("OUT", ".")) / f"hunyuan-fused-moe-{args.preset}.md")


if __name__ == "__main__":
    main()
