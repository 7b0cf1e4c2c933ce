"""Diffusion benchmark: Omni's diffusion stage vs plain diffusers, on one random Cosmos3 checkpoint.

    python bench/diffusion.py --preset bench                                  # CPU, float32
    python bench/diffusion.py --device cpu --dtype bfloat16 --preset tiny     # the bf16 path, CPU, seconds
    python bench/diffusion.py --device cuda --dtype bfloat16 --preset 1.2b    # 512x512  (part 1 of the GPU run)
    python bench/diffusion.py --device cuda --dtype bfloat16 --preset 8.5b    # 1024x1024 (part 2)

One preset is one part: it writes (once, under ``--scratch``) a random-weight Cosmos3 checkpoint of
that size, initialised on `--device` in `--dtype` (`omni_cosmos3.tiny.make_tiny`), measures the
matrix-multiply ceiling of the device in that dtype (an ``n^3`` matmul, n=8192 on CUDA), then in ONE
process (peak memory is reset per configuration: ``torch.cuda.max_memory_allocated`` on CUDA, the
process's peak RSS on CPU):

1. diffusers `Cosmos3OmniPipeline`, one request at a time (it cannot batch requests), at
   concurrency 1 (requests back to back) and N (N requests arrive together and queue);
2. Omni (the ``generator`` diffusion stage, inline placement) at concurrency 1 and N, cache off;
3. Omni at concurrency N with first-block caching at each ``--cache-thresholds`` value;
4. with ``--parallel cfg=2,ulysses=2`` (issue 24, on a machine with 2 GPUs): Omni's stage spanning
   2 devices in each mode (``generator.options.parallel``, in a worker process and its rank
   process), at concurrency 1 and N, against the one-device Omni above: latency at concurrency 1
   and images/s at N. Their peak memory is not measured (other processes hold it).

Every request: text-to-image, ``--steps`` steps (20), CFG ``--guidance`` (4.0), its own prompt and
seed; Omni and diffusers get the same prompts and seeds, so their images are compared (PSNR).

FLOPs, two definitions (both from the checkpoint's config, checked against PyTorch's FlopCounterMode
on one diffusers step):

- *pipeline FLOPs*: the transformer work diffusers does per request: both towers (reasoner over
  the prompt tokens, generator over the image tokens) for every step and guidance branch. "MFU"
  below is ``images/s x pipeline FLOPs / ceiling`` for BOTH systems: the same work definition, so
  MFU ratios equal throughput ratios.
- *executed FLOPs*: what Omni actually runs: the reasoner once per request and branch (its keys
  and values do not change between steps), the generator every step; with the cache, the skipped
  blocks are not counted. "HFU" is ``images/s x executed FLOPs / ceiling``. For diffusers both are
  equal. VAE and scheduler work is in neither.

Results: ``$OUT/diffusion-<preset>.md`` (tables, goals) and ``.json`` (raw), rewritten after every
configuration, so a run cut short still leaves what it measured; ``--budget-s`` skips the
configurations that would start after that many seconds. Not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, ClassVar

import attrs
import numpy as np

PROMPTS = [
    "a red apple on a wooden table", "a cat sleeps on a sofa", "waves crash on the rocks at sunset",
    "a robot arm picks up a blue cube", "city lights glow at night in the rain", "a dog runs on the beach",
    "a cup of tea next to a book", "seagulls fly over the sea",
]


@attrs.frozen
class Preset:
    """One benchmark part: the checkpoint size (`omni_cosmos3.tiny.SPECS`) and its image size."""

    checkpoint: str
    image_size: int
    cache_thresholds: tuple[float, ...]
    requests_at_1: int  # requests run back to back at concurrency 1


PRESETS = {
    "tiny": Preset("tiny", 32, (0.2,), 2),
    "bench": Preset("bench", 128, (0.2,), 2),
    "1.2b": Preset("1.2b", 512, (0.1, 0.2, 0.3), 3),
    "8.5b": Preset("8.5b", 1024, (0.15, 0.3), 2),
}

GOALS = {  # issue 5, at concurrency N
    "speedup_underused": 3.0,  # Omni images/s over diffusers' (sequential) where one request underuses the device
    "speedup_full": 1.0,  # never slower where one request already fills it
    "mfu": 0.60,
    "cache_speedup": 1.8,
    "cache_psnr_db": 30.0,
    # issue 24: latency at concurrency 1 over one device's, images/s at N over one device's
    "parallel_latency": {"cfg": 1.8, "ulysses": 1.7},
    "parallel_throughput": 1.9,
}


# -- measuring ---------------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(device: str, fn: Callable[[], Any], repeats: int) -> float:
    """Seconds per call of `fn`: the best of `repeats` after a warm-up call."""
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_ceiling(device: str, dtype: str, n: int, repeats: int = 5, inner: int = 10) -> float:
    """FLOP/s of an ``n^3`` matmul in `dtype` on `device`: the best of `repeats` runs of `inner` matmuls."""
    import torch

    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    torch.mm(a, b)
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / inner)
    del a, b
    return 2 * n**3 / best


class PeakMemory:
    """Peak memory of one configuration: CUDA allocator peak, or this process's peak RSS on CPU."""

    def __init__(self, device: str) -> None:
        self.device = device

    def reset(self) -> None:
        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) of this process.
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass

    def peak_mib(self) -> float:
        if self.device.startswith("cuda"):
            import torch

            return torch.cuda.max_memory_allocated(self.device) / 2**20
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")


