"""MiniMax-H3: one DiT block over four 480p requests' rows, its second half in one call or in pieces.

    python bench/minimax_block_memory.py                           # CPU, float32, 1/7 of the released width
    python bench/minimax_block_memory.py --device cuda --dtype bfloat16 --width 1   # the released width, one GPU

The dit stage runs each block's second half (the modulated norm, the SwiGLU feed-forward, the gated
residual: per row) on at most `BlockKernels.rows` rows at a time (`omni_minimax_h3.packed`): its
feed-forward intermediate is then that of about one request, not of every request in the step.
This measures what that saves: the block (`MiniMaxH3Transformer3DModel`'s block at ``--width`` times
the released 5376 / 56 heads / SwiGLU 14336, the same ratios) runs on ``--requests`` requests of
``--rows`` rows each (14,851: a 832x480, 124-frame t2va request's packed rows), with attention per
request, once with the second half in one call ("whole", the baseline) and once in pieces of
`FEED_FORWARD_ROWS`. Each configuration runs in its own process (so one's peak is not the other's):
peak memory growth over the inputs (CPU: the process's maximum RSS; CUDA:
``torch.cuda.max_memory_allocated``), time, and whether the outputs are equal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

RELEASED = {"hidden_size": 5376, "num_attention_heads": 56, "attention_head_dim": 128, "ffn_dim": 14336}


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One configuration, in this process."""
    import resource
    import time

    import torch
    from diffusers import MiniMaxH3Transformer3DModel
    from omni_minimax_h3.packed import BlockKernels, Segments, run_block, use_segmented_attention

    torch.manual_seed(0)
    heads = max(1, round(RELEASED["num_attention_heads"] * args.width))
    hidden = round(RELEASED["hidden_size"] * args.width / 64) * 64
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    model = MiniMaxH3Transformer3DModel(
        num_layers=1, num_refiner_layers=1, num_attention_heads=heads, attention_head_dim=128, hidden_size=hidden,
        ffn_dim=round(RELEASED["ffn_dim"] * args.width / 64) * 64, text_dim=64, time_embed_hidden_dim=hidden, time_embed_dim=hidden // 2,
    ).eval().to(device, dtype)
    use_segmented_attention(model)
    lengths = [args.rows] * args.requests
    total = sum(lengths)
    cuda = device.type == "cuda"
    with torch.inference_mode():
        rotary = model.rope(torch.zeros(total, 3, device=device))
        temb = model.time_embedder(model.time_proj(torch.tensor([500.0], device=device)).to(dtype))
        x = torch.randn(1, total, hidden, device=device, dtype=dtype)
        adaln = torch.zeros(total, dtype=torch.long, device=device)
        kernels = BlockKernels(rows=args.pieces or 10**12)
        block = model.transformer_blocks[0]
        run_block(block, x[:, : args.rows], temb, adaln[: args.rows], (rotary[0][: args.rows], rotary[1][: args.rows]),
                  Segments.of_lengths([args.rows]), kernels)  # warm-up on one request
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        else:
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        start = time.perf_counter()
        out = run_block(block, x, temb, adaln, rotary, Segments.of_lengths(lengths), kernels)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        digest = float(out.float().abs().sum())
    return {"peak_gib": (peak - base) / 2**30, "seconds": seconds, "digest": digest, "hidden": hidden, "heads": heads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--width", type=float, default=1 / 7, help="fraction of the released widths")
    parser.add_argument("--rows", type=int, default=14851, help="rows of one request (832x480, 124 frames)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--pieces", type=int, default=None, help=argparse.SUPPRESS)  # (set per child process)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    from omni_minimax_h3.packed import FEED_FORWARD_ROWS

    results = {}
    for label, pieces in (("whole", None), (f"pieces of {FEED_FORWARD_ROWS}", FEED_FORWARD_ROWS)):
        command = [sys.executable, __file__, "--child", "--device", args.device, "--dtype", args.dtype, "--width", str(args.width),
                   "--rows", str(args.rows), "--requests", str(args.requests)] + (["--pieces", str(pieces)] if pieces else [])
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    whole = results["whole"]
    print(f"## One MiniMax-H3 block, {args.requests} requests x {args.rows} rows, {args.device}, {args.dtype}, "
          f"hidden {whole['hidden']} ({whole['heads']} heads), {args.width:.3g}x the released widths\n")
    print("| second half | peak growth (GiB) | vs whole | time (s) | vs whole | output equal |")
    print("|---|---:|---:|---:|---:|---|")
    for label, r in results.items():
        print(f"| {label} | {r['peak_gib']:.2f} | {r['peak_gib'] / whole['peak_gib']:.2f}x | {r['seconds']:.2f} | "
              f"{r['seconds'] / whole['seconds']:.2f}x | {'yes' if abs(r['digest'] - whole['digest']) <= 1e-5 * abs(whole['digest']) else 'no'} |")


if __name__ == "__main__":
    main()
