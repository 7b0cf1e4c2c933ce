"""Where a batch of Cosmos3 requests spends its time in Omni's diffusion stage (not a test).

    python -m bench.diffusion_profile --preset bench                                   # CPU
    python -m bench.diffusion_profile --device cuda --dtype bfloat16 --preset 1.2b     # GPU
    python -m bench.diffusion_profile ... --quantization fp8   # the deploy option generator.quantization

Loads the ``generator`` stage of a random Cosmos3 checkpoint (the one `bench/diffusion.py` writes)
once per variant (``eager``; ``compiled``: the deploy option ``generator.compile``; ``graphs``:
compiled plus ``generator.cuda_graphs``) and runs one
batch of ``--concurrency`` text-to-image requests twice, the second timed:

1. through the model part, phase by phase (device synchronised between phases): ``prepare``
   (tokenize, noise), ``start`` (the reasoner tower, once per request), ``denoise`` (per step) and
   ``decode`` (VAE and post-processing), with the generator tower's utilisation per step;
2. through the stage runtime (`DiffusionStageRuntime.step` until done), the way a server runs it,
   whose wall time minus the phases is the runtime's own overhead.

It then records two denoising steps with `torch.profiler` and prints the kernels that took the
most device time. Tables go to stdout and ``$OUT/diffusion-profile-<preset>.md``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.diffusion import PRESETS, PROMPTS, FlopModel, matmul_ceiling, prompt_lengths, psnr, synchronize


def load_runtime(model: str, device: str, dtype: str, concurrency: int, compiled: bool, graphs: bool = False,
                 quantization: str | None = None) -> Any:
    import omni_cosmos3.plugin
    from omni_core.config import resolve
    from omni_core.plugins import load_plugins
    from omni_core.stages.diffusion import DiffusionStageRuntime

    host = load_plugins(entry_points=(), extra_plugins=[omni_cosmos3.plugin])
    overrides = [f"generator.max_num_seqs={concurrency}", "generator.admission_window_ms=0", "streaming=false",
                 f"generator.dtype={dtype}", f"generator.device={device}", f"generator.compile={str(compiled).lower()}",
                 f"generator.cuda_graphs={str(graphs).lower()}"]
    if quantization:
        overrides.append(f"generator.quantization={quantization}")
    pipeline = resolve(model, overrides=overrides, plugins=host)
    runtime = DiffusionStageRuntime(pipeline, pipeline.stage("generator"))
    runtime.load()
    return runtime


def request_data(index: int, size: int, steps: int, guidance: float) -> tuple[dict[str, Any], dict[str, Any]]:
    return ({"prompt": PROMPTS[index % len(PROMPTS)], "size": (size, size), "seed": index},
            {"num_inference_steps": steps, "guidance_scale": guidance})


def phases(runtime: Any, n: int, size: int, steps: int, guidance: float, device: str) -> dict[str, Any]:
    model = runtime.model
    times: dict[str, Any] = {}
    began = time.perf_counter()
    samples = [s for i in range(n) for s in model.prepare(f"p{i}", *request_data(i, size, steps, guidance))]
    synchronize(device)
    times["prepare"] = time.perf_counter() - began
    began = time.perf_counter()
    model.start(samples)
    synchronize(device)
    times["start"] = time.perf_counter() - began
    step_times = []
    for _ in range(steps):
        began = time.perf_counter()
        model.denoise(samples)
        for sample in samples:
            sample.step += 1
        synchronize(device)
        step_times.append(time.perf_counter() - began)
    times["steps"] = step_times
    began = time.perf_counter()
    payloads = model.decode(samples)
    synchronize(device)
    times["decode"] = time.perf_counter() - began
    times["images"] = [p["image"] for p in payloads]
    return times


def through_runtime(runtime: Any, n: int, size: int, steps: int, guidance: float, device: str) -> float:
    from omni_core.outputs import StageInput

    began = time.perf_counter()
    for i in range(n):
        data, params = request_data(i, size, steps, guidance)
        runtime.add_request(f"r{i}", StageInput(data=data, final=True, params=params))
    while runtime.has_unfinished():
        runtime.step()
    synchronize(device)
    return time.perf_counter() - began


def top_kernels(runtime: Any, n: int, size: int, steps: int, guidance: float, device: str, limit: int = 15) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    model = runtime.model
    samples = [s for i in range(n) for s in model.prepare(f"k{i}", *request_data(i, size, steps, guidance))]
    model.start(samples)
    model.denoise(samples)
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            model.denoise(samples)
            for sample in samples:
                sample.step += 1
        synchronize(device)
    key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    del samples
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    return prof.key_averages().table(sort_by=key, row_limit=limit, max_name_column_width=70)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--model", default=None, help="an existing Cosmos3 checkpoint (default: write the preset's)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--variants", default="eager,compiled,graphs", help="comma-separated: eager, compiled, graphs")
    parser.add_argument("--quantization", default=None, help="a quantization resolver for the generator (e.g. fp8, int8); default none")
    parser.add_argument("--reference-images", default=None, help="an .npz of images to compare against (PSNR): "
                        "written from the first variant when missing, e.g. by an unquantized run")
    parser.add_argument("--kernels", action="store_true", help="also list the top kernels of two steps per variant")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/omni-bench-out")
    parser.add_argument("--scratch", default="/tmp/omni-bench-ckpt")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    size, n, steps = preset.image_size, args.concurrency, args.steps
    model = args.model or str(Path(args.scratch) / f"cosmos3-{preset.checkpoint}-{args.dtype}")
    if not (Path(model) / "model_index.json").exists():
        from omni_cosmos3.tiny import make_tiny

        make_tiny(Path(model), preset.checkpoint, device=args.device, dtype=args.dtype)
    ceiling = matmul_ceiling(args.device, args.dtype, 8192 if args.device.startswith("cuda") else 1024)
    quant = args.quantization if args.quantization and args.quantization.lower() != "none" else None
    label = f"+{quant}" if quant else ""
    ref_path = Path(args.reference_images) if args.reference_images else None
    reference: list[Any] | None = None
    if ref_path is not None and ref_path.exists():
        with np.load(ref_path) as saved:
            reference = [saved[k] for k in sorted(saved.files, key=int)]
    against = f"reference {ref_path.name}" if ref_path is not None else "first variant"
    lines = [f"# Diffusion stage profile, preset {args.preset}, {args.device} {args.dtype}, quantization {quant or 'none'}, "
             f"{n} requests x {steps} steps, {size}x{size}, CFG {args.guidance}", "", f"Matmul ceiling: {ceiling / 1e12:.1f} TFLOP/s.", "",
             "| variant | load s | prepare s | start s | step ms (median) | step ms (first) | generator util per step % | "
             f"decode s | phases total s | runtime total s | runtime overhead s | images/s | min PSNR vs {against} dB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    kernel_tables = []
    for variant in args.variants.split(","):
        began = time.perf_counter()
        runtime = load_runtime(model, args.device, args.dtype, n, compiled=variant != "eager", graphs=variant == "graphs",
                               quantization=quant)
        load_s = time.perf_counter() - began
        pipe = runtime.model.pipe
        flops = FlopModel.from_pipe(pipe, size, size)
        texts = [prompt_lengths(pipe, PROMPTS[i % len(PROMPTS)], size, args.guidance) for i in range(n)]
        step_flops = sum(flops.generator(t) for branch in texts for t in branch)
        phases(runtime, n, size, min(steps, 3), args.guidance, args.device)  # warm-up (and compile)
        timed = phases(runtime, n, size, steps, args.guidance, args.device)
        through_runtime(runtime, n, size, min(steps, 3), args.guidance, args.device)  # warm-up
        total = through_runtime(runtime, n, size, steps, args.guidance, args.device)
        step_ms = float(np.median(timed["steps"])) * 1e3
        phase_total = timed["prepare"] + timed["start"] + sum(timed["steps"]) + timed["decode"]
        if reference is None:
            reference = [np.asarray(image) for image in timed["images"]]
            if ref_path is not None:
                ref_path.parent.mkdir(parents=True, exist_ok=True)
                np.savez(ref_path, **{str(i): image for i, image in enumerate(reference)})
        quality = min(psnr(np.asarray(a), np.asarray(b)) for a, b in zip(reference, timed["images"]))
        # FlopModel counts nn.Linear weights only, and the ceiling is the dtype's: no utilisation for quantized linears.
        util = "n/a" if quant else f"{100 * step_flops / (step_ms / 1e3) / ceiling:.1f}"
        lines.append(
            f"| {variant}{label} | {load_s:.1f} | {timed['prepare']:.3f} | {timed['start']:.3f} | {step_ms:.1f} | "
            f"{timed['steps'][0] * 1e3:.1f} | {util} | {timed['decode']:.3f} | "
            f"{phase_total:.2f} | {total:.2f} | {total - phase_total:.2f} | {n / total:.3f} | {quality:.1f} |"
        )
        print(lines[-1], flush=True)
        if args.kernels:
            kernel_tables.append(f"\n## Top kernels, {variant}{label}, two steps of {n} requests\n\n```\n"
                                 f"{top_kernels(runtime, n, size, steps, args.guidance, args.device)}\n```")
        runtime.close()
        del runtime, pipe
        import gc

        import torch

        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    text = "\n".join(lines + kernel_tables) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"diffusion-profile-{args.preset}{label.replace('+', '-')}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
