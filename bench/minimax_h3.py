"""MiniMax-H3 benchmark: Omni's encoder + dit stages vs diffusers' modular pipeline, t2va, one random checkpoint.

    python bench/minimax_h3.py --preset tiny                                  # CPU, float32, the plugin's tiny checkpoint
    python bench/minimax_h3.py --device cuda --dtype bfloat16 --preset tiny   # GPU smoke test, seconds
    python bench/minimax_h3.py --device cuda --dtype bfloat16 --preset h200 --layers 8   # the H200 run (issue 21)
    python bench/minimax_h3.py --device cuda --dtype bfloat16 --probe         # released-width parts, in memory, timed

Preset ``h200`` writes (under ``--scratch``) a random-weight checkpoint with the released widths
(`MiniMaxH3Transformer3DModel`'s defaults: 5376 wide, 56 heads x 128, SwiGLU 14336; the default
video VAE (2.6B) and audio VAE; a Qwen3-VL-32B-wide text encoder with 51 layers, the fewest that
give ``hidden_states[50]``) and ``--layers`` DiT blocks, in the real diffusers layout (t2va only:
no ``transformer_ref/``). Then, in ONE process (peak memory reset per configuration,
``torch.cuda.max_memory_allocated``):

1. diffusers' `MiniMaxH3ModularPipeline` (it takes one prompt per call): the N requests one after
   the other ("sequential");
2. Omni (``encoder`` + ``dit`` stages, inline placement) at concurrency 1 and N, cache off (with
   ``--max-batch-tokens K``, each repeat at N again with the dit's token budget of K requests' rows,
   on the same loaded stage);
3. Omni at concurrency N with first-block caching at each ``--cache-thresholds`` value;

each configuration ``--repeats`` times (the spread is reported). Every request: t2va, the
smallest legal duration (124 frames = 5.17 s at 24 fps), ``--size``, ``--steps`` steps, its own
prompt and seed; both systems get the same prompts and seeds, so their videos are compared (PSNR
over every ``--psnr-stride``-th frame).

FLOPs are the DiT's (transformer) forward FLOPs per request, from the config and the packed
layout the library builds (text, video and audio rows): every block's linears, full
(non-causal) attention over the request's rows, the token refiner and the in/out projections;
the per-block AdaLN projection runs on a handful of timestep rows and is left out.
- *MFU* = seconds-of-video-rate x (model FLOPs per second of video) / ceiling, over wall time: the
  whole request (encoder, denoising, both VAE decodes) is in the denominator; the same definition
  for both systems.
- *DiT MFU* = model FLOPs of the forwards / time inside the transformer forwards (CUDA events
  around each forward: from its rotary embedding to its audio output projection) / ceiling.
- *HFU* = FLOPs actually executed (with the cache, the skipped blocks are not counted) / wall / ceiling.

Results: ``$OUT/minimax-h3-<preset>.md`` and ``.json``, rewritten after every configuration.
Not a test.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import numpy as np
import diffusion
from diffusion import PeakMemory, matmul_ceiling, psnr, synchronize

PROMPTS = [
    "a red apple on a wooden table", "a cat sleeps on a sofa", "waves crash on the rocks at sunset",
    "a robot arm picks up a blue cube", "city lights glow at night in the rain", "a dog runs on the beach",
    "a cup of tea next to a book", "seagulls fly over the sea",
]
FPS = 24
FRAMES = 124  # the smallest legal count: 17 * 7 + 5 = 5.17 s


@attrs.frozen
class Preset:
    """One benchmark setting: the checkpoint (``tiny``: the plugin's; ``released``: released widths) and the request."""

    widths: str
    layers: int
    size: tuple[int, int]  # width, height
    steps: int
    cache_thresholds: tuple[float, ...]


PRESETS = {
    "tiny": Preset("tiny", 2, (32, 32), 4, (0.2,)),
    "h200": Preset("released", 8, (832, 480), 20, (0.1, 0.2)),
}

GOALS = {"speedup": 1.5, "mfu": 0.60, "cache_speedup": 1.8, "cache_psnr_db": 30.0}

# Qwen3-VL-32B: the text encoder's widths (text and vision towers).
QWEN3_VL_32B_TEXT = {
    "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}
QWEN3_VL_32B_VISION = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 5120,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
ENCODER_LAYERS = 51  # hidden_states[50] is the state after layer 50: 51 layers is the fewest that give it


# -- the checkpoint ----------------------------------------------------------------------------------


def write_released(directory: Path, layers: int, device: str, dtype: str, encoder_dir: Path | None = None,
                   encoder_intermediate: int | None = None) -> dict[str, Any]:
    """A random MiniMax-H3 checkpoint with the released widths and `layers` DiT blocks (t2va only).
    `encoder_dir`: where ``text_encoder/`` is written (``directory/text_encoder`` links to it), e.g.
    /dev/shm when the disk cannot hold the ~54 GB encoder beside the rest.

    The big modules are built without memory (meta device) and filled on `device` in `dtype`; the
    audio VAE (persistent filter buffers) is built on the CPU. Written by the library's own
    ``save_pretrained`` in diffusers' modular layout, with the tiny checkpoint's offline tokenizer.
    """
    import torch
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from diffusers.modular_pipelines import MiniMaxH3Blocks
    from omni_minimax_h3 import tiny
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    directory.mkdir(parents=True, exist_ok=True)
    target, torch_dtype = torch.device(device), getattr(torch, dtype)
    tokenizer = tiny.train_tokenizer()
    pipe = MiniMaxH3Blocks().init_pipeline()
    config = tiny.text_encoder_config(tiny.SPECS["tiny"], ENCODER_LAYERS, len(tokenizer), tokenizer)
    config["text_config"] = {**QWEN3_VL_32B_TEXT, "num_hidden_layers": ENCODER_LAYERS}
    if encoder_intermediate is not None:
        config["text_config"]["intermediate_size"] = encoder_intermediate
    config["vision_config"] = dict(QWEN3_VL_32B_VISION)
    sizes: dict[str, int] = {}
    components: dict[str, Any] = {}
    builders = {
        "text_encoder": lambda: Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config)),
        "transformer": lambda: MiniMaxH3Transformer3DModel(num_layers=layers),
        "vae": lambda: AutoencoderKLMiniMaxH3(),
    }
    for name, build in builders.items():
        module = on_device(build, target, torch_dtype)
        init_weights(module)
        components[name] = module.eval()
        sizes[name] = sum(p.numel() for p in module.parameters())
    # The audio VAE needs its latents' statistics (the release's are not in the class defaults).
    audio_vae = AutoencoderKLMiniMaxH3Audio(latents_mean=[0.0] * 32, latents_std=[1.0] * 32).to(device=target, dtype=torch_dtype).eval()
    sizes["audio_vae"] = sum(p.numel() for p in audio_vae.parameters())
    pipe.update_components(
        tokenizer=tokenizer, audio_vae=audio_vae, scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0), **components,
    )
    if encoder_dir is not None:
        encoder_dir.mkdir(parents=True, exist_ok=True)
        (directory / "text_encoder").symlink_to(encoder_dir, target_is_directory=True)
    pipe.save_pretrained(str(directory), overwrite_modular_index=True)
    tiny.write_processor(directory / "processor", tokenizer)
    return sizes


