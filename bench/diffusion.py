"""Diffusion benchmark: Omni's diffusion stage vs a plain diffusers loop, on one Cosmos3 checkpoint.

    python bench/diffusion.py [--model DIR] [--size 128] [--steps 8] [--requests 8]

Writes (once) a ``bench``-size random Cosmos3 checkpoint, measures the float32 matrix-multiply
ceiling of this machine, then runs each configuration in its own process (so its peak memory is
its own): diffusers' `Cosmos3OmniPipeline` one request at a time, and Omni (inline placement) at
concurrency 1 and N, with the cache off and on. Prints images/s, mean per-request E2EL (from the
moment all requests are submitted), peak RSS, model-FLOP utilization against the measured ceiling,
and for the cache the speedup and PSNR against the uncached outputs. Not a test.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = [
    "a red apple on a wooden table", "a cat sleeps on a sofa", "waves crash on the rocks at sunset",
    "a robot arm picks up a blue cube", "city lights glow at night in the rain", "a dog runs on the beach",
    "a cup of tea next to a book", "seagulls fly over the sea",
]


def matmul_ceiling(n: int = 1024, repeats: int = 10) -> float:
    """float32 FLOP/s of a square matmul on this machine (the best of `repeats`)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def model_flops(model_dir: str, size: int, steps: int, guidance: float) -> float:
    """FLOPs of one request as the pipeline computes it (both towers, every step, every branch)."""
    import torch
    from diffusers import Cosmos3OmniPipeline

    pipe = Cosmos3OmniPipeline.from_pretrained(model_dir)
    cfg = pipe.transformer.config
    cond, uncond = pipe.tokenize_prompt(PROMPTS[0], None, num_frames=1, height=size, width=size)
    gen_tokens = (size // (pipe.vae_scale_factor_spatial * cfg.latent_patch_size)) ** 2
    und_params = gen_params = 0
    for name, module in pipe.transformer.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            is_gen = any(k in name for k in ("add_", "moe_gen"))
            if is_gen:
                gen_params += module.weight.numel()
            else:
                und_params += module.weight.numel()
    width = cfg.num_attention_heads * cfg.head_dim
    total = 0.0
    for und in [len(cond)] + ([len(uncond)] if guidance != 1.0 else []):
        linear = 2 * (und_params * und + gen_params * gen_tokens)
        attention = 4 * width * cfg.num_hidden_layers * (und * und / 2 + gen_tokens * (und + gen_tokens))
        total += linear + attention
    return total * steps


def run_part(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process: returns timings, outputs' path and peak RSS."""
    import torch

    torch.manual_seed(0)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.concurrency)]
    images: list[np.ndarray] = []
    latencies: list[float] = []
    if args.part == "diffusers":
        from diffusers import Cosmos3OmniPipeline

        pipe = Cosmos3OmniPipeline.from_pretrained(args.model)
        pipe.set_progress_bar_config(disable=True)
        pipe("warm up", num_frames=1, height=args.size, width=args.size, num_inference_steps=1, output_type="np")
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            out = pipe(prompt, num_frames=1, height=args.size, width=args.size, num_inference_steps=args.steps,
                       guidance_scale=args.guidance, generator=torch.Generator().manual_seed(i), output_type="np")
            images.append(np.clip(np.round(out.video[0] * 255), 0, 255).astype(np.uint8))
            latencies.append(time.perf_counter() - start)
        elapsed = time.perf_counter() - start
    else:
        from omni_core import Omni
        from omni_core.engine.request import OmniRequest

        overrides = ["generator.placement=inline", f"generator.max_num_seqs={max(8, args.concurrency)}", "streaming=false"]
        if args.part == "omni-cache":
            overrides += ["generator.cache=first_block", f"generator.cache_threshold={args.cache_threshold}"]
        with Omni(args.model, overrides=overrides) as omni:
            def req(i: int, prompt: str, steps: int) -> OmniRequest:
                return OmniRequest(prompt=prompt, modalities=("image",), extra={"size": (args.size, args.size), "seed": i},
                                   params={"generator": {"num_inference_steps": steps, "guidance_scale": args.guidance}})

            omni.generate(req(0, "warm up", 1))
            done: dict[str, float] = {}
            start = time.perf_counter()
            requests = [req(i, p, args.steps) for i, p in enumerate(prompts)]
            results = omni.generate(requests, on_delta=lambda d: d.final and done.setdefault(d.request_id, time.perf_counter() - start))
            elapsed = time.perf_counter() - start
        images = [r.images[0] for r in results]
        latencies = [done[r.request_id] for r in results]
    out = Path(args.out) / f"{args.part}-{args.concurrency}.npy"
    np.save(out, np.stack(images))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB (Linux)
    return {"elapsed": elapsed, "latencies": latencies, "images": str(out), "peak_mib": peak}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Cosmos3 checkpoint (default: a bench-size random one)")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--cache-threshold", type=float, default=0.2)
    parser.add_argument("--out", default="/tmp/omni-bench-diffusion")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = str(Path(args.out) / "cosmos3-bench")
        if not (Path(args.model) / "model_index.json").exists():
            from omni_cosmos3.tiny import make_tiny

            make_tiny(Path(args.model), "bench")
    if args.part is not None:
        print(json.dumps(run_part(args)))
        return

    ceiling = matmul_ceiling()
    flops = model_flops(args.model, args.size, args.steps, args.guidance)
    rows = []
    for part, concurrency in [("diffusers", 1), ("omni", 1), ("diffusers", args.requests), ("omni", args.requests), ("omni-cache", args.requests)]:
        command = [sys.executable, __file__, "--model", args.model, "--size", str(args.size), "--steps", str(args.steps),
                   "--guidance", str(args.guidance), "--out", args.out, "--part", part, "--concurrency", str(concurrency),
                   "--cache-threshold", str(args.cache_threshold)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result.update(part=part, concurrency=concurrency)
        rows.append(result)
    print(f"Cosmos3 bench checkpoint, {args.size}x{args.size}, {args.steps} steps, guidance {args.guidance}; "
          f"matmul ceiling {ceiling / 1e9:.1f} GFLOP/s; {flops / 1e9:.2f} GFLOP per request (pipeline count)")
    print(f"{'config':<12}{'conc':>5}{'images/s':>10}{'E2EL s':>9}{'peak MiB':>10}{'MFU %':>8}")
    by_key = {(r["part"], r["concurrency"]): r for r in rows}
    for r in rows:
        rate = r["concurrency"] / r["elapsed"]
        mfu = 100 * rate * flops / ceiling
        print(f"{r['part']:<12}{r['concurrency']:>5}{rate:>10.3f}{np.mean(r['latencies']):>9.2f}{r['peak_mib']:>10.0f}{mfu:>8.1f}")
    for c in (1, args.requests):
        print(f"Omni / diffusers throughput at concurrency {c}: "
              f"{by_key[('diffusers', c)]['elapsed'] / by_key[('omni', c)]['elapsed']:.2f}x")
    off, on = by_key[("omni", args.requests)], by_key[("omni-cache", args.requests)]
    quality = min(psnr(a, b) for a, b in zip(np.load(off["images"]), np.load(on["images"])))
    print(f"cache first_block (threshold {args.cache_threshold}): {off['elapsed'] / on['elapsed']:.2f}x faster, "
          f"min PSNR vs cache off {quality:.1f} dB")


if __name__ == "__main__":
    main()
