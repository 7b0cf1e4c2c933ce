"""HunyuanImage-3.0's routed experts, one matmul per expert, on one CUDA stream or several (not a test;
an experiment).

    python bench/hunyuan_expert_streams.py --device cpu --dtype float32 --tokens 512 --hidden 256 --intermediate 192   # smoke test
    OMNI_BENCH=hunyuan_expert_streams bash bench/gpu/run.sh gpu          # a CUDA machine

The dit stage runs a layer's routed experts as ~130 dense matmuls (`omni_hunyuan.layers.per_expert_mm`:
up for every expert, SwiGLU over all rows, down for every expert), one after the other on one stream.
Each matmul of ~4,096 rows is a few waves of output tiles; its last wave leaves SMs idle until the next
matmul starts. This times the served loop against the same matmuls dealt round-robin to 2 or 3
streams (each expert's up and down on its own stream, so a matmul's tail overlaps the next one's
head), with and without the shared expert's matmuls on a stream of their own, and against
``torch._grouped_mm``; each variant's output is compared with the served one's (largest difference;
the streamed variants run the same kernels on the same rows). The expert counts come from a top-k of
random router logits (``--skews`` tilts them, as a trained router's uneven loads would). Written to ``$OUT/hunyuan-expert-streams-<preset>.md``.

Measured on an H100 (bench/results/hunyuan-expert-streams-h100.md): two streams 1.034x alone, three
0.976x, the shared expert on a side stream 1.051x; in the served dit stage two streams made no more
images/s (0.1995 against 0.2006 on one stream, at concurrency 4), so the plugin keeps one stream.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from omni_hunyuan.layers import per_expert_mm, swiglu

from diffusion import matmul_ceiling, timed, write_table


def streamed_mm(x: torch.Tensor, weights: torch.Tensor, counts: list[int], streams: list[torch.cuda.Stream]) -> torch.Tensor:
    """`per_expert_mm` with expert e's matmul on ``streams[e % len(streams)]``, joined at the end."""
    out = x.new_empty(x.shape[0], weights.shape[1])
    current = torch.cuda.current_stream()
    for stream in streams:
        stream.wait_stream(current)
    for e, (rows, weight, into) in enumerate(zip(x.split(counts), weights.transpose(1, 2).unbind(0), out.split(counts), strict=True)):
        if rows.shape[0]:
            with torch.cuda.stream(streams[e % len(streams)]):
                torch.mm(rows, weight, out=into)
    for stream in streams:
        current.wait_stream(stream)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=8 * 4097, help="tokens of one forward (concurrency 4: 8 rows of 4,097)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--skews", default="0,1", help="router logits' per-expert offsets: skew x randn (0: near-even loads)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device).manual_seed(0)
    hidden, inter = args.hidden, args.intermediate
    tokens = torch.randn(args.tokens, hidden, device=device, generator=generator).to(dtype)
    up = (torch.randn(args.experts, 2 * inter, hidden, device=device, generator=generator) * hidden**-0.5).to(dtype)
    down = (torch.randn(args.experts, hidden, inter, device=device, generator=generator) * inter**-0.5).to(dtype)
    shared_up = (torch.randn(2 * inter, hidden, device=device, generator=generator) * hidden**-0.5).to(dtype)
    shared_down = (torch.randn(hidden, inter, device=device, generator=generator) * inter**-0.5).to(dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ceiling = matmul_ceiling(args.device, args.dtype, 8192 if device.type == "cuda" else 1024)
    lines = [
        f"## HunyuanImage-3.0 routed experts on one stream or several, {name} (torch {torch.__version__})",
        "",
        f"{args.tokens} tokens x top {args.topk} of {args.experts} experts, hidden {hidden}, intermediate {inter}, "
        f"{args.dtype}; matmul ceiling {ceiling / 1e12:.1f} TFLOP/s; ms per call (up, SwiGLU, down; "
        f"\"+ shared\": the shared expert's too), best of {args.repeats}",
        "",
        "| skew | loads (min-max rows) | variant | ms | TFLOP/s | vs served | max diff |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    streams = [torch.cuda.Stream(device) for _ in range(3)] if device.type == "cuda" else []
    for skew in map(float, args.skews.split(",")):
        bias = torch.randn(args.experts, device=device, generator=generator) * skew
        logits = torch.randn(args.tokens, args.experts, device=device, generator=generator) + bias
        chosen = logits.topk(args.topk, dim=-1).indices
        experts, order = chosen.reshape(-1).sort(stable=True)
        counts = torch.bincount(experts, minlength=args.experts).tolist()
        x = tokens.index_select(0, order // args.topk)
        ends = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        routed_flops = 2 * x.shape[0] * hidden * 3 * inter
        shared_flops = 2 * args.tokens * hidden * 3 * inter

        def served() -> torch.Tensor:
            return per_expert_mm(swiglu(per_expert_mm(x, up, counts)), down, counts)

        def shared() -> torch.Tensor:
            return F.linear(swiglu(F.linear(tokens, shared_up)), shared_down)

        variants: list[tuple[str, Callable[[], torch.Tensor], int]] = [("per-expert, one stream (served)", served, routed_flops)]
        if device.type == "cuda":
            for n in (2, 3):
                variants.append((
                    f"per-expert, {n} streams",
                    lambda n=n: streamed_mm(swiglu(streamed_mm(x, up, counts, streams[:n])), down, counts, streams[:n]),
                    routed_flops,
                ))
            variants.append((
                "grouped_mm",
                lambda: torch._grouped_mm(swiglu(torch._grouped_mm(x, up.transpose(1, 2), offs=ends)), down.transpose(1, 2), offs=ends),
                routed_flops,
            ))

            def shared_beside(n: int) -> torch.Tensor:
                side = streams[2]
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    s = shared()
                out = streamed_mm(swiglu(streamed_mm(x, up, counts, streams[:n])), down, counts, streams[:n]) if n > 1 else served()
                torch.cuda.current_stream().wait_stream(side)
                return out + s.sum() * 0

            variants.append(("per-expert + shared, one stream (served)", lambda: served() + shared().sum() * 0, routed_flops + shared_flops))
            variants.append(("per-expert + shared on a side stream", lambda: shared_beside(1), routed_flops + shared_flops))
            variants.append(("per-expert, 2 streams + shared on a third", lambda: shared_beside(2), routed_flops + shared_flops))
        baseline: dict[int, float] = {}
        reference = served()
        with torch.no_grad():
            for label, fn, flops in variants:
                seconds = timed(args.device, fn, args.repeats)
                base = baseline.setdefault(flops, seconds)
                diff = (fn().float() - reference.float()).abs().max().item()
                lines.append(
                    f"| {skew:g} | {min(counts)}-{max(counts)} | {label} | {seconds * 1e3:.3f} | {flops / seconds / 1e12:.1f} | "
                    f"{base / seconds:.3f}x | {diff:.1e} |"
                )
                print(lines[-1], flush=True)
    write_table(lines, args.out / f"hunyuan-expert-streams-{args.preset}.md")


if __name__ == "__main__":
    main()