def on_device(build: Callable[[], Any], device: Any, dtype: Any) -> Any:
    """Build without allocating (meta), then allocate on `device` in `dtype` (every parameter is then
    written by `init_weights`; these modules have no persistent buffers, and loading recomputes the rest)."""
    import torch

    with torch.device("meta"):
        module = build()
    return module.to(dtype=dtype).to_empty(device=device)


def init_weights(module: Any) -> None:
    """Variance-preserving random weights (std 1/sqrt(fan_in)); norms and layer scales 1, biases 0."""
    import torch

    generator = torch.Generator(device=next(module.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, (param[0].numel()) ** -0.5, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


# -- FLOPs -------------------------------------------------------------------------------------------


@attrs.frozen
class FlopModel:
    """The DiT's forward FLOPs of one request, from the transformer's config (see the module doc)."""

    block_linear: int  # linear weights of one block (q, k, v, out, SwiGLU), AdaLN projection excluded
    refiner_linear: int  # linear weights of one token-refiner block
    inner: int  # heads x head_dim
    layers: int
    refiner_layers: int
    proj_in: int
    audio_proj_in: int
    context: int
    proj_out: int  # proj_out + audio_proj_out (both run over every row)

    @classmethod
    def from_transformer(cls, transformer: Any) -> FlopModel:
        import torch

        def linear(module: Any, skip: str = "adaln") -> int:
            return sum(m.weight.numel() for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and skip not in n)

        t, cfg = transformer, transformer.config
        return cls(
            block_linear=linear(t.transformer_blocks[0]), refiner_linear=linear(t.token_refiner.refiner_blocks[0]),
            inner=cfg.num_attention_heads * cfg.attention_head_dim, layers=len(t.transformer_blocks),
            refiner_layers=len(t.token_refiner.refiner_blocks), proj_in=linear(t.proj_in), audio_proj_in=linear(t.audio_proj_in),
            context=linear(t.context_embedder), proj_out=linear(t.proj_out) + linear(t.audio_proj_out),
        )

    def forward(self, video: int, audio: int, text: int, layers: float | None = None) -> float:
        """One forward over `video` + `audio` + `text` rows; `layers` of the blocks (default: all)."""
        rows = video + audio + text
        blocks = 2 * self.block_linear * rows + 4 * self.inner * rows * rows
        refiner = self.refiner_layers * (2 * self.refiner_linear * text + 4 * self.inner * text * text)
        edges = 2 * (self.proj_in * video + self.audio_proj_in * audio + self.context * text + self.proj_out * rows)
        return (self.layers if layers is None else layers) * blocks + refiner + edges


class ForwardTimer:
    """CUDA-event time inside the transformer's forwards (its rotary embedding to its audio output
    projection: the first and last modules both diffusers and Omni call), and the first forward's rows."""

    def __init__(self, transformer: Any, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.pairs: list[tuple[Any, Any]] = []
        self.wall: list[float] = []
        self.rows: tuple[int, int, int] | None = None
        self.handles = [
            transformer.rope.register_forward_pre_hook(self._start),
            transformer.audio_proj_out.register_forward_hook(self._end),
            transformer.register_forward_pre_hook(self._shapes, with_kwargs=True),
        ]

    def _start(self, module: Any, args: Any) -> None:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs.append((event, None))
        else:
            self.wall.append(-time.perf_counter())

    def _end(self, module: Any, args: Any, output: Any) -> None:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs[-1] = (self.pairs[-1][0], event)
        else:
            self.wall[-1] += time.perf_counter()

    def _shapes(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if self.rows is None and "video_indices" in kwargs:
            self.rows = tuple(int(kwargs[k].shape[0]) for k in ("video_indices", "audio_indices", "text_indices"))

    def reset(self) -> None:
        self.pairs, self.wall = [], []

    def seconds(self) -> float:
        if self.cuda:
            synchronize("cuda")
            return sum(a.elapsed_time(b) for a, b in self.pairs if b is not None) / 1000
        return sum(self.wall)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# -- the two systems ---------------------------------------------------------------------------------


@attrs.define
class Run:
    """What one configuration measured."""

    system: str
    concurrency: int
    repeat: int
    requests: int
    elapsed_s: float
    latencies_s: list[float]
    peak_mib: float
    forward_s: float  # time inside the transformer's forwards
    cache_threshold: float | None = None
    skipped_steps: float = 0.0
    frames: list[np.ndarray] = attrs.field(factory=list, repr=False)

    @property
    def video_s_per_s(self) -> float:
        return self.requests * FRAMES / FPS / self.elapsed_s


class DiffusersSystem:
    """The baseline: diffusers' `MiniMaxH3ModularPipeline`, one prompt per call."""

    def __init__(self, model: str, device: str, dtype: str, stride: int, compile: bool = False) -> None:
        import torch
        from diffusers import ModularPipeline
        from omni_minimax_h3.reference import ProcessorStandIn
        from transformers import Qwen3VLForConditionalGeneration

        self.pipe = ModularPipeline.from_pretrained(model)
        skip = ("processor", "text_encoder")
        names = [n for n in self.pipe.pretrained_component_names if n not in skip and (Path(model) / n).is_dir()]
        self.pipe.load_components(names=names, dtype=getattr(torch, dtype))
        # The text encoder straight onto the device (device_map), as Omni's encoder stage loads it: no ~50 GB host copy.
        placement = {"device_map": device} if device != "cpu" else {}
        text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(f"{model}/text_encoder", dtype=getattr(torch, dtype), **placement)
        # Qwen3VLProcessor's video processor needs torchvision; the stand-in is the one the equality tests use.
        self.pipe.update_components(processor=ProcessorStandIn(model), text_encoder=text_encoder.eval())
        self.pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.transformer = self.pipe.transformer
        if compile:  # the library's own regional compilation (every transformer block and refiner block)
            self.transformer.compile_repeated_blocks(fullgraph=True)
        self.device, self.stride = device, stride

    def one(self, index: int, size: tuple[int, int], steps: int) -> np.ndarray:
        import torch

        out = self.pipe(prompt=PROMPTS[index % len(PROMPTS)], num_inference_steps=steps, height=size[1], width=size[0],
                        num_frames=FRAMES, generator=torch.Generator().manual_seed(index), output_type="pt", output=["videos", "audio"])
        videos = out["videos"][0, :: self.stride]  # [T, 3, H, W] in [0, 1]
        return (videos.permute(0, 2, 3, 1).float() * 255.0).round().clamp(0, 255).to(torch.uint8).cpu().numpy()

    def run(self, requests: int, repeat: int, size: tuple[int, int], steps: int, memory: PeakMemory, timer: ForwardTimer) -> Run:
        """The requests arrive together and are served one at a time; E2EL counts from their arrival."""
        memory.reset()
        timer.reset()
        frames, latencies = [], []
        start = time.perf_counter()
        for i in range(requests):
            frames.append(self.one(i, size, steps))
            latencies.append(time.perf_counter() - start)
        elapsed = time.perf_counter() - start
        return Run("diffusers", requests, repeat, requests, elapsed, latencies, memory.peak_mib(), timer.seconds(), frames=frames)

    def close(self) -> None:
        self.pipe = self.transformer = None


class OmniSystem:
    """Omni: the minimax-h3 family's pipeline (encoder + dit), both stages inline, no entry points needed."""

    def __init__(self, model: str, device: str, dtype: str, max_num_seqs: int, stride: int, quantization: str | None = None,
                 compile: bool = False) -> None:
        import omni_minimax_h3.plugin

        from omni_core import Omni
        from omni_core.config import resolve
        from omni_core.plugins import load_plugins

        host = load_plugins(entry_points=(), extra_plugins=[omni_minimax_h3.plugin])
        # (no token budget: the plain rows batch every request; `set_max_batch_tokens` sets one)
        overrides = ["streaming=false", "encoder.placement=inline", "dit.placement=inline", f"dit.max_num_seqs={max_num_seqs}",
                     "dit.max_batch_tokens=null",
                     f"encoder.max_batch_size={max_num_seqs}", f"encoder.dtype={dtype}", f"encoder.device={device}",
                     f"dit.dtype={dtype}", f"dit.device={device}"]
        if quantization:
            overrides.append(f"dit.quantization={quantization}")
        if compile:
            overrides.append("dit.compile=true")
        self.omni = Omni(resolve(model, overrides=overrides, plugins=host))
        self.stride = stride
        self.system = f"omni+{quantization}" if quantization else "omni"

    def _dit(self) -> Any:
        """The ``dit`` stage's runtime (inline placement: a thread of this process). The engine has no
        public accessor for a replica's runtime; this bench reads down to it."""
        return self.omni._omni.engine.groups["dit"].replicas[0].worker.runtime

    def transformer(self) -> Any:
        """The ``dit`` stage's transformer, for `ForwardTimer`."""
        return self._dit().model.pipe.transformer

    def set_max_batch_tokens(self, tokens: int | None) -> None:
        """The ``dit`` stage's ``max_batch_tokens`` option on the loaded stage (it reads the option at
        every step), so the budget's rows need no second load; between runs only."""
        runtime = self._dit()
        runtime.options = attrs.evolve(runtime.options, max_batch_tokens=tokens)
        self.system = "omni" if tokens is None else f"omni, max_batch_tokens={tokens}"

    @staticmethod
    def request(index: int, size: tuple[int, int], steps: int, cache: float | None) -> Any:
        from omni_core.engine.request import OmniRequest

        params: dict[str, Any] = {"num_inference_steps": steps}
        params["cache"] = {"mode": "first_block", "threshold": cache} if cache is not None else "none"
        return OmniRequest(prompt=PROMPTS[index % len(PROMPTS)], extra={"size": list(size), "num_frames": FRAMES, "seed": index},
                           params={"dit": params})

    def run(self, concurrency: int, requests: int, repeat: int, size: tuple[int, int], steps: int, memory: PeakMemory,
            timer: ForwardTimer, cache: float | None = None) -> Run:
        memory.reset()
        timer.reset()
        results, latencies = [], []
        start = time.perf_counter()
        if concurrency == 1:
            for i in range(requests):
                results += self.omni.generate(self.request(i, size, steps, cache))
                latencies.append(time.perf_counter() - start)
        else:
            done: dict[str, float] = {}
            batch = [self.request(i, size, steps, cache) for i in range(requests)]
            results = self.omni.generate(batch, on_delta=lambda d: d.final and done.setdefault(d.request_id, time.perf_counter() - start))
            latencies = [done.get(r.request_id, time.perf_counter() - start) for r in results]
        elapsed = time.perf_counter() - start
        skipped = [r.extra.get("dit", {}).get("cache", {}).get("skipped_steps", 0) for r in results] if cache is not None else [0]
        return Run(self.system if cache is None else f"{self.system}+cache", concurrency, repeat, requests, elapsed, latencies, memory.peak_mib(),
                   timer.seconds(), cache_threshold=cache, skipped_steps=float(np.mean(skipped)),
                   frames=[np.asarray(r.video)[:: self.stride] for r in results])

    def close(self) -> None:
        self.omni.close()


# -- the report --------------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    """``mean (min-max)`` of repeated measurements."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{np.mean(values):.3g} ({min(values):.3g}-{max(values):.3g})"


@attrs.define
class Report(diffusion.Report):
    """Everything one run measured (`diffusion.Report`'s fields, JSON and paths), with this benchmark's
    FLOPs, rows, summary and markdown."""

    name: ClassVar[str] = "minimax-h3"
    runs: list[Run] = attrs.field(factory=list)

    def flops(self, skipped_steps: float = 0.0) -> tuple[float, float]:
        """(model FLOPs, executed FLOPs) of one request; `skipped_steps` ran only the first block."""
        m, steps = self.meta, self.args["steps"]
        if "flops" not in m or "rows" not in m:
            return float("nan"), float("nan")
        fm, (video, audio, text) = FlopModel(**m["flops"]), m["rows"]
        forwards = steps - 1  # the sigma grid has `steps` points with the final zero: steps - 1 forwards
        full = fm.forward(video, audio, text)
        executed = (forwards - skipped_steps) * full + skipped_steps * fm.forward(video, audio, text, layers=1)
        return forwards * full, executed

    def row(self, run: Run) -> dict[str, Any]:
        model, executed = self.flops(run.skipped_steps)
        ceiling = self.meta.get("ceiling_flops", float("nan"))
        return {
            "system": run.system, "concurrency": run.concurrency, "repeat": run.repeat, "requests": run.requests,
            "cache_threshold": run.cache_threshold, "elapsed_s": run.elapsed_s, "video_s_per_s": run.video_s_per_s,
            "e2el_mean_s": float(np.mean(run.latencies_s)), "e2el_max_s": float(np.max(run.latencies_s)),
            "peak_mib": run.peak_mib, "forward_s": run.forward_s, "skipped_steps": run.skipped_steps,
            "mfu": run.requests * model / run.elapsed_s / ceiling,
            "hfu": run.requests * executed / run.elapsed_s / ceiling,
            "dit_mfu": run.requests * model / run.forward_s / ceiling if run.forward_s > 0 else float("nan"),
            "dit_hfu": run.requests * executed / run.forward_s / ceiling if run.forward_s > 0 else float("nan"),
        }

    def configs(self) -> list[tuple[str, int, float | None]]:
        seen: list[tuple[str, int, float | None]] = []
        for run in self.runs:
            key = (run.system, run.concurrency, run.cache_threshold)
            if key not in seen:
                seen.append(key)
        return seen

    def of(self, system: str, concurrency: int, threshold: float | None = None) -> list[Run]:
        return [r for r in self.runs if (r.system, r.concurrency, r.cache_threshold) == (system, concurrency, threshold)]

    def summary(self) -> dict[str, Any]:
        """Ratios per repeat (the same repeat index of both systems), so their spread is the run's."""
        n = self.args["concurrency"]
        base, omni1, omni_n = self.of("diffusers", n), self.of("omni", 1), self.of("omni", n)
        out: dict[str, Any] = {}
        if base and omni_n:
            out["omni_cN_over_diffusers_sequential"] = [o.video_s_per_s / b.video_s_per_s for b, o in zip(base, omni_n)]
            out["psnr_omni_vs_diffusers_db"] = min(psnr(a, b) for a, b in zip(omni_n[0].frames, base[0].frames))
            out["psnr_between_prompts_db"] = psnr(base[0].frames[0], base[0].frames[1]) if len(base[0].frames) > 1 else float("nan")
        if base and omni1:
            out["omni_c1_over_diffusers_sequential"] = [o.video_s_per_s / b.video_s_per_s for b, o in zip(base, omni1)]
        quantization = self.args.get("quantization")
        quantized = self.of(f"omni+{quantization}", n) if quantization else []
        if base and quantized and omni_n:
            out["quantized_cN_over_diffusers_sequential"] = [q.video_s_per_s / b.video_s_per_s for b, q in zip(base, quantized)]
            out["quantized_psnr_vs_omni_db"] = min(psnr(a, b) for a, b in zip(quantized[0].frames, omni_n[0].frames))
            out["quantized_dit_speedup"] = [o.forward_s / q.forward_s for o, q in zip(omni_n, quantized)]
        budgeted = [r for r in self.runs if r.system.startswith("omni, max_batch_tokens=") and r.concurrency == n]
        if budgeted and omni_n:
            out["budget"] = {
                "system": budgeted[0].system,
                "throughput": [b.video_s_per_s / o.video_s_per_s for o, b in zip(omni_n, budgeted)],
                "e2el_mean": [float(np.mean(b.latencies_s) / np.mean(o.latencies_s)) for o, b in zip(omni_n, budgeted)],
                "psnr_vs_omni_db": min(psnr(a, b) for a, b in zip(budgeted[0].frames, omni_n[0].frames)),
            }
        for run_set in [self.of("omni+cache", n, t) for t in self.args["cache_thresholds"]]:
            if run_set and omni_n:
                out[f"cache_{run_set[0].cache_threshold}"] = {
                    "speedup": [o.elapsed_s / c.elapsed_s for o, c in zip(omni_n, run_set)],
                    "psnr_min_db": min(psnr(a, b) for a, b in zip(run_set[0].frames, omni_n[0].frames)),
                    "skipped_steps": run_set[0].skipped_steps,
                    "over_diffusers_sequential": [c.video_s_per_s / b.video_s_per_s for b, c in zip(base, run_set)] if base else [],
                }
        return out

    def markdown(self, rows: list[dict[str, Any]]) -> str:
        """(`rows`, `row` of each run in order, is unused: the tables group the runs by configuration.)"""
        a, m = self.args, self.meta
        w, h = a["size"]
        model, _ = self.flops()
        lines = [
            f"# MiniMax-H3 benchmark, preset {a['preset']}: {m.get('dit_layers')} DiT layers "
            f"({m.get('transformer_params', 0) / 1e9:.2f}B transformer parameters)",
            "",
            f"{m.get('device_name', a['device'])}, {a['dtype']}, t2va {w}x{h}, {FRAMES} frames ({FRAMES / FPS:.2f} s at {FPS} fps), "
            f"{a['steps']} steps ({a['steps'] - 1} transformer forwards), concurrency 1 and {a['concurrency']}, "
            f"{a['repeats']} repeats of each configuration in this one process. torch {m.get('torch')}, diffusers {m.get('diffusers')}. "
            + ("Both systems compiled (diffusers: `compile_repeated_blocks(fullgraph=True)`, its regional compilation; "
               "Omni: the dit stage's `compile` option, the blocks' attention-free halves)" if a.get("compile") else "Both systems eager")
            + ", same dtype, the same attention kernel (diffusers' `dispatch_attention_fn`, native backend).",
            f"Checkpoint: text encoder {m.get('param_text_encoder', 0) / 1e9:.2f}B ({ENCODER_LAYERS} layers of Qwen3-VL-32B's widths), "
            f"transformer {m.get('transformer_params', 0) / 1e9:.2f}B, video VAE {m.get('param_vae', 0) / 1e9:.2f}B, "
            f"audio VAE {m.get('param_audio_vae', 0) / 1e9:.2f}B; written in {m.get('checkpoint_write_s', float('nan')):.0f} s; "
            f"loaded by diffusers in {m.get('diffusers_load_s', float('nan')):.0f} s, by Omni in {m.get('omni_load_s', float('nan')):.0f} s.",
            f"Rows per request (packed layout): video {m.get('rows', ['?'] * 3)[0]}, audio {m.get('rows', ['?'] * 3)[1]}, "
            f"text {m.get('rows', ['?'] * 3)[2]}. DiT model FLOPs per request: {model / 1e12:.1f} T. "
            f"Matmul ceiling ({a['ceiling_n']}^3, {a['dtype']}): {m.get('ceiling_flops', 0) / 1e12:.1f} TFLOP/s.",
            "",
            "Each cell: mean (min-max) over the repeats. video s/s = seconds of video produced per wall second. "
            "MFU/HFU over wall time (the whole request: encoder, denoising, both VAE decodes); DiT MFU over the time inside "
            "the transformer forwards only. diffusers serves the N requests one by one (it takes one prompt per call); "
            "E2EL counts from their common arrival.",
            "",
            "| system | conc | cache thr | video s/s | wall s | E2EL mean s | peak GiB | MFU % | HFU % | DiT MFU % | DiT HFU % | fwd s | skipped steps |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for system, conc, thr in self.configs():
            rows = [self.row(r) for r in self.of(system, conc, thr)]

            def col(key: str, scale: float = 1.0) -> str:
                return spread([scale * r[key] for r in rows])

            lines.append(
                f"| {system} | {conc} | {'' if thr is None else f'{thr:g}'} | {col('video_s_per_s')} | {col('elapsed_s')} | "
                f"{col('e2el_mean_s')} | {col('peak_mib', 1 / 1024)} | {col('mfu', 100)} | {col('hfu', 100)} | "
                f"{col('dit_mfu', 100)} | {col('dit_hfu', 100)} | {col('forward_s')} | {col('skipped_steps')} |"
            )
        s, n = self.summary(), a["concurrency"]
        lines += ["", "## Ratios and goals (issue 21)", ""]
        if "omni_cN_over_diffusers_sequential" in s:
            ratios = s["omni_cN_over_diffusers_sequential"]
            lines.append(f"- goal: video s/s of Omni at concurrency {n} >= {GOALS['speedup']}x diffusers sequential: "
                         f"{spread(ratios)}x per repeat, {'met' if min(ratios) >= GOALS['speedup'] else 'not met'}")
            lines.append(f"- Omni vs diffusers, same prompts and seeds: min PSNR {s['psnr_omni_vs_diffusers_db']:.1f} dB "
                         f"(two different prompts of diffusers: {s['psnr_between_prompts_db']:.1f} dB)")
        if "omni_c1_over_diffusers_sequential" in s:
            lines.append(f"- Omni at concurrency 1 over diffusers sequential: {spread(s['omni_c1_over_diffusers_sequential'])}x")
        omni_n = [self.row(r) for r in self.of("omni", n)]
        if omni_n:
            mfu = [r["dit_mfu"] for r in omni_n]
            lines.append(f"- goal: DiT MFU >= {100 * GOALS['mfu']:.0f}% of the matmul ceiling at concurrency {n}: "
                         f"{spread([100 * x for x in mfu])}% ({'met' if min(mfu) >= GOALS['mfu'] else 'not met'}); "
                         f"over wall time {spread([100 * r['mfu'] for r in omni_n])}%")
        for key, value in s.items():
            if key.startswith("cache_"):
                ok = min(value["speedup"]) >= GOALS["cache_speedup"] and value["psnr_min_db"] >= GOALS["cache_psnr_db"]
                lines.append(f"- goal: cache threshold {key.split('_', 1)[1]}: {spread(value['speedup'])}x Omni cache-off at "
                             f"concurrency {n}, min PSNR {value['psnr_min_db']:.1f} dB, {value['skipped_steps']:.1f} of "
                             f"{a['steps'] - 1} forwards skipped per request (goal >= {GOALS['cache_speedup']}x at >= "
                             f"{GOALS['cache_psnr_db']:.0f} dB: {'met' if ok else 'not met'}); over diffusers sequential "
                             f"{spread(value['over_diffusers_sequential'])}x")
        if "quantized_cN_over_diffusers_sequential" in s:
            lines.append(f"- dit quantization {a['quantization']} at concurrency {n} (a precision change, so not the goal's like-for-like "
                         f"claim): {spread(s['quantized_cN_over_diffusers_sequential'])}x diffusers sequential, the forwards "
                         f"{spread(s['quantized_dit_speedup'])}x as fast as Omni's unquantized ones, min PSNR "
                         f"{s['quantized_psnr_vs_omni_db']:.1f} dB against Omni unquantized (DiT MFU credits the same FLOPs "
                         f"against the {a['dtype']} ceiling)")
        if "budget" in s:
            b = s["budget"]
            lines.append(f"- {b['system'].removeprefix('omni, ')} at concurrency {n} (requests start in arrival order while their rows "
                         f"fit): video s/s {spread(b['throughput'])}x, mean E2EL {spread(b['e2el_mean'])}x Omni's without it, "
                         f"min PSNR {b['psnr_vs_omni_db']:.1f} dB against it")
        systems = sorted({r.system for r in self.runs}, key=[r.system for r in self.runs].index)
        peaks = {sys_: max((r.peak_mib for r in self.runs if r.system == sys_), default=0) for sys_ in systems}
        lines.append("- peak GPU memory: " + ", ".join(f"{k} {v / 1024:.1f} GiB" for k, v in peaks.items() if v))
        if m.get("fit"):
            lines.append(f"- {m['fit']}")
        if self.skipped:
            lines += ["", "Skipped (time budget): " + ", ".join(self.skipped)]
        if self.notes:
            lines += ["", "Notes:"] + [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


# -- the run -----------------------------------------------------------------------------------------


def fit_note(report: Report, capacity_gib: float) -> str:
    """How many released-width DiT blocks fit beside the released encoder and VAEs, from measured peaks.

    A block's weights are the only part of the peak that grows with the layer count (activations are
    per block and freed), so: blocks = (capacity - (peak - blocks' weights)) / one block's weights."""
    m = report.meta
    block_bytes, layers = m.get("block_bytes"), m.get("dit_layers")
    peaks = [r.peak_mib * 2**20 for r in report.runs if r.system in ("omni", "diffusers")]
    if not block_bytes or not peaks:
        return ""
    fixed = max(peaks) - layers * block_bytes
    narrowed = m.get("encoder_intermediate")
    if narrowed:  # the released encoder's MLP weights this run did not hold (3 matrices a layer, bfloat16)
        fixed += ENCODER_LAYERS * 3 * QWEN3_VL_32B_TEXT["hidden_size"] * (QWEN3_VL_32B_TEXT["intermediate_size"] - narrowed) * 2
    fits = int((capacity_gib * 2**30 - fixed) // block_bytes)
    return (f"layers that fit one {capacity_gib:.0f} GiB GPU with the encoder, both VAEs and the largest peak measured here "
            f"({max(peaks) / 2**30:.1f} GiB at {layers} layers; {block_bytes / 2**30:.2f} GiB a block): {fits} "
            f"(the release has 50: {'all fit' if fits >= 50 else 'not all'})")


NARROW_ENCODER_INTERMEDIATE = 3200
ENCODER_BYTES = 54e9  # Qwen3-VL-32B's widths, 51 layers, bfloat16
REST_BYTES = 6.5e9  # the video and audio VAEs and the DiT outside its blocks, bfloat16
BLOCK_BYTES = 1.30e9  # one released-width DiT block, bfloat16


def place_encoder(report: Report, scratch: Path, layers: int) -> Path | None:
    """Where the text encoder is written: beside the rest when the disk holds it all, else /dev/shm."""
    import shutil

    scratch.mkdir(parents=True, exist_ok=True)
    need = ENCODER_BYTES + REST_BYTES + layers * BLOCK_BYTES
    free = shutil.disk_usage(scratch).free
    shm = Path("/dev/shm")
    shm_free = shutil.disk_usage(shm).free if shm.is_dir() else 0
    report.meta.update(disk_free_gb=free / 1e9, shm_free_gb=shm_free / 1e9, checkpoint_need_gb=need / 1e9)
    if free > 1.05 * need:
        return None
    if shm_free > 1.05 * ENCODER_BYTES and free > 1.05 * (need - ENCODER_BYTES):
        report.notes.append(f"the disk ({free / 1e9:.0f} GB free) cannot hold the {need / 1e9:.0f} GB checkpoint: "
                            "its text encoder was written to /dev/shm (memory) and linked")
        return shm / "omni-bench-text-encoder"
    # Neither holds it: the encoder's MLP is narrowed (its hidden size, the DiT's text_dim, stays 5120);
    # the released encoder's extra weights are added back in the fit computation (`fit_note`).
    report.meta["encoder_intermediate"] = NARROW_ENCODER_INTERMEDIATE
    report.notes.append(f"neither the disk ({free / 1e9:.0f} GB free) nor /dev/shm ({shm_free / 1e9:.0f} GB) holds the "
                        f"{need / 1e9:.0f} GB checkpoint: the text encoder's MLP was narrowed to {NARROW_ENCODER_INTERMEDIATE} "
                        "(released 25600); the peaks below lack the difference, which the fit count adds back")
    return None


def run(args: argparse.Namespace) -> Report:
    import torch

    t0 = time.perf_counter()
    preset = PRESETS[args.preset]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(args=dict(vars(args)), out=out)
    cuda = args.device.startswith("cuda")
    report.meta.update(torch=torch.__version__, python=platform.python_version(), dit_layers=args.layers,
                       device_name=torch.cuda.get_device_name(args.device) if cuda else platform.processor() or "cpu")
    import diffusers

    report.meta["diffusers"] = diffusers.__version__

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", flush=True)

    def measured(name: str, fn: Callable[[], Run]) -> None:
        if time.perf_counter() - t0 > args.budget_s:
            report.skipped.append(name)
            report.write()
            return
        result = fn()
        report.runs.append(result)
        report.write()
        log(f"{name}: {result.video_s_per_s:.3f} video s/s, wall {result.elapsed_s:.2f} s, forwards {result.forward_s:.2f} s, "
            f"peak {result.peak_mib / 1024:.2f} GiB")

    model = args.model
    if model is None:
        model = str(Path(args.scratch) / f"minimax-h3-{args.preset}-{args.layers}")
        if not (Path(model) / "modular_model_index.json").exists():
            began = time.perf_counter()
            if preset.widths == "tiny":
                from omni_minimax_h3.tiny import make_tiny

                make_tiny(Path(model))
            else:
                encoder_dir = place_encoder(report, Path(args.scratch), args.layers)
                sizes = write_released(Path(model), args.layers, args.device, args.dtype, encoder_dir,
                                       report.meta.get("encoder_intermediate"))
                report.meta.update({f"param_{k}": v for k, v in sizes.items()})
            synchronize(args.device)
            report.meta["checkpoint_write_s"] = time.perf_counter() - began
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            log(f"checkpoint written: {model}")
    report.meta["checkpoint"] = model
    report.meta["ceiling_flops"] = matmul_ceiling(args.device, args.dtype, args.ceiling_n)
    log(f"ceiling {report.meta['ceiling_flops'] / 1e12:.1f} TFLOP/s")
    memory = PeakMemory(args.device)
    n, size, steps = args.concurrency, tuple(args.size), args.steps
    stride = args.psnr_stride

    began = time.perf_counter()
    base = DiffusersSystem(model, args.device, args.dtype, stride, compile=args.compile)
    report.meta["diffusers_load_s"] = time.perf_counter() - began
    transformer = base.transformer
    report.meta["flops"] = attrs.asdict(FlopModel.from_transformer(transformer))
    report.meta["transformer_params"] = sum(p.numel() for p in transformer.parameters())
    block = transformer.transformer_blocks[0]
    report.meta["block_bytes"] = sum(p.numel() * p.element_size() for p in block.parameters())
    timer = ForwardTimer(transformer, args.device)
    # Warm-up (also records the packed layout's rows); compiled, every prompt: their text lengths
    # differ, and the compiled blocks' recompile for a new length must not land in the measured runs.
    for i in range(n if args.compile else 1):
        base.one(i, size, 2)
    report.meta["rows"] = list(timer.rows or (0, 0, 0))
    log(f"diffusers loaded and warm; rows {report.meta['rows']}")
    report.write()
    for repeat in range(args.repeats):
        measured(f"diffusers sequential x{n} #{repeat}", lambda base=base, repeat=repeat: base.run(n, repeat, size, steps, memory, timer))
    timer.close()
    base.close()
    del base, transformer, block, timer
    memory.reset()
    if cuda:  # should be ~0: Omni's peak must not include diffusers' weights
        report.meta["cuda_allocated_before_omni_mib"] = torch.cuda.memory_allocated(args.device) / 2**20

    began = time.perf_counter()
    omni = OmniSystem(model, args.device, args.dtype, max_num_seqs=n, stride=stride, compile=args.compile)
    report.meta["omni_load_s"] = time.perf_counter() - began
    try:
        timer = ForwardTimer(omni.transformer(), args.device)
        omni.omni.generate([OmniSystem.request(0, size, 2, None)])  # warm-up, alone and with N (compiled: both shapes)
        omni.omni.generate([OmniSystem.request(i, size, 2, None) for i in range(n)])
        log("omni loaded and warm")
        # The dit's token budget, K requests' rows: on the same loaded stage, after each repeat at N.
        budget = int(args.max_batch_tokens * sum(report.meta["rows"])) if args.max_batch_tokens is not None else None
        for repeat in range(args.repeats):
            if not args.skip_c1:
                measured(f"omni c1 #{repeat}", lambda: omni.run(1, 1, repeat, size, steps, memory, timer))
            measured(f"omni c{n} #{repeat}", lambda: omni.run(n, n, repeat, size, steps, memory, timer))
            if budget is not None:
                omni.set_max_batch_tokens(budget)
                measured(f"omni max_batch_tokens={budget} c{n} #{repeat}", lambda: omni.run(n, n, repeat, size, steps, memory, timer))
                omni.set_max_batch_tokens(None)
            for threshold in args.cache_thresholds:
                measured(f"omni+cache {threshold} c{n} #{repeat}",
                         lambda: omni.run(n, n, repeat, size, steps, memory, timer, cache=threshold))
        timer.close()
    finally:
        omni.close()
    omni = timer = None  # (the quantized load below must not hold this one's memory)
    if args.quantization:  # the dit stage's quantization option: other weights, a fresh load
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        label = args.quantization
        system = OmniSystem(model, args.device, args.dtype, max_num_seqs=n, stride=stride, compile=args.compile, quantization=label)
        try:
            forwards = ForwardTimer(system.transformer(), args.device)
            system.omni.generate([OmniSystem.request(i, size, 2, None) for i in range(n)])  # warm-up
            log(f"omni {label} loaded and warm")
            for repeat in range(args.repeats):
                measured(f"omni {label} c{n} #{repeat}", lambda: system.run(n, n, repeat, size, steps, memory, forwards))
            forwards.close()
        finally:
            system.close()
    if cuda and preset.widths == "released":
        report.meta["fit"] = fit_note(report, torch.cuda.get_device_properties(args.device).total_memory / 2**30)
    report.meta["total_s"] = time.perf_counter() - t0
    report.write()
    return report


def probe(args: argparse.Namespace) -> None:
    """Released-width parts built in memory (no checkpoint) and timed: one DiT block at one and N
    requests' rows, and the video VAE's decode of one request; to size the real run."""
    import torch
    from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Transformer3DModel
    from omni_minimax_h3.packed import Segments, use_segmented_attention

    dtype = getattr(torch, args.dtype)
    ceiling = matmul_ceiling(args.device, args.dtype, args.ceiling_n)
    print(f"ceiling {ceiling / 1e12:.1f} TFLOP/s", flush=True)
    transformer = on_device(lambda: MiniMaxH3Transformer3DModel(num_layers=1), torch.device(args.device), dtype)
    init_weights(transformer)
    use_segmented_attention(transformer)
    fm = FlopModel.from_transformer(transformer)
    w, h = args.size
    video = 37 * (h // 32) * (w // 32)
    rows = video + 414 + 12
    block = transformer.transformer_blocks[0]
    for requests in (1, args.concurrency):
        length = rows * requests
        x = torch.randn(1, length, 5376, device=args.device, dtype=dtype)
        temb = transformer.time_embedder(transformer.time_proj(torch.rand(2, device=args.device)).to(dtype))
        adaln = torch.randint(0, 6, (length,), device=args.device)
        cos = torch.ones(length, 48, device=args.device)
        rotary = (cos, torch.zeros_like(cos))
        segments = Segments.of_lengths([rows] * requests)
        for _ in range(2):
            block(x, temb, adaln, rotary, segments)
        synchronize(args.device)
        began = time.perf_counter()
        for _ in range(5):
            block(x, temb, adaln, rotary, segments)
        synchronize(args.device)
        seconds = (time.perf_counter() - began) / 5
        flops = requests * (2 * fm.block_linear * rows + 4 * fm.inner * rows * rows)
        print(f"block x{requests} ({length} rows): {1000 * seconds:.1f} ms, {flops / seconds / ceiling * 100:.1f}% of ceiling", flush=True)
    del transformer, block, x
    vae = on_device(lambda: AutoencoderKLMiniMaxH3(), torch.device(args.device), dtype)
    init_weights(vae)
    torch.cuda.reset_peak_memory_stats() if args.device.startswith("cuda") else None
    z = torch.randn(1, 24, 37, h // 16, w // 16, device=args.device, dtype=dtype)
    try:
        with torch.no_grad():
            synchronize(args.device)
            began = time.perf_counter()
            out = vae.decode(z, return_dict=False)[0]
            synchronize(args.device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
        print(f"vae decode {tuple(out.shape)}: {time.perf_counter() - began:.2f} s, peak {peak:.1f} GiB", flush=True)
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        print(f"vae decode failed: {type(exc).__name__}: {exc}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--model", default=None, help="an existing MiniMax-H3 checkpoint (default: write the preset's)")
    parser.add_argument("--layers", type=int, default=None, help="DiT blocks of the written checkpoint (default: the preset's)")
    parser.add_argument("--size", type=lambda s: [int(x) for x in s.lower().split("x")], default=None, help="WxH")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-thresholds", type=lambda s: [float(x) for x in s.split(",") if x], default=None)
    parser.add_argument("--psnr-stride", type=int, default=8, help="PSNR over every k-th frame")
    parser.add_argument("--ceiling-n", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no configuration after this many seconds")
    parser.add_argument("--quantization", choices=("fp8", "int8"), default=None,
                        help="then Omni again at --concurrency with the dit stage's quantization option")
    parser.add_argument("--skip-c1", action="store_true", help="leave out Omni at concurrency 1")
    parser.add_argument("--max-batch-tokens", type=float, default=None,
                        help="also Omni at concurrency N with the dit's max_batch_tokens at this many requests' rows (1: one at a time)")
    parser.add_argument("--compile", action="store_true", help="both systems compiled (diffusers' regional compilation, Omni's dit compile)")
    parser.add_argument("--probe", action="store_true", help="time released-width parts in memory and exit")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/omni-bench-out")
    parser.add_argument("--scratch", default="/tmp/omni-bench-ckpt", help="where random checkpoints are written (not $OUT)")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    args.layers = args.layers or preset.layers
    args.size = args.size or list(preset.size)
    args.steps = args.steps or preset.steps
    args.cache_thresholds = args.cache_thresholds if args.cache_thresholds is not None else list(preset.cache_thresholds)
    args.ceiling_n = args.ceiling_n or (8192 if args.device.startswith("cuda") else 1024)
    if args.probe:
        probe(args)
        return
    report = run(args)
    print(report.path(".md").read_text())


if __name__ == "__main__":
    main()
