"""HunyuanImage-3.0's VAE decode of one 1024x1024 image (the release's 3-D decoder, `omni_hunyuan.vae`), by
memory layout and cuDNN algorithm choice, on random weights at the benchmark's VAE widths.

    OMNI_BENCH=hunyuan_vae_decode bash bench/gpu/run.sh h200      # CUDA
    python bench/hunyuan_vae_decode.py --preset tiny                # CPU smoke test (64x64)

Each variant decodes the same scaled latents through `decode_latents` (fp32 weights, fp16 autocast on
CUDA, as the release decodes); the table gives ms per image (best of ``--repeats``), the largest 8-bit
difference from the first variant's image, and the share of values that differ.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from diffusion import timed

WIDTHS = {"h200": [128, 256, 512, 1024, 1024], "tiny": [32, 32, 64, 64, 64]}
SIDES = {"h200": 1024, "tiny": 64}


def channels_last(module: torch.nn.Module) -> None:
    """`module`'s 3-D convolutions with channels-last weights (in place): on CUDA, cuDNN then runs them, and
    so the activations, on its NDHWC kernels (as omni-cosmos3 lays out its VAE's)."""
    for conv in module.modules():
        if isinstance(conv, torch.nn.Conv3d):
            conv.to(memory_format=torch.channels_last_3d)


def main() -> None:
    from omni_hunyuan.vae import build_vae, decode_latents

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(WIDTHS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")  # (run.sh passes it; the VAE runs as the release runs it)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also the kernels of one contiguous decode (torch.profiler)")
    args = parser.parse_args()
    section = {"latent_channels": 32, "block_out_channels": WIDTHS[args.preset], "layers_per_block": 2,
               "ffactor_spatial": 16, "ffactor_temporal": 4, "scaling_factor": 0.562679178327931}
    torch.manual_seed(0)
    with torch.device(args.device):
        decoder = build_vae(section, parts=("decoder",)).decoder.eval()
    side = SIDES[args.preset] // 16
    latents = torch.randn(1, 32, side, side, generator=torch.Generator().manual_seed(1)).to(args.device)
    cuda = args.device.startswith("cuda")
    variants: list[tuple[str, bool, bool]] = [("contiguous (NCDHW)", False, False), ("channels_last_3d", True, False)]
    if cuda:
        variants += [("contiguous, cudnn.benchmark", False, True), ("channels_last_3d, cudnn.benchmark", True, True)]
    rows, first = [], None
    for name, last, search in variants:
        if cuda:
            torch.backends.cudnn.benchmark = search
        if last:
            channels_last(decoder)
        else:
            decoder.to(memory_format=torch.contiguous_format)
        image = decode_latents(decoder, latents, section).int()
        ms = timed(args.device, lambda: decode_latents(decoder, latents, section), args.repeats) * 1000
        first = image if first is None else first
        difference = (image - first).abs()
        rows.append(f"| {name} | {ms:.1f} | {int(difference.max())} | {float((difference > 0).float().mean()):.5f} |")
    profile = ""
    if args.profile:
        from torch.profiler import ProfilerActivity, profile as record

        if cuda:
            torch.backends.cudnn.benchmark = False
        decoder.to(memory_format=torch.contiguous_format)
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with record(activities=activities) as prof:
            decode_latents(decoder, latents, section)
            if cuda:
                torch.cuda.synchronize()
        key = "cuda_time_total" if cuda else "cpu_time_total"
        profile = "\n```\n" + prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=70) + "```\n"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    lines = [
        f"## HunyuanImage-3.0 VAE decode, {args.preset}: one {SIDES[args.preset]}x{SIDES[args.preset]} image, VAE widths {WIDTHS[args.preset]}",
        "", f"{name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}", "",
        "| variant | ms per image | max 8-bit difference | share of values that differ |", "|---|---:|---:|---:|", *rows,
    ]
    text = "\n".join(lines) + "\n" + profile
    print(text)
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hunyuan-vae-decode-{args.preset}.md").write_text(text)


if __name__ == "__main__":
    main()
