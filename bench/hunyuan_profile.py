"""Where one HunyuanImage-3.0 denoising forward spends its time (not a test): the transformer alone.

    python bench/hunyuan_profile.py --preset tiny                                   # CPU smoke test
    OMNI_BENCH=hunyuan_profile bash bench/gpu/run.sh h200 --layers 2                # the H200

Builds `omni_hunyuan.transformer.HunyuanImage3` at the released widths (``bench/hunyuan_image3.py``'s
``RELEASE``; preset ``tiny``: the tiny checkpoint's) with ``--layers`` layers of random weights, in
memory (no checkpoint), experts grouped as the ``dit`` stage runs them on CUDA. Then, for
``--requests`` requests with CFG (2 rows each) at ``--side`` x ``--side`` latent tokens after a
text prefix of ``--prefix``, ``--prefix`` + 2, ... tokens (one length per request): the forward's time and MFU (credited FLOPs as `bench/hunyuan_image3.py`
counts them), each part's time alone on the same shapes (attention with the padding mask, and
without any, the MoE, the projections), and the kernels that took the most device time
(`torch.profiler`; of the compiled forward with ``--compile``, quantized with ``--quantization``); the MoE
and the compiled forward with one grouped GEMM a projection instead of one matmul per expert, and the
MoE with each expert's up, SwiGLU and down back to back, whole and 2048 rows at a time (where the
experts are grouped: CUDA, bf16); the VAE decode (the release's 3-D decoder, as the dit stage and the reference
run it), one image and a batch's images. Tables to stdout and ``$OUT/hunyuan-profile-<preset>.md``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from diffusion import matmul_ceiling, synchronize, timed
from hunyuan_image3 import RELEASE, Flops, expert_kernels

TINY = {**RELEASE, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "attention_head_dim": 32,
        "num_experts": 4, "moe_topk": 2, "moe_intermediate_size": 32, "patch_embed_hidden_dim": 32, "image_base_size": 64}


def build(spec: dict[str, Any], layers: int, device: str, dtype: Any) -> Any:
    import torch
    from omni_hunyuan import tiny
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.transformer import HunyuanImage3

    tokenizer = tiny.tiny_tokenizer(spec["tokenizer_vocab"], spec["image_base_size"])
    config = HunyuanConfig.from_dict(tiny.release_config({**spec, "num_hidden_layers": layers}, -(-len(tokenizer) // 64) * 64, tokenizer))
    with torch.device(device):
        model = HunyuanImage3(config)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
            param.data = param.data.to(torch.float32 if ".mlp.gate." in name else dtype)
    if device.startswith("cuda") and dtype == torch.bfloat16:
        for layer in model.model.layers:
            layer.mlp.group_experts()
    return model.eval()


def with_gemms(model: Any, how: str, device: str, run: Any, repeats: int) -> float | None:
    """`run`'s time with the denoising forward's grouped experts multiplied `how` (`LayerKernels.expert_gemms`:
    ``grouped``, one grouped GEMM a projection; ``per_expert``, one matmul an expert; ``interleaved[:R]``,
    each expert's up, SwiGLU and down back to back, R rows at a time), then back; None where they are
    not grouped."""
    if not any(layer.mlp.grouped for layer in model.model.layers):
        return None
    kernels = model.kernels
    model.kernels = expert_kernels(kernels, how)
    try:
        return timed(device, run, repeats)
    finally:
        model.kernels = kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tiny", "h200"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--side", type=int, default=None, help="latent tokens per side (default: base size / 16)")
    parser.add_argument("--prefix", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also time the forward with compiled layer pieces (`compile_layers`), and profile that")
    parser.add_argument("--quantization", choices=("fp8", "int8"), default=None,
                        help="then quantize the layers as the dit stage's option does, time the forward again and profile that")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, args.dtype)
    spec = RELEASE if args.preset == "h200" else TINY
    model = build(spec, args.layers, args.device, dtype)
    config = model.config
    side = args.side or config.image_base_size // config.vae_downsample
    rows = 2 * args.requests
    device = args.device
    from omni_hunyuan.transformer import PrefixCache

    lengths = [args.prefix + 2 * i for i in range(args.requests)]  # prompts of different lengths, as served
    with torch.no_grad():
        cache = PrefixCache.concat([model.encode_prefix(torch.randint(0, config.vocab_size, (2, n), device=device)) for n in lengths])
        # One latent and timestep per request, embedded once for its two rows (as the dit stage runs it).
        latents = torch.randn(args.requests, config.latent_channels, side, side, device=device, dtype=dtype)
        timestep = torch.full((args.requests,), 500.0, device=device)
        repeats = [2] * args.requests

        def velocity() -> Any:
            return model.velocity(cache, latents, timestep, repeats=repeats)

        forward = timed(device, velocity, args.repeats)
        compiled = difference = compiled_grouped = None
        if args.compile:
            eager = velocity().float()
            model.compile_layers()
            compiled = timed(device, velocity, args.repeats)
            difference = float((velocity().float() - eager).abs().max() / eager.abs().max())
            compiled_grouped = with_gemms(model, "grouped", device, velocity, args.repeats)

        # The parts alone, on one layer's shapes.
        tokens = 1 + side * side
        layer = model.model.layers[0]
        hidden = torch.randn(rows, tokens, config.hidden_size, device=device, dtype=dtype)
        q = torch.randn(rows, config.num_heads, tokens, config.head_dim, device=device, dtype=dtype)
        from omni_hunyuan.layers import ImageRowsMask

        padded = max(lengths)
        k = torch.randn(rows, config.num_kv_heads, padded + tokens, config.head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        keys = torch.arange(padded + tokens, device=device)
        real = keys[None] >= padded - torch.tensor(lengths, device=device).repeat_interleave(2)[:, None]  # (prefixes end at `padded`)
        mask = real[:, None, None, :].expand(rows, 1, tokens, padded + tokens).clone()
        mask[:, :, 0, padded + 1 :] = False  # <timestep> does not see the image
        layout = ImageRowsMask(tuple(n for n in lengths for _ in range(2)), padded)
        past = (k[:, :, :padded], v[:, :, :padded])
        new_k, new_v = k[:, :, padded:].contiguous(), v[:, :, padded:].contiguous()
        parts = {
            "attention, a dense boolean mask (before)": timed(device, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), args.repeats),
            "attention, ImageRowsMask (as run)": timed(device, lambda: layout.attend(q, new_k, new_v, past), args.repeats),
            "attention, one unmasked call": timed(device, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), args.repeats),
            "MoE (router, experts, shared)": timed(device, lambda: layer.mlp(hidden), args.repeats),
            "MoE, one matmul per expert (the host waits for the bounds)": with_gemms(model, "per_expert", device, lambda: layer.mlp(hidden, model.kernels), args.repeats),
            "MoE, each expert's up, SwiGLU and down back to back": with_gemms(model, "interleaved", device, lambda: layer.mlp(hidden, model.kernels), args.repeats),
            "MoE, back to back, 2048 rows at a time": with_gemms(model, "interleaved:2048", device, lambda: layer.mlp(hidden, model.kernels), args.repeats),
            "UNet embedder (once per request) and head (per row), one forward": timed(device, lambda: model.final_layer(
                model.patch_embed(latents, model.time_embed(timestep).to(dtype)).repeat_interleave(2, dim=0),
                model.time_embed_2(timestep.repeat_interleave(2)).to(dtype), side, side), args.repeats),
            "qkv + o projections": timed(device, lambda: layer.self_attn.o_proj(layer.self_attn.qkv_proj(hidden)[..., : config.num_heads * config.head_dim]), args.repeats),
        }
        for name, seconds in parts.items():  # (as they come: a call cut short still reports them)
            print(f"{name}: {'-' if seconds is None else f'{seconds * 1e3:.2f} ms'}", flush=True)
        quantized = quantized_moe = None
        if args.quantization:
            # The dit stage's `quantization` (`omni_hunyuan.quantized.quantize_layers`), on the same shapes.
            from omni_core import quantization
            from omni_hunyuan.quantized import quantize_layers

            before = velocity().float()
            quantize_layers(model, getattr(quantization, f"resolve_{args.quantization}")("diffusion", {}))
            quantized = timed(device, velocity, args.repeats)
            difference_q = float((velocity().float() - before).abs().max() / before.abs().max())
            quantized_moe = timed(device, lambda: layer.mlp(hidden), args.repeats)
        # The VAE decode after the last step (fp32 weights, under fp16 autocast on CUDA), as the dit stage
        # and the reference pipeline both run it (`omni_hunyuan.vae.decode_latents`): one image, and all
        # the requests' images (one decoder call each).
        from omni_hunyuan.vae import build_vae, decode_latents

        with torch.device(device):
            decoder = build_vae(config.vae, parts=("decoder",)).float().eval().decoder
        image_latent, image_latents = latents[:1].float(), latents.float()
        vae_repeats = max(1, args.repeats // 2)
        parts["VAE decode, one image, after the last step"] = timed(
            device, lambda: decode_latents(decoder, image_latent, config.vae), vae_repeats)
        parts[f"VAE decode, {args.requests} images, per image, after the last step"] = timed(
            device, lambda: decode_latents(decoder, image_latents, config.vae), vae_repeats) / args.requests
        decoder = None  # (freed before the profile)

        profile = ""
        if device.startswith("cuda"):
            from torch.profiler import ProfilerActivity, profile as record

            with record(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    velocity()
                synchronize(device)
            profile = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)

    flops = Flops(config, args.prefix, side, 1, rows)
    ceiling = matmul_ceiling(device, args.dtype, 8192 if device.startswith("cuda") else 512)
    lines = [
        f"## HunyuanImage-3.0 denoising forward, {args.preset}: {args.layers} layers, {args.requests} requests x 2 rows, "
        f"{side}x{side} latent tokens, prefixes {lengths}",
        "",
        f"{device}, {args.dtype}; matmul ceiling {ceiling / 1e12:.1f} TFLOP/s",
        "",
        "| what | ms | share of the forward's layer time |",
        "|---|---:|---:|",
        f"| forward (all layers, UNet in and out) | {forward * 1e3:.2f} | MFU {flops.model() / forward / ceiling:.1%} |",
    ]
    if compiled is not None:
        lines.append(f"| forward, compiled layer pieces ({model.kernels.expert_gemms} experts, as served) | {compiled * 1e3:.2f} | "
                     f"MFU {flops.model() / compiled / ceiling:.1%} (max diff / max: {difference:.1e}) |")
    if compiled_grouped is not None:
        lines.append(f"| forward, compiled layer pieces, one grouped GEMM a projection | {compiled_grouped * 1e3:.2f} | "
                     f"MFU {flops.model() / compiled_grouped / ceiling:.1%} |")
    if quantized is not None:
        lines.append(f"| forward, {args.quantization}{', compiled layer pieces' if compiled is not None else ''} | "
                     f"{quantized * 1e3:.2f} | credited FLOPs / time / the {args.dtype} ceiling {flops.model() / quantized / ceiling:.1%} "
                     f"(max diff / max vs unquantized: {difference_q:.1e}) |")
        lines.append(f"| MoE (router, experts, shared), {args.quantization}, one layer | {quantized_moe * 1e3:.2f} | "
                     f"{quantized_moe / (quantized / args.layers):.1%} |")
    per_layer = forward / args.layers
    for name, seconds in parts.items():
        if seconds is None:  # (per expert: the experts are not grouped here)
            continue
        if name.endswith("after the last step"):
            lines.append(f"| {name} | {seconds * 1e3:.2f} | {seconds / forward:.2f} forwards |")
        elif name.endswith("one forward"):
            lines.append(f"| {name} | {seconds * 1e3:.2f} | {seconds / forward:.1%} of the forward |")
        else:
            lines.append(f"| {name}, one layer | {seconds * 1e3:.2f} | {seconds / per_layer:.1%} |")
    text = "\n".join(lines) + ("\n\n```\n" + profile + "\n```\n" if profile else "\n")
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"hunyuan-profile-{args.preset}.md").write_text(text)


if __name__ == "__main__":
    main()