@attrs.frozen
class FlopModel:
    """Transformer FLOPs of one text-to-image request, from the checkpoint's config (see module doc)."""

    und_linear: int  # reasoner-tower linear weights, all layers
    gen_linear: int  # generator-tower linear weights, all layers
    attn_width: int  # heads x head_dim
    layers: int
    proj: int  # proj_in + proj_out weights
    gen_tokens: int

    @classmethod
    def from_pipe(cls, pipe: Any, height: int, width: int) -> FlopModel:
        import torch

        cfg = pipe.transformer.config
        und = gen = 0
        for name, module in pipe.transformer.layers.named_modules():
            if isinstance(module, torch.nn.Linear):
                if "add_" in name or "moe_gen" in name:
                    gen += module.weight.numel()
                else:
                    und += module.weight.numel()
        pixels_per_token = pipe.vae_scale_factor_spatial * cfg.latent_patch_size
        proj = pipe.transformer.proj_in.weight.numel() + pipe.transformer.proj_out.weight.numel()
        return cls(und, gen, cfg.num_attention_heads * cfg.head_dim, cfg.num_hidden_layers, proj,
                   (height // pixels_per_token) * (width // pixels_per_token))

    def reasoner(self, text: int) -> float:
        """The reasoner tower over `text` prompt tokens (causal attention: half the score matrix)."""
        return 2 * self.und_linear * text + 4 * self.attn_width * self.layers * text * text / 2

    def generator(self, text: int, layers: int | None = None) -> float:
        """The generator tower over the image tokens (attending to the prompt and image), `layers` of it."""
        m, share = self.gen_tokens, (layers if layers is not None else self.layers) / self.layers
        blocks = 2 * self.gen_linear * m + 4 * self.attn_width * self.layers * m * (text + m)
        return share * blocks + 2 * self.proj * m

    def pipeline(self, texts: list[int], steps: int) -> float:
        """Per request, as diffusers computes it: both towers, every step, every guidance branch."""
        return steps * sum(self.reasoner(n) + self.generator(n) for n in texts)

    def executed(self, texts: list[int], steps: int, skipped: float = 0.0) -> float:
        """Per request, as Omni computes it: the reasoner once; `skipped` steps run only the first block."""
        computed = steps - skipped
        return sum(self.reasoner(n) + computed * self.generator(n) + skipped * self.generator(n, layers=1) for n in texts)


def prompt_lengths(pipe: Any, prompt: str, size: int, guidance: float) -> list[int]:
    cond, uncond = pipe.tokenize_prompt(prompt, None, num_frames=1, height=size, width=size)
    return [len(cond)] + ([len(uncond)] if guidance != 1.0 else [])


def counted_step_flops(pipe: Any, size: int, guidance: float) -> float:
    """The transformer FLOPs of one diffusers step, counted by PyTorch (FlopCounterMode)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        pipe(PROMPTS[0], num_frames=1, height=size, width=size, num_inference_steps=1, guidance_scale=guidance,
             generator=torch.Generator().manual_seed(0), output_type="np")
    counts = counter.get_flop_counts()
    return float(sum(counts.get(type(pipe.transformer).__name__, {}).values()))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def write_table(lines: list[str], path: Path) -> str:
    """A bench's report: `lines` joined, printed and written to `path` (its folder made); returns the text."""
    text = "\n".join(lines) + "\n"
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


# -- the two systems ---------------------------------------------------------------------------------


@attrs.define
class Run:
    """What one configuration measured."""

    system: str
    concurrency: int
    requests: int
    elapsed_s: float
    latencies_s: list[float]
    peak_mib: float
    cache_threshold: float | None = None
    skipped_steps: float = 0.0  # mean skipped steps per request (cache)
    images: list[np.ndarray] = attrs.field(factory=list, repr=False)

    @property
    def images_per_s(self) -> float:
        return self.requests / self.elapsed_s


class DiffusersSystem:
    """The baseline: diffusers' Cosmos3OmniPipeline, one request at a time."""

    def __init__(self, model: str, device: str, dtype: str) -> None:
        import torch
        from diffusers import Cosmos3OmniPipeline

        kwargs: dict[str, Any] = {"enable_safety_checker": False}
        if dtype != "float32":
            kwargs["torch_dtype"] = getattr(torch, dtype)
        self.pipe = Cosmos3OmniPipeline.from_pretrained(model, **kwargs).to(device)
        self.pipe.set_progress_bar_config(disable=True)

    def one(self, index: int, size: int, steps: int, guidance: float) -> np.ndarray:
        import torch

        out = self.pipe(PROMPTS[index % len(PROMPTS)], num_frames=1, height=size, width=size, num_inference_steps=steps,
                        guidance_scale=guidance, generator=torch.Generator().manual_seed(index), output_type="np")
        frames = np.asarray(out.video)
        while frames.ndim > 3:  # [(batch,) frames, H, W, 3] -> the one image
            frames = frames[0]
        return np.clip(np.round(frames * 255), 0, 255).astype(np.uint8)

    def run(self, concurrency: int, requests: int, size: int, steps: int, guidance: float, memory: PeakMemory) -> Run:
        """`concurrency` 1: requests back to back, each timed alone; N: N arrive at once and queue."""
        memory.reset()
        images, latencies = [], []
        start = time.perf_counter()
        for i in range(requests):
            began = time.perf_counter()
            images.append(self.one(i, size, steps, guidance))
            latencies.append(time.perf_counter() - (began if concurrency == 1 else start))
        elapsed = time.perf_counter() - start
        return Run("diffusers", concurrency, requests, elapsed, latencies, memory.peak_mib(), images=images)

    def close(self) -> None:
        self.pipe = None


class OmniSystem:
    """Omni: the Cosmos3 family's pipeline (one diffusion stage, inline), resolved without entry points."""

    def __init__(
        self, model: str, device: str, dtype: str, max_num_seqs: int, compile: bool = False, cuda_graphs: bool = False,
        parallel: dict[str, int] | None = None,
    ) -> None:
        import omni_cosmos3.plugin
        from omni_core import Omni
        from omni_core.config import resolve
        from omni_core.plugins import load_plugins

        # Explicit plugins: the GPU machine runs from a source tree with no installed entry points.
        host = load_plugins(entry_points=(), extra_plugins=[omni_cosmos3.plugin])
        overrides = ["generator.placement=inline", f"generator.max_num_seqs={max_num_seqs}", "streaming=false",
                     f"generator.dtype={dtype}", f"generator.device={device}", f"generator.compile={str(compile).lower()}",
                     f"generator.cuda_graphs={str(cuda_graphs).lower()}"]
        self.system = "omni"
        if parallel:  # rank processes: the stage runs in a worker process, on the first visible devices
            overrides = [o for o in overrides if not o.startswith(("generator.placement=", "generator.device="))]
            overrides += ["generator.placement=process"] + [f"generator.options.parallel.{k}={v}" for k, v in parallel.items()]
            self.system = "omni " + ",".join(f"{k}={v}" for k, v in parallel.items())
        self.omni = Omni(resolve(model, overrides=overrides, plugins=host))

    @staticmethod
    def request(index: int, size: int, steps: int, guidance: float, cache: float | None) -> Any:
        from omni_core.engine.request import OmniRequest

        params: dict[str, Any] = {"num_inference_steps": steps, "guidance_scale": guidance}
        params["cache"] = {"mode": "first_block", "threshold": cache} if cache is not None else "none"
        return OmniRequest(prompt=PROMPTS[index % len(PROMPTS)], modalities=("image",),
                           extra={"size": (size, size), "seed": index}, params={"generator": params})

    def run(self, concurrency: int, requests: int, size: int, steps: int, guidance: float, memory: PeakMemory,
            cache: float | None = None) -> Run:
        memory.reset()
        results, latencies = [], []
        start = time.perf_counter()
        if concurrency == 1:
            for i in range(requests):
                began = time.perf_counter()
                results += self.omni.generate(self.request(i, size, steps, guidance, cache))
                latencies.append(time.perf_counter() - began)
        else:
            done: dict[str, float] = {}
            batch = [self.request(i, size, steps, guidance, cache) for i in range(requests)]
            results = self.omni.generate(batch, on_delta=lambda d: d.final and done.setdefault(d.request_id, time.perf_counter() - start))
            latencies = [done[r.request_id] for r in results]
        elapsed = time.perf_counter() - start
        skipped = [r.extra.get("generator", {}).get("cache", {}).get("skipped_steps", 0) for r in results] if cache is not None else [0]
        system = self.system if cache is None else f"{self.system}+cache"
        return Run(system, concurrency, requests, elapsed, latencies, memory.peak_mib(),
                   cache_threshold=cache, skipped_steps=float(np.mean(skipped)), images=[r.images[0] for r in results])

    def close(self) -> None:
        self.omni.close()


# -- the report --------------------------------------------------------------------------------------


@attrs.define
class Report:
    """Everything one part measured, written as JSON and markdown after every configuration
    (``<name>-<preset>.json`` and ``.md``; bench/minimax_h3.py's report extends it)."""

    name: ClassVar[str] = "diffusion"

    args: dict[str, Any]
    out: Path
    meta: dict[str, Any] = attrs.field(factory=dict)
    runs: list[Run] = attrs.field(factory=list)
    skipped: list[str] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)

    def path(self, suffix: str) -> Path:
        # Not Path.with_suffix: it takes the ".2b" of "diffusion-1.2b" for a suffix (diffusion-1.json).
        return self.out / f"{self.name}-{self.args['preset']}{suffix}"

    def row(self, run: Run) -> dict[str, Any]:
        m = self.meta
        texts = m.get("prompt_tokens_per_branch") or []
        flops = m.get("flops")
        row: dict[str, Any] = {
            "system": run.system, "concurrency": run.concurrency, "requests": run.requests,
            "cache_threshold": run.cache_threshold, "elapsed_s": run.elapsed_s, "images_per_s": run.images_per_s,
            "e2el_mean_s": float(np.mean(run.latencies_s)), "e2el_max_s": float(np.max(run.latencies_s)),
            "latencies_s": run.latencies_s, "peak_mib": run.peak_mib, "skipped_steps_mean": run.skipped_steps,
        }
        if flops and texts and m.get("ceiling_flops"):
            fm = FlopModel(**flops)
            steps = self.args["steps"]
            pipeline = float(np.mean([fm.pipeline(t, steps) for t in texts[: run.requests]]))
            if run.system == "diffusers":
                executed = pipeline
            else:
                executed = float(np.mean([fm.executed(t, steps, run.skipped_steps) for t in texts[: run.requests]]))
            row["mfu"] = run.images_per_s * pipeline / m["ceiling_flops"]
            row["hfu"] = run.images_per_s * executed / m["ceiling_flops"]
        return row

    def write(self) -> None:
        rows = [self.row(run) for run in self.runs]
        data = {"meta": self.meta, "args": self.args, "runs": rows, "summary": self.summary(), "skipped": self.skipped,
                "notes": self.notes}
        self.path(".json").write_text(json.dumps(data, indent=1, default=float))
        self.path(".md").write_text(self.markdown(rows))

    def find(self, system: str, concurrency: int, threshold: float | None = None) -> Run | None:
        for run in self.runs:
            if run.system == system and run.concurrency == concurrency and run.cache_threshold == threshold:
                return run
        return None

    def summary(self) -> dict[str, Any]:
        n = self.args["concurrency"]
        out: dict[str, Any] = {}
        for c in (1, n):
            base, omni = self.find("diffusers", c), self.find("omni", c)
            if base and omni:
                out[f"omni_over_diffusers_c{c}"] = omni.images_per_s / base.images_per_s
                out[f"psnr_omni_vs_diffusers_c{c}_db"] = min(psnr(a, b) for a, b in zip(omni.images, base.images))
        base1 = self.find("diffusers", 1)
        omni_n = self.find("omni", n)
        if base1 and omni_n:
            out["omni_cN_over_sequential"] = omni_n.images_per_s / base1.images_per_s
        omni_1 = self.find("omni", 1)
        for run in self.runs:
            if run.system.startswith("omni ") and not run.system.endswith("+cache"):
                mode = run.system.split(" ", 1)[1]
                if run.concurrency == 1 and omni_1:
                    out[f"parallel {mode} latency c1"] = float(np.mean(omni_1.latencies_s) / np.mean(run.latencies_s))
                    out[f"psnr_parallel {mode}_vs_omni_db"] = min(psnr(a, b) for a, b in zip(run.images, omni_1.images))
                if run.concurrency == n and omni_n:
                    out[f"parallel {mode} images/s c{n}"] = run.images_per_s / omni_n.images_per_s
        if omni_n:
            for run in self.runs:
                if run.system == "omni+cache" and run.concurrency == n:
                    out[f"cache_{run.cache_threshold}"] = {
                        "speedup": omni_n.elapsed_s / run.elapsed_s,
                        "psnr_min_db": min(psnr(a, b) for a, b in zip(run.images, omni_n.images)),
                        "skipped_steps_mean": run.skipped_steps,
                    }
        return out

    def markdown(self, rows: list[dict[str, Any]]) -> str:
        a, m = self.args, self.meta
        lines = [
            f"# Diffusion benchmark, preset {a['preset']} ({m.get('transformer_params', 0) / 1e9:.2f}B transformer parameters)",
            "",
            f"{m.get('device_name', a['device'])}, {a['dtype']}, {a['size']}x{a['size']} text-to-image, {a['steps']} steps, "
            f"CFG {a['guidance']}, concurrency 1 and {a['concurrency']}. torch {m.get('torch')}, diffusers {m.get('diffusers')}. "
            f"Omni's stage {'compiled (generator.compile=true)' if a.get('compile') else 'eager'}"
            f"{', CUDA graphs (generator.cuda_graphs=true)' if a.get('cuda_graphs') else ''}.",
            f"Matmul ceiling ({a['ceiling_n']}^3, {a['dtype']}): {m.get('ceiling_flops', 0) / 1e12:.1f} TFLOP/s. "
            f"Pipeline FLOPs per request: {m.get('pipeline_flops_per_request', 0) / 1e12:.3f} T; executed by Omni "
            f"(cache off): {m.get('executed_flops_per_request', 0) / 1e12:.3f} T; image tokens {m.get('image_tokens')}, "
            f"prompt tokens per branch {m.get('prompt_tokens_example')}.",
            f"FLOP check: FlopCounterMode / formula, one diffusers step: {m.get('flop_check_ratio', float('nan')):.3f} "
            "(the counter counts the causal reasoner attention in full).",
            f"Checkpoint: written in {m.get('checkpoint_write_s', float('nan')):.1f} s; loaded by diffusers in "
            f"{m.get('diffusers_load_s', float('nan')):.1f} s, by Omni in {m.get('omni_load_s', float('nan')):.1f} s.",
            "",
            "MFU = images/s x pipeline FLOPs (diffusers' work, the same definition for both systems) / ceiling; "
            "HFU = images/s x FLOPs actually executed / ceiling (equal for diffusers; Omni runs the reasoner once per "
            "request and skips cached blocks). Concurrency N for diffusers: N requests arrive together and are served "
            "one at a time (it cannot batch them); E2EL counts from their arrival.",
            "",
            "| system | conc | cache thr | images/s | E2EL mean s | E2EL max s | peak GiB | MFU % | HFU % | skipped steps |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            thr = "" if r["cache_threshold"] is None else f"{r['cache_threshold']:g}"
            lines.append(
                f"| {r['system']} | {r['concurrency']} | {thr} | {r['images_per_s']:.3f} | {r['e2el_mean_s']:.2f} | "
                f"{r['e2el_max_s']:.2f} | {r['peak_mib'] / 1024:.2f} | {100 * r.get('mfu', float('nan')):.1f} | "
                f"{100 * r.get('hfu', float('nan')):.1f} | {r['skipped_steps_mean']:.1f} |"
            )
        s = self.summary()
        lines += ["", "## Ratios and goals (issue 5)", ""]
        n = a["concurrency"]
        for key, value in s.items():
            if isinstance(value, dict):
                ok = value["speedup"] >= GOALS["cache_speedup"] and value["psnr_min_db"] >= GOALS["cache_psnr_db"]
                lines.append(f"- cache threshold {key.split('_', 1)[1]}: {value['speedup']:.2f}x faster than Omni cache-off at "
                             f"concurrency {n}, min PSNR {value['psnr_min_db']:.1f} dB, {value['skipped_steps_mean']:.1f} "
                             f"steps skipped per request (goal >= {GOALS['cache_speedup']}x at >= {GOALS['cache_psnr_db']:.0f} dB: "
                             f"{'met' if ok else 'not met'})")
            elif key.startswith("psnr"):
                lines.append(f"- {key}: {value:.1f} dB (same prompts and seeds; bf16 rounding differs between the two)")
            elif key.startswith("parallel "):
                mode = key.split()[1].split("=")[0]
                goal = GOALS["parallel_latency"][mode] if "latency" in key else GOALS["parallel_throughput"]
                what = "lower latency than one device" if "latency" in key else "the images/s of one device"
                lines.append(f"- {key}: {value:.2f}x {what} (goal >= {goal:g}x: {'met' if value >= goal else 'not met'})")
            else:
                lines.append(f"- {key}: {value:.2f}x")
        omni_n = next((r for r in rows if r["system"] == "omni" and r["concurrency"] == n), None)
        base1 = next((r for r in rows if r["system"] == "diffusers" and r["concurrency"] == 1), None)
        if omni_n and base1 and "mfu" in omni_n:
            underused = base1["mfu"] < 0.5
            goal = GOALS["speedup_underused"] if underused else GOALS["speedup_full"]
            speedup = omni_n["images_per_s"] / base1["images_per_s"]
            lines.append(
                f"- goal: Omni at concurrency {n} >= {goal:g}x sequential diffusers ({'one request underuses the device' if underused else 'one request fills the device'}, "
                f"diffusers MFU {100 * base1['mfu']:.0f}%): {speedup:.2f}x, {'met' if speedup >= goal else 'not met'}")
            lines.append(
                f"- goal: utilization >= {100 * GOALS['mfu']:.0f}% at concurrency {n}: MFU {100 * omni_n['mfu']:.1f}% "
                f"({'met' if omni_n['mfu'] >= GOALS['mfu'] else 'not met'}), HFU {100 * omni_n['hfu']:.1f}% "
                f"({'met' if omni_n['hfu'] >= GOALS['mfu'] else 'not met'})")
        if self.skipped:
            lines += ["", "Skipped (time budget): " + ", ".join(self.skipped)]
        if self.notes:
            lines += ["", "Notes:"] + [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


# -- the part ----------------------------------------------------------------------------------------


def run_part(args: argparse.Namespace) -> Report:
    import torch

    t0 = time.perf_counter()
    preset = PRESETS[args.preset]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(args={k: v for k, v in vars(args).items()}, out=out)
    report.meta.update(torch=torch.__version__, python=platform.python_version(),
                       device_name=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else platform.processor() or "cpu")
    try:
        import diffusers

        report.meta["diffusers"] = diffusers.__version__
    except ImportError:
        pass

    def over_budget(name: str) -> bool:
        if time.perf_counter() - t0 > args.budget_s:
            report.skipped.append(name)
            report.write()
            return True
        return False

    def measured(name: str, fn: Callable[[], Run]) -> None:
        if over_budget(name):
            return
        run = fn()
        report.runs.append(run)
        report.write()
        print(f"[{time.perf_counter() - t0:6.1f}s] {name}: {run.images_per_s:.3f} images/s, E2EL {np.mean(run.latencies_s):.2f} s, "
              f"peak {run.peak_mib / 1024:.2f} GiB", flush=True)

    model = args.model
    if model is None:
        model = str(Path(args.scratch) / f"cosmos3-{preset.checkpoint}-{args.dtype}")
        if not (Path(model) / "model_index.json").exists():
            from omni_cosmos3.tiny import make_tiny

            began = time.perf_counter()
            make_tiny(Path(model), preset.checkpoint, device=args.device, dtype=args.dtype)
            synchronize(args.device)
            report.meta["checkpoint_write_s"] = time.perf_counter() - began
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    report.meta["checkpoint"] = model
    report.meta["ceiling_flops"] = matmul_ceiling(args.device, args.dtype, args.ceiling_n)
    print(f"[{time.perf_counter() - t0:6.1f}s] ceiling {report.meta['ceiling_flops'] / 1e12:.1f} TFLOP/s", flush=True)
    memory = PeakMemory(args.device)
    n, size, steps, guidance = args.concurrency, args.size, args.steps, args.guidance

    began = time.perf_counter()
    base = DiffusersSystem(model, args.device, args.dtype)
    report.meta["diffusers_load_s"] = time.perf_counter() - began
    pipe = base.pipe
    flops = FlopModel.from_pipe(pipe, size, size)
    texts = [prompt_lengths(pipe, PROMPTS[i % len(PROMPTS)], size, guidance) for i in range(max(n, preset.requests_at_1))]
    report.meta.update(
        flops=attrs.asdict(flops), prompt_tokens_per_branch=texts, prompt_tokens_example=texts[0], image_tokens=flops.gen_tokens,
        transformer_params=sum(p.numel() for p in pipe.transformer.parameters()),
        pipeline_flops_per_request=float(np.mean([flops.pipeline(t, steps) for t in texts[:n]])),
        executed_flops_per_request=float(np.mean([flops.executed(t, steps) for t in texts[:n]])),
    )
    if args.flop_check:
        try:
            counted = counted_step_flops(pipe, size, guidance)
            report.meta["flop_check_ratio"] = counted / flops.pipeline(prompt_lengths(pipe, PROMPTS[0], size, guidance), 1)
        except AssertionError as exc:  # torch's FLOP counter rejects grouped-query attention shapes on some builds
            report.meta["flop_check_ratio"] = float("nan")
            report.meta["flop_check_note"] = f"not checked: {exc}"
    report.write()

    for i in range(n):  # warm-up on every prompt (each prompt length is a new shape), as Omni's below
        base.one(i, size, min(2, steps), guidance)
    measured("diffusers c1", lambda: base.run(1, preset.requests_at_1, size, steps, guidance, memory))
    measured(f"diffusers c{n}", lambda: base.run(n, n, size, steps, guidance, memory))
    base.close()
    base = pipe = None  # drop the last references to diffusers' weights
    memory.reset()
    if args.device.startswith("cuda"):  # should be ~0: Omni's peak must not include diffusers' weights
        report.meta["cuda_allocated_before_omni_mib"] = torch.cuda.memory_allocated(args.device) / 2**20

    began = time.perf_counter()
    omni = OmniSystem(model, args.device, args.dtype, max_num_seqs=n, compile=args.compile, cuda_graphs=args.cuda_graphs)
    report.meta["omni_load_s"] = time.perf_counter() - began
    try:
        # Warm-up: every batch shape measured below (one request, N, N with some rows cached), so
        # that a compiled stage has compiled them all before the clock runs.
        omni.omni.generate(OmniSystem.request(0, size, min(2, steps), guidance, None))
        omni.omni.generate([OmniSystem.request(i, size, min(2, steps), guidance, None) for i in range(n)])
        omni.omni.generate([OmniSystem.request(i, size, min(4, steps), guidance, 1.0) for i in range(n)])
        measured("omni c1", lambda: omni.run(1, preset.requests_at_1, size, steps, guidance, memory))
        measured(f"omni c{n}", lambda: omni.run(n, n, size, steps, guidance, memory))
        for threshold in args.cache_thresholds or preset.cache_thresholds:
            measured(f"omni+cache {threshold} c{n}", lambda: omni.run(n, n, size, steps, guidance, memory, cache=threshold))
    finally:
        omni.close()
    for parallel in args.parallel or ():
        name = ",".join(f"{k}={v}" for k, v in parallel.items())
        if over_budget(f"omni {name}"):
            continue
        began = time.perf_counter()
        spanning = OmniSystem(model, args.device, args.dtype, max_num_seqs=n, compile=args.compile, parallel=parallel)
        report.meta[f"omni_{name}_load_s"] = time.perf_counter() - began
        try:
            spanning.omni.generate(OmniSystem.request(0, size, min(2, steps), guidance, None))
            spanning.omni.generate([OmniSystem.request(i, size, min(2, steps), guidance, None) for i in range(n)])
            measured(f"omni {name} c1", lambda: spanning.run(1, preset.requests_at_1, size, steps, guidance, memory))
            measured(f"omni {name} c{n}", lambda: spanning.run(n, n, size, steps, guidance, memory))
        finally:
            spanning.omni.close()
    report.meta["total_s"] = time.perf_counter() - t0
    report.write()
    return report


def _parallel_modes(text: str) -> list[dict[str, int]]:
    """``cfg=2,ulysses=2`` -> [{"cfg": 2}, {"ulysses": 2}]; ``cfg=2+ulysses=2`` -> one mode with both."""
    modes = []
    for mode in text.split(","):
        modes.append({k: int(v) for k, v in (part.split("=", 1) for part in mode.split("+"))})
    return modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", "--part", dest="preset", choices=sorted(PRESETS), default="bench",
                        help="checkpoint size and image size (one part of the GPU run)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--model", default=None, help="an existing Cosmos3 checkpoint (default: write a random one of the preset)")
    parser.add_argument("--size", type=int, default=None, help="image width = height (default: the preset's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=8, help="the concurrency besides 1")
    parser.add_argument("--cache-thresholds", type=lambda s: [float(x) for x in s.split(",")], default=None,
                        help="comma-separated first-block cache thresholds (default: the preset's)")
    parser.add_argument("--ceiling-n", type=int, default=None, help="matmul size of the ceiling (default 8192 on CUDA, 1024 on CPU)")
    parser.add_argument("--compile", action="store_true", help="Omni's stage with generator.compile=true (torch.compile)")
    parser.add_argument("--cuda-graphs", action="store_true", help="Omni's stage with generator.cuda_graphs=true")
    parser.add_argument("--parallel", type=_parallel_modes, default=None,
                        help="also Omni's stage over devices, per mode: e.g. cfg=2,ulysses=2 (each alone), or cfg=2+ulysses=2")
    parser.add_argument("--no-flop-check", dest="flop_check", action="store_false", help="skip the FlopCounterMode check")
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no configuration after this many seconds")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/omni-bench-out", help="results folder (default $OUT)")
    parser.add_argument("--scratch", default="/tmp/omni-bench-ckpt", help="where random checkpoints are written (not $OUT)")
    args = parser.parse_args()
    if args.size is None:
        args.size = PRESETS[args.preset].image_size
    if args.ceiling_n is None:
        args.ceiling_n = 8192 if args.device.startswith("cuda") else 1024
    report = run_part(args)
    print(report.path(".md").read_text())


if __name__ == "__main__":
    main()
