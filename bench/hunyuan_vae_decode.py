"""HunyuanImage-3.0's VAE decode of one 1024x1024 image (the release's 3-D decoder, `omni_hunyuan.vae`), by
how its GroupNorms and convolutions run and whether the decoder is compiled, on random weights at the
benchmark's VAE widths.

    OMNI_BENCH=hunyuan_vae_decode bash bench/gpu/run.sh h200 [--compile]   # CUDA
    python bench/hunyuan_vae_decode.py --preset tiny                      # CPU smoke test (64x64)

Each variant decodes the same scaled latents through `decode_latents` (fp32 weights, fp16 autocast on
CUDA, as the release decodes): the library's GroupNorm kernel and plain 3-D convolutions (the release's
ops: the reference's decode, `use_release_ops`); Omni's `GroupNorm` (statistics by ``torch.var_mean``
on CUDA) with plain convolutions; and Omni's decoder as served, whose `FrameConv3d`s skip the products
with the time padding; with ``--compile``, each again with the decoder under ``torch.compile`` (whole
module; a fair baseline's best setting), and Omni's compiled with channels-last weights. The table
gives ms per image (best of ``--repeats``), the first call's seconds (a compiled decoder compiles
there), the largest 8-bit difference from the first variant's image, and the share of values that
differ. (2026-12-07's first run also timed channels-last weights eager and cuDNN's algorithm search:
`bench/results/hunyuan-vae-decode-h100.md`.)
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

import torch
from diffusion import timed

WIDTHS = {"h200": [128, 256, 512, 1024, 1024], "tiny": [32, 32, 64, 64, 64]}
SIDES = {"h200": 1024, "tiny": 64}


def main() -> None:
    from omni_hunyuan.vae import FrameConv3d, build_vae, decode_latents, use_release_ops

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(WIDTHS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")  # (run.sh passes it; the VAE runs as the release runs it)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also each variant with the decoder under torch.compile")
    parser.add_argument("--profile", action="store_true", help="also the kernels of one decode of each eager variant (torch.profiler)")
    args = parser.parse_args()
    section = {"latent_channels": 32, "block_out_channels": WIDTHS[args.preset], "layers_per_block": 2,
               "ffactor_spatial": 16, "ffactor_temporal": 4, "scaling_factor": 0.562679178327931}
    torch.manual_seed(0)
    with torch.device(args.device):
        decoder = build_vae(section, parts=("decoder",)).decoder.eval()
    side = SIDES[args.preset] // 16
    latents = torch.randn(1, 32, side, side, generator=torch.Generator().manual_seed(1)).to(args.device)
    cuda = args.device.startswith("cuda")
    plain = copy.deepcopy(decoder)
    for conv in plain.modules():
        if isinstance(conv, FrameConv3d):
            conv.by_frames = False
    variants = [("library GroupNorm, plain convolutions (the release's ops; the reference)", use_release_ops(copy.deepcopy(decoder))),
                ("GroupNorm by reduction, plain convolutions", plain),
                ("GroupNorm by reduction, FrameConv3d (Omni)", decoder)]
    if args.compile:
        for name, module in list(variants):
            compiled = copy.deepcopy(module)
            compiled.compile()
            variants.append((f"{name}, compiled", compiled))
        # Omni's, its weights channels-last (cuDNN's NHWC kernels then take and give NHWC tensors: no
        # transposes around each convolution; eager, the layout cost 1.5x on 2026-12-07)
        compiled = copy.deepcopy(decoder).to(memory_format=torch.channels_last_3d)
        compiled.compile()
        variants.append(("GroupNorm by reduction, FrameConv3d (Omni), channels-last weights, compiled", compiled))
    rows, first, profiles = [], None, []
    for name, module in variants:
        began = time.perf_counter()
        image = decode_latents(module, latents, section).int()  # (compiles a compiled one)
        warm = time.perf_counter() - began
        ms = timed(args.device, lambda: decode_latents(module, latents, section), args.repeats) * 1000
        first = image if first is None else first
        difference = (image - first).abs()
        rows.append(f"| {name} | {ms:.1f} | {warm:.1f} | {int(difference.max())} | {float((difference > 0).float().mean()):.5f} |")
        print(rows[-1], flush=True)
        if args.profile and not name.endswith("compiled"):
            from torch.profiler import ProfilerActivity, profile as record

            with record(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
                decode_latents(module, latents, section)
                if cuda:
                    torch.cuda.synchronize()
            key = "cuda_time_total" if cuda else "cpu_time_total"
            table = prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=70)
            profiles.append(f"\n{name}:\n```\n{table}```\n")
    profile = "".join(profiles)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    lines = [
        f"## HunyuanImage-3.0 VAE decode, {args.preset}: one {SIDES[args.preset]}x{SIDES[args.preset]} image, VAE widths {WIDTHS[args.preset]}",
        "", f"{name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}", "",
        "| variant | ms per image | first call (s) | max 8-bit difference | share of values that differ |", "|---|---:|---:|---:|---:|", *rows,
    ]
    text = "\n".join(lines) + "\n" + profile
    print(text)
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hunyuan-vae-decode-{args.preset}.md").write_text(text)


if __name__ == "__main__":
    main()
