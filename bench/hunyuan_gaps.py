"""Where the GPU waits while the HunyuanImage-3.0 ``dit`` stage serves (not a test).

    python bench/hunyuan_gaps.py --preset tiny                                        # CPU smoke test
    OMNI_BENCH=hunyuan_gaps bash bench/gpu/run.sh h200 --layers 8 --compile           # a CUDA machine

`bench/hunyuan_profile.py` times one denoising forward alone; this runs the stage as
`bench/hunyuan_image3.py` does (its ``Omni``: the diffusion stage runtime, ``--requests`` requests
denoised together) and, for each way of multiplying the experts (``--expert-gemms``), profiles
``--steps`` runtime steps unprofiled (their wall time), then under a CUDA-only profiler (the GPU's
busy and idle time at about the served launch pace), then under the full `torch.profiler`: the wall
time a step, the GPU's busy time (kernels, overlaps merged), the longest idle gaps between kernels
with the kernels on either side, the device time by kind of kernel (GEMM, attention, convolution,
compiled Triton, other), the ``--top`` kernels that took the most time and the operators that
launched the most. A gap
means the host had not queued the next kernel yet (a host sync, Python between launches). Then one
step under ``torch.cuda.set_sync_debug_mode("warn")``: where the host synchronizes, with its Python
stack. Tables to stdout and ``$OUT/hunyuan-gaps-<preset>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from diffusion import PeakMemory
from hunyuan_image3 import Omni, checkpoint


def kernel_spans(trace: Path) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every GPU kernel and memcpy/memset in a Chrome trace, by start."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(spans)


def traced_spans(prof: Any) -> list[tuple[float, float, str]]:
    """`kernel_spans` of a finished `torch.profiler.profile`'s trace."""
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return kernel_spans(trace)


def gaps(spans: list[tuple[float, float, str]], floor_us: float) -> tuple[float, list[tuple[float, str, str]]]:
    """The kernels' busy time (overlaps merged) and each idle gap longer than `floor_us` as
    ``(gap_us, kernel before, kernel after)``."""
    busy, found = 0.0, []
    end, last = None, ""
    for start, stop, name in spans:
        if end is not None and start - end >= floor_us:
            found.append((start - end, last, name))
        busy += max(0.0, stop - (start if end is None else max(start, end)))  # (the part not yet covered)
        if end is None or stop > end:
            end, last = stop, name
    return busy, found


def short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def kind(name: str) -> str:
    """A kernel's kind, for the step's rollup: GEMM, attention, convolution, compiled (Triton), or other."""
    lowered = name.lower()
    if "sdpa" in lowered or "flash" in lowered or "fmha" in lowered:
        return "attention"
    if "fprop" in lowered or "dgrad" in lowered or "conv" in lowered and not lowered.startswith("triton"):
        return "convolution"
    if "nvjet" in lowered or "gemm" in lowered or "cutlass" in lowered or "splitkreduce" in lowered:
        return "GEMM"
    if lowered.startswith("triton"):
        return "compiled (Triton)"
    return "other (eager kernels, copies)"


