"""MiniMax-H3: one DiT block over four 480p requests' rows, in one call or in groups of requests.

    python bench/minimax_block_memory.py                           # CPU, float32, 1/7 of the released width
    python bench/minimax_block_memory.py --device cuda --dtype bfloat16 --width 1   # the released width, one GPU
    OMNI_BENCH=minimax_block_memory bash bench/gpu/run.sh h200 --width 1           # the same on the device machine

The dit stage runs each block on groups of consecutive requests of at most `BlockKernels.rows`
rows (`omni_minimax_h3.packed.run_block`: every op but attention is per row, attention is per
request), the block's second half in pieces of at most that many: its activations are then those
of about one request, not of every request in the step. This measures what that saves: the block (`MiniMaxH3Transformer3DModel`'s block at ``--width`` times
the released 5376 / 56 heads / SwiGLU 14336, the same ratios) runs on ``--requests`` requests of
``--rows`` rows each (14,851: a 832x480, 124-frame t2va request's packed rows), with attention per
request, once in one call over every row ("one call", the baseline: what the stage did before) and
once in groups of at most `BLOCK_ROWS` rows. Each configuration runs in its own process (so one's peak is not the other's):
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
        if cuda:  # (a warm-up on one request: kernels and workspaces; not on CPU, whose peak RSS would keep it)
            run_block(block, x[:, : args.rows], temb, adaln[: args.rows], (rotary[0][: args.rows], rotary[1][: args.rows]),
                      Segments.of_lengths([args.rows]), kernels)
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
    parser.add_argument("--preset", default=None, help="ignored (bench/gpu/run.sh passes one; --width sets the widths)")
    parser.add_argument("--pieces", type=int, default=None, help=argparse.SUPPRESS)  # (set per child process)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    from omni_minimax_h3.packed import BLOCK_ROWS

    results = {}
    for label, pieces in (("one call", None), (f"groups of <= {BLOCK_ROWS} rows", BLOCK_ROWS)):
        command = [sys.executable, __file__, "--child", "--device", args.device, "--dtype", args.dtype, "--width", str(args.width),
                   "--rows", str(args.rows), "--requests", str(args.requests)] + (["--pieces", str(pieces)] if pieces else [])
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    whole = results["one call"]
    print(f"## One MiniMax-H3 block, {args.requests} requests x {args.rows} rows, {args.device}, {args.dtype}, "
          f"hidden {whole['hidden']} ({whole['heads']} heads), {args.width:.3g}x the released widths\n")
    print("| block | peak growth (GiB) | vs one call | time (s) | vs one call | output equal |")
    print("|---|---:|---:|---:|---:|---|")
    for label, r in results.items():
        print(f"| {label} | {r['peak_gib']:.2f} | {r['peak_gib'] / whole['peak_gib']:.2f}x | {r['seconds']:.2f} | "
              f"{r['seconds'] / whole['seconds']:.2f}x | {'yes' if abs(r['digest'] - whole['digest']) <= 1e-5 * abs(whole['digest']) else 'no'} |")


if __name__ == "__main__":
    main()
