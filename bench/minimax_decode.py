"""Where MiniMax-H3's decode time goes (not a test): the video and audio VAEs at the released widths.

    python bench/minimax_decode.py --preset tiny                       # CPU smoke test
    OMNI_BENCH=minimax_decode bash bench/gpu/run.sh h200               # the H200

Builds diffusers' `AutoencoderKLMiniMaxH3` and `AutoencoderKLMiniMaxH3Audio` with their default
(released) configs and random weights, in the dtype layout `from_pretrained(torch_dtype=...)` gives
(the classes' ``_keep_in_fp32_modules`` stay fp32), and times, for one request of ``--frames`` frames
at ``--size``: the whole video decode (the library's clips and spatial tiles, one decoder call per
tile) for 1 and for ``--batch`` requests in one call, one tile's decoder call alone and the tiles of
one clip in one call, and the audio decode. Tables to stdout and ``$OUT/minimax-decode-<preset>.md``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from diffusion import timed


def fp32_where_kept(model: Any, dtype: Any) -> Any:
    """`dtype` everywhere except the parameters `_keep_in_fp32_modules` names (as diffusers loads them)."""
    import torch

    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, param in model.named_parameters():
        param.data = param.data.to(torch.float32 if keep & set(name.split(".")) else dtype)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tiny", "h200"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--size", default="832x480")
    parser.add_argument("--frames", type=int, default=124)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()

    import torch
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    dtype, device = getattr(torch, args.dtype), args.device
    width, height = (int(v) for v in args.size.split("x"))
    if args.preset == "tiny":
        from omni_minimax_h3.tiny import SPECS, audio_vae_config, vae_config

        video_config, audio_config = vae_config(SPECS["tiny"]), audio_vae_config(SPECS["tiny"])
    else:
        video_config, audio_config = {}, {}
    with torch.device(device):
        vae = fp32_where_kept(AutoencoderKLMiniMaxH3(**video_config), dtype).eval()
        audio = fp32_where_kept(AutoencoderKLMiniMaxH3Audio(**audio_config), dtype).eval()
    spatial = vae.spatial_compression_ratio
    latent_frames = (args.frames - 5) // 17 * 5 + 2
    z = torch.randn(1, vae.config.latent_channels, latent_frames, height // spatial, width // spatial, device=device)
    audio_frames = round(args.frames / 24 * audio.config.sampling_rate / audio.hop_length)
    audio_z = torch.randn(2, audio.config.latent_channels, audio_frames, device=device)

    clip = z[:, :, : vae.tokens_chunk_size + vae.token_overlap]
    tile = clip[..., : vae.tile_sample_min_height // spatial, : vae.tile_sample_min_width // spatial]
    tiles = len(vae._split_tiles(height, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height)[0]) * len(
        vae._split_tiles(width, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width)[0])
    rows: list[tuple[str, float]] = []
    with torch.no_grad():
        one = timed(device, lambda: vae.decode(z), args.repeats)
        rows.append(("video decode, 1 request", one))
        batch = timed(device, lambda: vae.decode(z.expand(args.batch, -1, -1, -1, -1)), 1)
        rows.append((f"video decode, {args.batch} requests in one call (per request)", batch / args.batch))
        single = timed(device, lambda: vae.decoder(vae.post_quant_conv(tile.to(vae.post_quant_conv.weight.dtype))), args.repeats)
        rows.append((f"one tile's decoder call ({tuple(tile.shape[2:])} latents)", single))
        stacked = tile.expand(tiles, -1, -1, -1, -1).to(vae.post_quant_conv.weight.dtype)
        together = timed(device, lambda: vae.decoder(vae.post_quant_conv(stacked)), args.repeats)
        rows.append((f"{tiles} tiles in one decoder call (per tile)", together / tiles))
        rows.append(("audio decode, 1 request (2 channels)", timed(device, lambda: audio.decode(audio_z), args.repeats)))
        rows.append((f"audio decode, {args.batch} requests in one call (per request)",
                     timed(device, lambda: audio.decode(audio_z.repeat(args.batch, 1, 1)), 1) / args.batch))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
    lines = [
        f"## MiniMax-H3 decode, {args.preset}: {width}x{height}, {args.frames} frames ({latent_frames} latent), {device}, {args.dtype}",
        "",
        f"video VAE {sum(p.numel() for p in vae.parameters()) / 1e9:.2f}B parameters (decoder "
        f"{sum(p.numel() for p in vae.decoder.parameters()) / 1e9:.2f}B), audio VAE {sum(p.numel() for p in audio.parameters()) / 1e9:.2f}B; "
        f"peak memory {peak:.1f} GiB",
        "",
        "| what | s |",
        "|---|---:|",
        *(f"| {name} | {seconds:.3f} |" for name, seconds in rows),
    ]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"minimax-decode-{args.preset}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