def profile_steps(omni: Omni, steps: int, requests: int, size: int, floor_us: float, top: int = 25) -> list[str]:
    """Profile `steps` runtime steps of `requests` requests (admitted and started first): the gaps, the
    kernels by kind, the `top` kernels, and the operators that launched the most device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for i in range(requests):
        omni.runtime.add_request(str(i), omni.request(i, size, 3 * steps + 4))
    omni.runtime.step()  # admits and starts them (the text prefixes), and one step
    torch.cuda.synchronize()
    served = served_steps(omni, steps)
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            began = time.perf_counter()
            omni.runtime.step()
            walls.append(time.perf_counter() - began)
        torch.cuda.synchronize()
    spans = traced_spans(prof)
    while omni.runtime.has_unfinished():
        omni.runtime.step()
    busy, found = gaps(spans, floor_us)
    window = spans[-1][1] - spans[0][0]
    idle = window - busy
    lines = [
        *served,
        f"- {steps} steps under the full profiler (CPU and CUDA, operators' names): GPU window {window / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms "
        f"({idle / steps / 1e3:.2f} ms a step); host step times (ms) {', '.join(f'{w * 1e3:.0f}' for w in walls)}",
        f"- idle gaps over {floor_us:.0f} us: {len(found)}, {sum(g for g, _, _ in found) / 1e3:.1f} ms in all",
        "",
        "| gap (us) | kernel before | kernel after |",
        "|---:|---|---|",
    ]
    lines += [f"| {gap:.0f} | `{short(before)}` | `{short(after)}` |" for gap, before, after in sorted(found, reverse=True)[:20]]
    pairs: Counter[tuple[str, str]] = Counter()
    totals: Counter[tuple[str, str]] = Counter()
    for gap, before, after in found:
        pairs[(short(before, 40), short(after, 40))] += 1
        totals[(short(before, 40), short(after, 40))] += gap
    lines += ["", "| gaps | total (ms) | kernel before | kernel after |", "|---:|---:|---|---|"]
    lines += [f"| {pairs[key]} | {total / 1e3:.2f} | `{key[0]}` | `{key[1]}` |" for key, total in totals.most_common(12)]
    kernels: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    kind_calls: Counter[str] = Counter()
    for start, stop, name in spans:
        kernels[short(name, 70)] += stop - start
        calls[short(name, 70)] += 1
        kinds[kind(name)] += stop - start
        kind_calls[kind(name)] += 1
    lines += ["", "| kind | ms a step | calls a step | share of busy |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {us / steps / 1e3:.2f} | {kind_calls[name] / steps:.0f} | {us / busy:.1%} |" for name, us in kinds.most_common()]
    lines += ["", "| kernel | ms a step | calls a step | share of busy |", "|---|---:|---:|---:|"]
    lines += [f"| `{name}` | {us / steps / 1e3:.2f} | {calls[name] / steps:.0f} | {us / busy:.1%} |" for name, us in kernels.most_common(top)]
    # Which operators launched the device time (aten ops, compiled graphs): the tail the kernel names hide.
    ops = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    lines += ["", "| operator | self device ms a step | calls a step |", "|---|---:|---:|"]
    lines += [
        f"| `{short(e.key, 70)}` | {e.self_device_time_total / steps / 1e3:.2f} | {e.count / steps:.0f} |"
        for e in ops[:top] if e.self_device_time_total > 0
    ]
    return lines


def served_steps(omni: Omni, steps: int) -> list[str]:
    """`steps` runtime steps timed unprofiled (wall time to the GPU's end), then `steps` more under a
    CUDA-only profiler (the kernels' timestamps, no host-side recording: the host launches at about its
    served pace), so the GPU's busy and idle time of a served step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        omni.runtime.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - began) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            omni.runtime.step()
        torch.cuda.synchronize()
    spans = traced_spans(prof)
    busy, found = gaps(spans, 50.0)
    window = spans[-1][1] - spans[0][0]
    return [
        f"- {steps} steps unprofiled: {wall * 1e3:.1f} ms a step (wall, GPU drained at the end)",
        f"- {steps} steps under a CUDA-only profiler: GPU window {window / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, "
        f"idle {(window - busy) / steps / 1e3:.2f} ms a step ({len(found)} gaps over 50 us, "
        f"{sum(g for g, _, _ in found) / steps / 1e3:.2f} ms a step)",
    ]


def sync_sites(omni: Omni, requests: int, size: int) -> list[str]:
    """The host synchronizations of one runtime step (``set_sync_debug_mode("warn")``), by Python stack."""
    import torch

    for i in range(requests):
        omni.runtime.add_request(str(i), omni.request(i, size, 4))
    omni.runtime.step()
    torch.cuda.synchronize()
    sites: Counter[str] = Counter()

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack if "omni" in f.filename or "bench" in f.filename]
        sites[f"{str(message).splitlines()[0][:60]} <- {' <- '.join(reversed(ours[-4:]))}"] += 1

    with warnings.catch_warnings():  # (restores the filters and `showwarning` on exit)
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            omni.runtime.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    while omni.runtime.has_unfinished():
        omni.runtime.step()
    return ["| syncs | where (innermost first) |", "|---:|---|", *(f"| {n} | {site} |" for site, n in sites.most_common(20))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tiny", "h200"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="runtime steps profiled")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--expert-gemms", default="grouped,per_expert", help="as bench/hunyuan_image3.py's")
    parser.add_argument("--gap-floor-us", type=float, default=50.0)
    parser.add_argument("--top", type=int, default=25, help="kernels (and operators) listed")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/omni-bench-hunyuan"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()

    model = checkpoint(args.scratch, args.preset, args.layers, args.device)
    from omni_hunyuan.config import HunyuanConfig

    size = HunyuanConfig.from_pretrained(model).image_base_size
    omni = Omni(model, args.device, args.dtype, args.requests, args.compile)
    lines = [f"## HunyuanImage-3.0 dit stage, {args.preset}: {args.layers} layers, {args.requests} requests, {size}x{size}, "
             f"{'compiled' if args.compile else 'eager'}", ""]
    for how in args.expert_gemms.split(","):
        lines += [f"### {omni.expert_gemms(how) or how}", ""]
        omni.run(args.requests, args.requests, size, 2, PeakMemory(args.device))  # warm-up (compiles each batch shape)
        if args.device.startswith("cuda"):
            lines += profile_steps(omni, args.steps, args.requests, size, args.gap_floor_us, args.top)
            lines += ["", *sync_sites(omni, args.requests, size), ""]
        else:
            lines += ["(warmed up only: the kernel timeline needs CUDA)", ""]
        print("\n".join(lines), flush=True)
    omni.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"hunyuan-gaps-{args.preset}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
