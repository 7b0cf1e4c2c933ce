"""HunyuanImage-3.0 t2i benchmark: Omni's ``dit`` stage against nemo-automodel's HunyuanImage3Pipeline.

    python bench/hunyuan_image3.py --preset tiny                                   # CPU, float32: a smoke test
    OMNI_BENCH=hunyuan_image3 bash bench/gpu/run.sh h200 --layers 8 --repeats 2    # the H200 run (issue 25)

Preset ``h200`` writes (under ``--scratch``) a random-weight checkpoint in the release layout with the
released widths (hidden 4096, 32 query / 8 KV heads of 128, 64 experts top-8 + 1 shared of 3072, UNet
patch embedder 1024, 32 latent channels, image_base_size 1024, a VAE of widths 128-1024, the release VAE's layout) and
``--layers`` decoder layers (the release has 32); the tokenizer is the tiny one (the vocabulary only
sizes the embedding and the LM head, which image steps do not run). The weights are drawn with std
0.02, so the router spreads tokens over the experts as a trained one roughly does.

In ONE process, on the same weights, the same prompts and seeds (peak memory reset per configuration):

1. the reference: nemo-automodel's Apache-2.0 ``HunyuanImage3Pipeline`` (one prompt per call, the
   whole sequence through the model at every step, CFG in the batch), with its fastest backends here
   (SDPA attention, ``torch._grouped_mm`` experts), serving the requests one after the other; it decodes
   with the release's VAE ops (`ReleaseVAECall` over our VAE, `use_release_ops`: the library's GroupNorm
   kernel and plain 3-D convolutions), and with
   ``--compile`` its blocks and VAE decoder are compiled as Omni's are;
2. Omni's ``dit`` stage (the family's pipeline, its diffusion stage runtime) at concurrency 1 and N
   (N requests arrive at once and are denoised together); with ``--quantization``, once more at N with
   the stage's ``quantization`` option (its layers' linears and grouped experts in FP8 or int8);
   ``--expert-gemms grouped,per_expert,interleaved:2048`` times it once per way of multiplying the
   experts (`LayerKernels.expert_gemms`; ``:R``, `LayerKernels.expert_rows`), and ``--row-gathers scatter,index`` once per way of taking their
   input rows (`LayerKernels.rows`), on the same loaded stage (the others than the first at
   concurrency N only).

When device time is short, ``--skip-eager-reference`` (with ``--compile``) times the reference compiled
only (the PSNR is then against its images), ``--skip-c1`` times Omni at concurrency N only, and
``--skip-reference`` Omni alone (no ratio, no PSNR). ``--breakdown`` then serves one more batch at
concurrency N with the GPU drained after each runtime step (`Omni.breakdown`: where a batch's time goes).

Every request: t2i, ``--size`` square, ``--steps`` steps, CFG 5.0. Omni's images are compared with the
reference's (PSNR): the same weights, noise and schedule, so they differ only by bf16 rounding.

FLOPs are the transformer's forward FLOPs per image: for every row (cond and uncond) and step, each
layer's linears (fused qkv, o, top-k experts, the shared expert; the router is left out) over the
``<timestep>`` and image tokens, attention of those tokens to the prefix and to each other, and the
convolutions of the transformer's UNet patch embedder and head (``patch_embed``, ``final_layer``:
~0.64 of a layer's FLOPs per image token; results before 2026-12-04's third session left them out);
the VAE and the text prefix are left out.
- *MFU* = images/s x model FLOPs per image / the measured bf16 matmul ceiling (wall time: everything
  a request costs is in the denominator).
- *HFU* = the FLOPs each system executes: the reference runs the whole sequence (prefix, ``<timestep>``,
  image, ``<eoi>``) at every step; Omni runs the prefix once per request, then the image tokens, and
  the patch embedder once per image and step (both CFG rows embed the same latents).

Results: ``$OUT/hunyuan-image3-<preset>.md`` and ``.json``. Not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from diffusion import PeakMemory, Run, matmul_ceiling, psnr, synchronize, timed

PROMPTS = [
    "a red apple on a wooden table", "a cat sleeps on a sofa", "waves crash on the rocks at sunset",
    "a robot arm picks up a blue cube", "city lights glow at night in the rain", "a dog runs on the beach",
    "a cup of tea next to a book", "seagulls fly over the sea",
]
RELEASE = {
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128,
    "num_experts": 64, "moe_topk": 8, "moe_intermediate_size": 3072, "patch_embed_hidden_dim": 1024,
    "image_base_size": 1024, "tokenizer_vocab": 512, "vae_blocks": [128, 256, 512, 1024, 1024],
    "vae_layers_per_block": 2, "vit_width": 32,
}
GUIDANCE = 5.0


def write_release_width(directory: Path, layers: int, device: str, seed: int = 0, spec: dict[str, Any] | None = None,
                        dtype: str = "bfloat16") -> None:
    """A release-layout checkpoint with the released widths (or `spec`'s) and `layers` layers (`dtype`;
    router fp32)."""
    import torch
    from omni_hunyuan import tiny
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.transformer import HunyuanImage3
    from safetensors.torch import save_file

    if (directory / "config.json").exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    spec = {**(spec or RELEASE), "num_hidden_layers": layers}
    tokenizer = tiny.tiny_tokenizer(spec["tokenizer_vocab"], spec["image_base_size"])
    config = tiny.release_config(spec, -(-len(tokenizer) // 64) * 64, tokenizer)
    config["torch_dtype"] = dtype
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in HunyuanImage3(HunyuanConfig.from_dict(config)).named_parameters()}
    generator = torch.Generator(device).manual_seed(seed)
    groups: dict[str, dict[str, Any]] = {}
    for name, shape in sorted(shapes.items()):
        group = f"layer{int(name.split('.')[2]):03d}" if name.startswith("model.layers.") else "rest"
        kind = torch.float32 if ".mlp.gate." in name else getattr(torch, dtype)
        if len(shape) == 1 and ("norm" in name or name.endswith(("in_layers.0.weight", "out_layers.0.weight", "model.1.0.weight"))):
            tensor = torch.ones(shape, dtype=kind)
        else:
            tensor = (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.02).to(kind).cpu()
        groups.setdefault(group, {})[name] = tensor
    groups["rest"].update({**tiny._vae_tensors(config, seed + 1), **tiny._vision_tensors(config, seed + 2)})
    weight_map, total = {}, 0
    for number, (group, tensors) in enumerate(sorted(groups.items()), start=1):
        shard = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
        weight_map.update({key: shard for key in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(tiny.generation_config(tokenizer), indent=2))
    tokenizer.save_pretrained(directory)


def checkpoint(scratch: Path, preset: str, layers: int, device: str) -> Path:
    """The benchmark's checkpoint under `scratch`, written on first use: the tiny one (2 layers), or
    the release widths with `layers` layers (`write_release_width`); named with the family's
    ``tiny_format``, so a checkpoint of an older layout is not reused."""
    from omni_hunyuan.plugin import FAMILY

    version = f"v{FAMILY.tiny_format}"
    if preset == "tiny":
        from omni_hunyuan.tiny import make_tiny

        model = scratch / f"tiny-{version}"
        if not (model / "config.json").exists():
            make_tiny(model)
        return model
    model = scratch / f"{preset}-{layers}-{version}"
    write_release_width(model, layers, device)
    return model


class Flops:
    """Transformer forward FLOPs of one t2i image (see the module docstring)."""

    def __init__(self, config: Any, prefix: int, side: int, steps: int, rows: int = 2) -> None:
        hidden, heads, kv, head = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        inter = config.moe_intermediate_size
        self.linear_per_token = 2 * (hidden * (heads + 2 * kv) * head + heads * head * hidden
                                     + (config.moe_topk + config.num_shared_experts) * 3 * hidden * inter)
        self.heads_dim = heads * head
        self.layers, self.prefix, self.tokens, self.steps, self.rows = config.num_layers, prefix, side * side + 1, steps, rows
        # The transformer's convolutional patch embedder (`UNetDown`) and head (`UNetUp`), per latent pixel:
        # 3x3 convs latent->patch, patch->hidden, hidden->hidden, 1x1 skip patch->hidden; then
        # hidden->patch, patch->patch, 1x1 skip hidden->patch, patch->latent.
        latent, patch = config.latent_channels, config.patch_embed_hidden_dim
        self.down_per_pixel = 2 * (9 * (latent * patch + patch * hidden + hidden * hidden) + patch * hidden)
        self.up_per_pixel = 2 * (9 * (hidden * patch + patch * patch + patch * latent) + hidden * patch)
        self.pixels = side * side

    def attention(self, queries: int, keys: int) -> float:
        return 4.0 * queries * keys * self.heads_dim

    def unet(self) -> float:
        """The patch embedder and head of every row and step (as the reference runs them)."""
        return float(self.rows * self.steps * self.pixels * (self.down_per_pixel + self.up_per_pixel))

    def model(self) -> float:
        """Credited: the new tokens of every step through the layers, and the UNet embedder and head."""
        per_row = self.tokens * self.linear_per_token + self.attention(self.tokens, self.prefix + self.tokens)
        return float(self.layers * self.rows * self.steps * per_row) + self.unet()

    def omni(self) -> float:
        """Executed by Omni: the prefix once (causal, half its attention), then `model`, less the
        patch embedder of all but one row a step (a sample's CFG rows share its input)."""
        prefix = self.prefix * self.linear_per_token + self.attention(self.prefix, self.prefix) / 2
        shared = (self.rows - 1) * self.steps * self.pixels * self.down_per_pixel
        return self.model() + self.layers * self.rows * prefix - shared

    def reference(self) -> float:
        """Executed by the reference: the whole row (prefix, <timestep>, image, <eoi>) at every step,
        every token against every key (its mask blocks, its kernels still compute)."""
        whole = self.prefix + self.tokens + 1
        layers = self.layers * self.rows * self.steps * (whole * self.linear_per_token + self.attention(whole, whole))
        return float(layers) + self.unet()


class Reference:
    """nemo-automodel's HunyuanImage3Pipeline on the checkpoint (its fastest backends here)."""

    def __init__(self, model: Path, device: str, dtype: str) -> None:
        import nemo_automodel.components.models.hunyuan_image3.pipeline as nemo_pipeline
        import torch
        from nemo_automodel.components.models.common import BackendConfig
        from nemo_automodel.components.models.hunyuan_image3 import HunyuanImage3Config, HunyuanImage3ForCausalMM
        from omni_hunyuan.config import HunyuanConfig, generation_defaults
        from omni_hunyuan.reference import NemoPrompts, ReleaseVAECall
        from omni_hunyuan.resolution import ratio_sizes
        from omni_hunyuan.tokens import SpecialTokens
        from omni_hunyuan.vae import load_vae, use_release_ops
        from omni_hunyuan.weights import read_tensors
        from transformers import AutoTokenizer

        config = HunyuanConfig.from_pretrained(model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokens = SpecialTokens.from_tokenizer(tokenizer, config.image_base_size)
        raw = json.loads((model / "config.json").read_text())
        fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "torch_dtype")}
        nemo_config = HunyuanImage3Config(**fields, image_token_id=tokens.image, timestep_token_id=tokens.timestep, torch_dtype=dtype)
        cuda = device.startswith("cuda")
        backend = BackendConfig(attn="sdpa", linear="torch", experts="torch_mm" if cuda else "torch", dispatcher="torch",
                                rms_norm="torch_fp32")
        with torch.device("meta"):
            transformer = HunyuanImage3ForCausalMM(nemo_config, backend=backend)
        transformer.to_empty(device=device)
        transformer.initialize_weights(torch.device(device), dtype=getattr(torch, dtype))
        state = transformer.state_dict_adapter.from_hf(read_tensors(model))
        missing, unexpected = transformer.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"nemo reference: missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}")
        del state
        with torch.no_grad():  # the release's dtypes: the router fp32 (nemo's _keep_in_fp32_modules_strict), the rest `dtype`
            for name, param in transformer.named_parameters():
                param.data = param.data.to(torch.float32 if ".mlp.gate." in name else getattr(torch, dtype))
        self.transformer = transformer.eval()
        self.vae = ReleaseVAECall(use_release_ops(load_vae(model, config.vae, device=device)))  # (the release's own ops)
        base = config.image_base_size
        square = ratio_sizes(base, len(tokens.ratios)).index((base, base))
        prompts = NemoPrompts(tokenizer, tokens, square, base // config.vae_downsample)
        shift = float(generation_defaults(model).get("flow_shift", 3.0))
        self.pipe = nemo_pipeline.HunyuanImage3Pipeline(self.transformer, self.vae, prompts, shift, torch.device(device))
        self.device = device
        self.system = "nemo-automodel pipeline"

    def compile(self) -> None:
        """Each decoder block under `torch.compile`, and the VAE decoder whole (its best settings when
        Omni's layers and VAE decoder are compiled: the dit stage's ``compile: true``)."""
        for block in self.transformer.model.layers.values():
            block.compile()
        self.vae.vae.decoder.compile(dynamic=None)
        self.system = "nemo-automodel pipeline, compiled"

    def run(self, requests: int, size: int, steps: int, memory: PeakMemory) -> Run:
        import torch

        memory.reset()
        images, latencies = [], []
        start = time.perf_counter()
        with torch.no_grad():
            for i in range(requests):
                began = time.perf_counter()
                generator = torch.Generator(self.device).manual_seed(i)
                out = self.pipe(PROMPTS[i % len(PROMPTS)], generator=generator, num_inference_steps=steps,
                                guidance_scale=GUIDANCE, height=size, width=size)
                images.append(np.asarray(out.images[0]))
                latencies.append(time.perf_counter() - began)
        synchronize(self.device)
        return Run(self.system, 1, requests, time.perf_counter() - start, latencies, memory.peak_mib(), images=images)

    def close(self) -> None:
        self.pipe = self.transformer = self.vae = None


def expert_kernels(kernels: Any, how: str) -> Any:
    """`kernels` (`LayerKernels`) multiplying grouped experts `how`: an `expert_gemms` value, ``:R`` after
    it for `expert_rows` R (``interleaved:2048``)."""
    import attrs

    gemms, _, rows = how.partition(":")
    return attrs.evolve(kernels, expert_gemms=gemms, expert_rows=int(rows or 0))


class Omni:
    """Omni's ``dit`` stage: the family's pipeline resolved for the checkpoint, its diffusion stage
    runtime driven as the engine's worker drives it (add requests, step until each one's final chunk).
    t2i never reaches the ``ar`` stage, which needs vLLM (the GPU machine has none), so it is not built
    (nor shared: the dit loads its own copy)."""

    def __init__(self, model: Path, device: str, dtype: str, max_num_seqs: int, compile: bool = False,
                 quantization: str | None = None) -> None:
        import attrs
        import omni_hunyuan.plugin
        from omni_core.config import resolve
        from omni_core.plugins import load_plugins
        from omni_core.stages.diffusion import DiffusionStageRuntime

        host = load_plugins(entry_points=(), extra_plugins=[omni_hunyuan.plugin])
        overrides = ["dit.placement=inline", "dit.share_model_with=", f"dit.max_num_seqs={max_num_seqs}", f"dit.dtype={dtype}", f"dit.device={device}"]
        if compile:
            overrides.append("dit.compile=true")
        if quantization:
            overrides.append(f"dit.quantization={quantization}")
        self.system = ", ".join(["omni", *(["compiled"] if compile else []), *([quantization] if quantization else [])])
        pipeline = resolve(str(model), overrides=overrides, plugins=host)
        stage = pipeline.stage("dit")
        self.runtime = DiffusionStageRuntime(pipeline, attrs.evolve(stage, options={**stage.options, "admission_window_ms": 0.0}))
        self.runtime.load()
        self.device = device
        kernels = self.runtime.model.transformer.kernels  # the experts' row kernels as served (`row_gather`)
        self.served_rows = {"rows": kernels.rows, "rows_fp8": kernels.rows_fp8}

    @staticmethod
    def request(index: int, size: int, steps: int) -> Any:
        from omni_core.outputs import StageInput

        params = {"num_inference_steps": steps, "guidance_scale": GUIDANCE, "seed": index, "size": [size, size], "cache": "none"}
        return StageInput(data={"prompt": PROMPTS[index % len(PROMPTS)]}, params=params)

    def _serve(self, indices: list[int], size: int, steps: int, start: float) -> dict[int, tuple[np.ndarray, float]]:
        for i in indices:
            self.runtime.add_request(str(i), self.request(i, size, steps))
        done: dict[int, tuple[np.ndarray, float]] = {}
        while self.runtime.has_unfinished():
            for chunk in self.runtime.step():
                if chunk.final:
                    done[int(chunk.request_id)] = (np.asarray(chunk.data["image"]), time.perf_counter() - start)
        return done

    def run(self, concurrency: int, requests: int, size: int, steps: int, memory: PeakMemory) -> Run:
        memory.reset()
        images, latencies = [], []
        start = time.perf_counter()
        for first in range(0, requests, concurrency):
            began = time.perf_counter()
            done = self._serve(list(range(first, min(requests, first + concurrency))), size, steps, start)
            for i in sorted(done):
                images.append(done[i][0])
                latencies.append(done[i][1] - (began - start if concurrency == 1 else 0.0))
        synchronize(self.device)
        return Run(self.system, concurrency, requests, time.perf_counter() - start, latencies, memory.peak_mib(), images=images)

    def breakdown(self, concurrency: int, size: int, steps: int) -> str:
        """A markdown table of one batch of `concurrency` requests served with the GPU drained after every
        runtime step (the first admits the requests and encodes their text prefixes, then steps; the last
        steps, then decodes), beside the decode of as many images alone: where the wall time goes."""
        import torch
        from omni_hunyuan.vae import decode_latents

        for i in range(concurrency):
            self.runtime.add_request(str(i), self.request(i, size, steps))
        times = []
        start = time.perf_counter()
        while self.runtime.has_unfinished():
            began = time.perf_counter()
            self.runtime.step()
            synchronize(self.device)
            times.append(time.perf_counter() - began)
        total = time.perf_counter() - start
        model = self.runtime.model
        side = size // model.config.vae_downsample
        latents = torch.randn(concurrency, model.config.latent_channels, side, side, device=self.device)
        decode = timed(self.device, lambda: decode_latents(model.decoder, latents, model.config.vae), 1)
        middle = np.array(times[1:-1]) * 1000
        steady = f"{np.median(middle):.1f} ({middle.min():.1f}-{middle.max():.1f})" if middle.size else "-"
        return "\n".join([
            f"One batch of {concurrency} requests, {steps} steps, the GPU drained after each runtime step ({self.system}):",
            "", "| wall (s) | runtime steps | first step (ms) | other steps, median (min-max) (ms) | last step (ms) | "
            f"decode of {concurrency} images alone (ms) |", "|---:|---:|---:|---:|---:|---:|",
            f"| {total:.2f} | {len(times)} | {times[0] * 1000:.0f} | {steady} | "
            f"{times[-1] * 1000:.0f} | {decode * 1000:.0f} |", "",
        ])

    def expert_gemms(self, how: str) -> str:
        """The dit stage's denoising forwards run their grouped experts `how` (`LayerKernels.expert_gemms`;
        ``interleaved:R``: `LayerKernels.expert_rows` R); returns how, in words (none where the experts
        are not grouped: CPU, fp32)."""
        transformer = self.runtime.model.transformer
        kernels = transformer.kernels = expert_kernels(transformer.kernels, how)
        if not any(layer.mlp.grouped for layer in transformer.model.layers):
            return ""
        words = {"grouped": "one grouped GEMM a projection", "per_expert": "per-expert GEMMs",
                 "interleaved": "per-expert GEMMs, each expert's up, SwiGLU and down back to back"}[kernels.expert_gemms]
        return f"{words}, {kernels.expert_rows} rows at a time" if kernels.expert_rows else words

    def row_gather(self, how: str) -> str:
        """The experts' input rows taken `how` (`LayerKernels.rows`, `rows_fp8`): "scatter" (the stage's
        own kernels: compiled, each token read once and written to its k places; as served) or "index"
        (`gather_rows`, `gather_rows_fp8`: an ``index_select`` in expert order); returns how, in words
        ("" for "scatter")."""
        import attrs
        from omni_hunyuan.layers import gather_rows, gather_rows_fp8

        transformer = self.runtime.model.transformer
        rows = {"rows": gather_rows, "rows_fp8": gather_rows_fp8} if how == "index" else self.served_rows
        transformer.kernels = attrs.evolve(transformer.kernels, **rows)
        return "rows by index_select" if how == "index" else ""

    def close(self) -> None:
        self.runtime.close()


def report(args: argparse.Namespace, runs: list[list[Run]], flops: Flops, ceiling: float, weights_gib: float,
           psnrs: dict[str, list[float]], notes: list[str]) -> str:
    """The markdown table (median of the repeats, spread as min-max) and the reading. The reference
    is the faster of its configurations (eager; compiled with ``--compile``)."""
    base = max((float(np.median([r.images_per_s for r in config])) for config in runs if config[0].system.startswith("nemo")), default=None)
    lines = [
        f"## HunyuanImage-3.0 t2i, {args.preset}: {args.layers} layers"
        f"{' at the released widths' if args.preset == 'h200' else ''}, {args.size}x{args.size}, "
        f"{args.steps} steps, CFG {GUIDANCE}, {args.requests} requests",
        "",
        f"{platform.node()}, {args.device}, {args.dtype}; matmul ceiling {ceiling / 1e12:.1f} TFLOP/s; weights {weights_gib:.1f} GiB; "
        f"model FLOPs per image {flops.model() / 1e12:.1f} TFLOP; repeats {args.repeats}",
        "",
        "| system | concurrency | images/s (min-max) | vs reference | p50 latency (s) | MFU | HFU | peak GPU memory (GiB) | PSNR vs reference (dB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config in runs:
        rates = [r.images_per_s for r in config]
        rate = float(np.median(rates))
        executed = flops.reference() if config[0].system.startswith("nemo") else flops.omni()
        key = f"{config[0].system} c{config[0].concurrency}"
        quality = f"{min(psnrs[key]):.1f}" if psnrs.get(key) else "-"
        lines.append(
            f"| {config[0].system} | {config[0].concurrency} | {rate:.4f} ({min(rates):.4f}-{max(rates):.4f}) | "
            f"{f'{rate / base:.2f}x' if base else '-'} | {np.median([np.median(r.latencies_s) for r in config]):.2f} | "
            f"{rate * flops.model() / ceiling:.1%} | {rate * executed / ceiling:.1%} | "
            f"{max(r.peak_mib for r in config) / 1024:.1f} | {quality} |"
        )
    if args.quantization:
        lines += ["", f"Rows with {args.quantization}: MFU and HFU credit the same FLOPs against the same {args.dtype} "
                  f"ceiling (quantized GEMMs can run above it); the PSNR says what the precision change costs."]
    return "\n".join([*lines, *([""] if notes else []), *notes]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tiny", "h200"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the h200 preset (the release has 32)")
    parser.add_argument("--size", type=int, default=None, help="square image side (default: the checkpoint's base size)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--requests", type=int, default=4, help="requests per configuration (and Omni's concurrency)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="Omni's dit stage with compile: true; the reference is then also run with its blocks compiled")
    parser.add_argument("--quantization", choices=("fp8", "int8"), default=None,
                        help="then Omni again at concurrency --requests with the dit stage's quantization option")
    parser.add_argument("--skip-eager-reference", action="store_true",
                        help="with --compile: time the reference compiled only (PSNR then against its images)")
    parser.add_argument("--skip-c1", action="store_true", help="time Omni at concurrency N only")
    parser.add_argument("--skip-reference", action="store_true",
                        help="time Omni only (no ratio, no PSNR: for a breakdown when device time is short)")
    parser.add_argument("--breakdown", action="store_true",
                        help="then one more batch at concurrency N, the GPU drained after every step (`Omni.breakdown`)")
    parser.add_argument("--expert-gemms", default="per_expert",
                        help="comma-separated `LayerKernels.expert_gemms` values: Omni is timed with each, on the same "
                             "loaded stage (at concurrency 1 with the first only)")
    parser.add_argument("--row-gathers", default="scatter",
                        help="comma-separated ways to take the experts' input rows (`Omni.row_gather`), each timed "
                             "after each --expert-gemms value (at concurrency 1 with the first pair only)")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/omni-bench-hunyuan"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()
    if args.skip_eager_reference and not args.compile:
        parser.error("--skip-eager-reference needs --compile (else no reference is timed)")

    import torch
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.prompt import t2i_rows
    from omni_hunyuan.tokens import SpecialTokens
    from transformers import AutoTokenizer

    began = time.perf_counter()
    model = checkpoint(args.scratch, args.preset, args.layers, args.device)
    if args.preset == "tiny":
        args.layers = 2
    print(f"checkpoint {model} ready in {time.perf_counter() - began:.0f} s", flush=True)
    stamp = time.perf_counter()
    config = HunyuanConfig.from_pretrained(model)
    args.size = args.size or config.image_base_size
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokens = SpecialTokens.from_tokenizer(tokenizer, config.image_base_size)
    side = args.size // config.vae_downsample
    prefix = int(np.mean([t2i_rows(tokenizer, tokens, p, 0, side, side, cfg=True).prefix.shape[1] for p in PROMPTS[: args.requests]]))
    flops = Flops(config, prefix, side, args.steps)
    ceiling = matmul_ceiling(args.device, args.dtype, 8192 if args.device.startswith("cuda") else 1024)
    weights_gib = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30
    memory = PeakMemory(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"hunyuan-image3-{args.preset}.md"

    runs: list[list[Run]] = []
    psnrs: dict[str, list[float]] = {}
    notes: list[str] = []

    def record(config: list[Run] | None) -> None:
        """Adds `config` (if any) and writes the tables so far (and the notes)."""
        if config is not None:
            runs.append(config)
        text = report(args, runs, flops, ceiling, weights_gib, psnrs, notes)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(
            [{"system": c[0].system, "concurrency": c[0].concurrency, "images_per_s": [r.images_per_s for r in c],
              "latencies_s": [r.latencies_s for r in c], "peak_mib": [r.peak_mib for r in c]} for c in runs], indent=1))
        print(text, flush=True)

    expected = None  # the eager reference's images (the compiled one's with --skip-eager-reference)
    if not args.skip_reference:  # (else no reference: no ratio, no PSNR)
        reference = Reference(model, args.device, args.dtype)
        print(f"reference loaded in {time.perf_counter() - stamp:.0f} s", flush=True)
        reference.run(1, args.size, 2, memory)  # warm-up: kernels, allocator
        if not args.skip_eager_reference:
            ref_runs = [reference.run(args.requests, args.size, args.steps, memory) for _ in range(args.repeats)]
            expected = ref_runs[0].images
            record(ref_runs)
        if args.compile:
            stamp = time.perf_counter()
            reference.compile()
            reference.run(args.requests, args.size, 2, memory)  # compiles (each prompt length: its sequence length)
            print(f"reference compiled in {time.perf_counter() - stamp:.0f} s", flush=True)
            config = [reference.run(args.requests, args.size, args.steps, memory) for _ in range(args.repeats)]
            if expected is None:
                expected = config[0].images
            else:
                psnrs[f"{reference.system} c1"] = [psnr(a, b) for run in config for a, b in zip(run.images, expected)]
            record(config)
        reference.close()
        del reference
        gc.collect()
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None

    stamp = time.perf_counter()
    omni = Omni(model, args.device, args.dtype, args.requests, args.compile)
    print(f"omni loaded in {time.perf_counter() - stamp:.0f} s", flush=True)
    system = omni.system
    variants = [(gemms, gather) for gemms in args.expert_gemms.split(",") for gather in args.row_gathers.split(",")]
    for number, (gemms, gather) in enumerate(variants):
        omni.system = ", ".join(part for part in (system, omni.expert_gemms(gemms), omni.row_gather(gather)) if part)
        for concurrency in (args.requests,) if args.skip_c1 or number else (1, args.requests):
            stamp = time.perf_counter()
            omni.run(concurrency, concurrency, args.size, 2, memory)  # warm-up (compiles each batch shape)
            print(f"{omni.system} c{concurrency} warm in {time.perf_counter() - stamp:.0f} s", flush=True)
            config = [omni.run(concurrency, args.requests, args.size, args.steps, memory) for _ in range(args.repeats)]
            psnrs[f"{omni.system} c{concurrency}"] = [psnr(a, b) for run in config for a, b in zip(run.images, expected or [])]
            record(config)
            if args.breakdown and concurrency == args.requests and not number:
                notes.append(omni.breakdown(concurrency, args.size, args.steps))
                record(None)
    omni.close()
    if args.quantization:
        # The dit stage's `quantization` option, at concurrency N only (a precision change: PSNR says how much).
        del omni
        gc.collect()
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
        stamp = time.perf_counter()
        omni = Omni(model, args.device, args.dtype, args.requests, args.compile, args.quantization)
        omni.run(args.requests, args.requests, args.size, 2, memory)
        print(f"omni {args.quantization} loaded and warm in {time.perf_counter() - stamp:.0f} s", flush=True)
        config = [omni.run(args.requests, args.requests, args.size, args.steps, memory) for _ in range(args.repeats)]
        psnrs[f"{omni.system} c{args.requests}"] = [psnr(a, b) for run in config for a, b in zip(run.images, expected or [])]
        record(config)
        omni.close()


if __name__ == "__main__":
    main()
