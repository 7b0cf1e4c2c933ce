"""HunyuanImage-3.0's fp32 router product, laid out several ways (not a test; an experiment).

    python bench/hunyuan_router.py --device cpu --tokens 512        # a CPU smoke test
    OMNI_BENCH=hunyuan_router bash bench/gpu/run.sh gpu             # a CUDA machine

Every MoE layer routes its tokens with an fp32 product: ``softmax(tokens.float() @ wg.T)``, ``wg``
``[64, 4096]`` kept fp32 as released (`omni_hunyuan.layers.Router`). At concurrency 4 (8 rows of
4,097 tokens: 32,776 tokens) the profile of the served code gives it 4.7 ms a step over 8 layers, in
cuBLAS's fp32 kernel at ~29 TFLOP/s (`bench/results/hunyuan-gaps-h100-8layers-scatter.md`): a skinny
product (64 outputs) without tensor cores. This times, in fp32 throughout (no TF32: the
release's precision), the product as served (`F.linear`), transposed (64 rows of output, each of
them a long one), split along K into ``--splits`` partial products summed in fp32 (more tiles in
flight), and under `torch.compile` (inductor's choice), with each variant's largest difference from
an fp64 product relative to the logits' range. Written to ``$OUT/hunyuan-router-<preset>.md``.

Measured on an H100 (bench/results/hunyuan-router-h100.md): the transposed product and a 2-way split
along K at 1.24x the served one (0.19 ms a layer, ~0.4% of a concurrency-4 step), inductor's fp32
Triton templates slower than cuBLAS. The plugin keeps `F.linear`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from diffusion import timed, write_table


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """As served: ``F.linear`` of the fp32 tokens."""
    return F.linear(x.float(), w)


def transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(w @ x.T).T``: the same sums, the 64 outputs as rows."""
    return (w @ x.float().T).T


def split_k(splits: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """K cut into `splits` slices: one batched product of the slices, their partial sums added in fp32."""

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        xs = x.float().view(tokens, splits, hidden // splits).transpose(0, 1)
        ws = w.view(w.shape[0], splits, hidden // splits).permute(1, 2, 0)
        return torch.bmm(xs, ws).sum(0)

    return product


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", help="the tokens' dtype (the model's)")
    parser.add_argument("--tokens", type=int, default=8 * 4097, help="tokens of one forward (concurrency 4: 8 rows of 4,097)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--splits", default="2,4,8,16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False  # (the default; stated: the router is fp32)
    device = torch.device(args.device)
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=device, generator=generator).to(getattr(torch, args.dtype))
    w = torch.randn(args.experts, args.hidden, device=device, generator=generator) * args.hidden**-0.5
    exact = x.double() @ w.double().T
    span = (exact.max() - exact.min()).item()
    variants: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = [
        ("F.linear (served)", linear),
        ("transposed", transposed),
        *[(f"split K x{s}", split_k(s)) for s in map(int, args.splits.split(",")) if args.hidden % s == 0],
        ("F.linear, torch.compile", torch.compile(linear, dynamic=False)),
        ("F.linear, torch.compile max-autotune", torch.compile(linear, dynamic=False, mode="max-autotune-no-cudagraphs")),
    ]
    flops = 2 * args.tokens * args.hidden * args.experts
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [
        f"## HunyuanImage-3.0's fp32 router product, {name} (torch {torch.__version__})",
        "",
        f"{args.tokens} tokens ({args.dtype}) x {args.hidden} -> {args.experts} experts, fp32 products (TF32 off); "
        f"ms per call, best of {args.repeats}; error: largest |difference| from the fp64 product over the logits' range",
        "",
        "| product | ms | TFLOP/s | vs served | error |",
        "|---|---:|---:|---:|---:|",
    ]
    served = None
    with torch.no_grad():
        for label, fn in variants:
            try:
                seconds = timed(args.device, lambda fn=fn: fn(x, w), args.repeats)
                error = ((fn(x, w).double() - exact).abs().max().item()) / span
            except Exception as exc:  # noqa: BLE001 (a variant the backend refuses is a row, not the end)
                lines.append(f"| {label} | - | - | - | {type(exc).__name__}: {str(exc)[:80]} |")
                continue
            served = served or seconds
            lines.append(f"| {label} | {seconds * 1e3:.3f} | {flops / seconds / 1e12:.1f} | {served / seconds:.2f}x | {error:.1e} |")
            print(lines[-1], flush=True)
    write_table(lines, args.out / f"hunyuan-router-{args.preset}.md")


if __name__ == "__main__":
    main()
