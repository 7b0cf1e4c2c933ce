"""The core's FP8 linear (`omni_core.quantization`, a dit stage's ``quantization: fp8``) against bf16 (not a test).

    OMNI_BENCH=fp8_linear bash bench/gpu/run.sh h200          # the H200 (needs FP8 tensor cores)

For DiT-sized shapes (token rows x in -> out features), one linear call's time: bf16 ``F.linear`` (the
baseline, 1.00x), the layer as it was (one scale per tensor, exact fp32 accumulation) and as it is (a
scale per token row and per output channel, Hopper's fast accumulation, the activation's scaling one
compiled kernel even in an eager model), in an eager and in a compiled model. Each row: time, TFLOP/s, ratio to bf16,
and the error against an fp32 matmul of the same bf16 operands (max abs error / max abs output).
Tables to stdout and ``$OUT/fp8-linear-<preset>.md``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from diffusion import matmul_ceiling, timed, write_table

SHAPES = [(16384, 3072, 3072), (16384, 3072, 12288), (16384, 12288, 3072), (65536, 5120, 5120), (65536, 5120, 13824)]


def per_tensor(torch):  # the layer before row-wise scales, kept here as the comparison
    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max

    def prepare(w):
        scale = (w.float().abs().amax() / top).reshape(())
        return (w.float() / scale).to(fp8), scale

    def forward(x, w8, w_scale):
        scale = (x.abs().amax().float() / top).reshape(())
        x8 = (x.float() / scale).to(fp8)
        return torch._scaled_mm(x8, w8.t(), scale_a=scale, scale_b=w_scale, out_dtype=torch.bfloat16)

    return prepare, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="h200")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from omni_core.quantization import _fp8_class

    ceiling = matmul_ceiling(args.device, "bfloat16", 8192)
    prepare, forward_tensor = per_tensor(torch)
    compiled_tensor = torch.compile(forward_tensor)
    lines = [f"## The core's FP8 linear vs bf16, {args.preset}: bf16 matmul ceiling {ceiling / 1e12:.1f} TFLOP/s", "",
             "| rows x in -> out | layer | ms | TFLOP/s | vs bf16 | error vs fp32 |", "|---|---|---:|---:|---:|---:|"]
    torch.manual_seed(0)
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)
        linear = torch.nn.Linear(k, n, bias=False, device=args.device, dtype=torch.bfloat16)
        with torch.no_grad():
            exact = x.float() @ linear.weight.float().t()
            row_layer = _fp8_class().from_linear(linear)
            w8, w_scale = prepare(linear.weight)
            compiled_row = torch.compile(row_layer)
            systems = [
                ("bf16 F.linear", lambda: F.linear(x, linear.weight)),
                ("fp8 per tensor, exact accumulation (before)", lambda: forward_tensor(x, w8, w_scale)),
                ("fp8 per tensor, compiled (before)", lambda: compiled_tensor(x, w8, w_scale)),
                ("fp8 per row/channel, fast accumulation, in an eager model (now)", lambda: row_layer(x)),
                ("fp8 per row/channel, in a compiled model (now)", lambda: compiled_row(x)),
            ]
            base = None
            for name, fn in systems:
                seconds = timed(args.device, fn, args.repeats)
                base = base or seconds
                error = ((fn().float() - exact).abs().max() / exact.abs().max()).item()
                flops = 2 * m * k * n / seconds
                lines.append(f"| {m} x {k} -> {n} | {name} | {seconds * 1e3:.3f} | {flops / 1e12:.0f} | {base / seconds:.2f}x | {error:.4f} |")
    write_table(lines, Path(os.environ.get("OUT", ".")) / f"fp8-linear-{args.preset}.md")


if __name__ == "__main__":
    main()
