"""MiniMax-H3: can one request's VAE decode run beside the next request's denoising on one GPU?

    python bench/minimax_overlap.py --preset tiny                          # CPU smoke test
    OMNI_BENCH=minimax_overlap bash bench/gpu/run.sh h200                  # the device machine

Under a token budget (`max_batch_tokens` of one request's rows) the dit stage denoises requests one
after another and decodes each as it finishes, between two denoising steps of the next. This
measures what running that decode on a second CUDA stream, from a second thread, while the next
request denoises, would give: one DiT block at the released widths (``--blocks`` x ``--steps`` calls
on one 480p request's 14,851 rows stand for its 19 forwards through 4 blocks) and the video
VAE's decode of one 480p, 124-frame request (diffusers' `AutoencoderKLMiniMaxH3`, released config,
random weights, in the dtype layout `from_pretrained` gives), each alone and both at once, with the
denoising stream at the default and at a high priority. ``hidden`` is the share of the decode's
time that running it beside the denoising saved. Tables to stdout and ``$OUT/minimax-overlap-<preset>.md``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from diffusion import synchronize
from minimax_block_memory import RELEASED
from minimax_decode import fp32_where_kept


def both(device: Any, dit: Callable[[], Any], decode: Callable[[], Any], priority: int) -> float:
    """Wall seconds of `decode` on a side stream in a thread while `dit` runs on a stream of `priority`."""
    import torch

    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None
    main = torch.cuda.Stream(device, priority=priority) if cuda else None
    failed: list[BaseException] = []

    def work() -> None:
        try:
            with torch.inference_mode():
                if side is None:
                    decode()
                    return
                with torch.cuda.stream(side):
                    decode()
                side.synchronize()
        except BaseException as exc:  # (reported by the caller)
            failed.append(exc)

    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    thread = threading.Thread(target=work)
    thread.start()
    if main is None:
        dit()
    else:
        with torch.cuda.stream(main):
            dit()
        main.synchronize()
    thread.join()
    if failed:
        raise failed[0]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tiny", "h200"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--blocks", type=int, default=4, help="DiT blocks a request's forwards go through")
    parser.add_argument("--steps", type=int, default=19, help="transformer forwards of a request")
    parser.add_argument("--rows", type=int, default=14851, help="rows of one request (832x480, 124 frames)")
    parser.add_argument("--size", default="832x480")
    parser.add_argument("--frames", type=int, default=124)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()

    import torch
    from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Transformer3DModel
    from omni_minimax_h3.packed import Segments, run_block, use_segmented_attention

    torch.manual_seed(0)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    width, height = (int(v) for v in args.size.split("x"))
    if args.preset == "tiny":
        from omni_minimax_h3.tiny import SPECS, vae_config

        scale, video_config, args.rows = 1 / 28, vae_config(SPECS["tiny"]), min(args.rows, 512)
    else:
        scale, video_config = 1.0, {}
    heads = max(1, round(RELEASED["num_attention_heads"] * scale))
    hidden = round(RELEASED["hidden_size"] * scale / 64) * 64
    with torch.device(device):
        model = MiniMaxH3Transformer3DModel(
            num_layers=1, num_refiner_layers=1, num_attention_heads=heads, attention_head_dim=128, hidden_size=hidden,
            ffn_dim=round(RELEASED["ffn_dim"] * scale / 64) * 64, text_dim=64, time_embed_hidden_dim=hidden, time_embed_dim=hidden // 2,
        ).eval().to(dtype)
        vae = fp32_where_kept(AutoencoderKLMiniMaxH3(**video_config), dtype).eval()
    use_segmented_attention(model)
    block = model.transformer_blocks[0]
    spatial = vae.spatial_compression_ratio
    latent_frames = (args.frames - 5) // 17 * 5 + 2
    if args.preset == "tiny":
        height, width, latent_frames = 4 * spatial, 4 * spatial, 7
    z = torch.randn(1, vae.config.latent_channels, latent_frames, height // spatial, width // spatial, device=device)
    calls = args.blocks * args.steps
    with torch.inference_mode():
        rotary = model.rope(torch.zeros(args.rows, 3, device=device))
        temb = model.time_embedder(model.time_proj(torch.tensor([500.0], device=device)).to(dtype))
        x = torch.randn(1, args.rows, hidden, device=device, dtype=dtype)
        adaln = torch.zeros(args.rows, dtype=torch.long, device=device)
        rows = Segments.of_lengths([args.rows])

        def dit() -> None:
            with torch.inference_mode():
                for _ in range(calls):
                    run_block(block, x, temb, adaln, rotary, rows)

        def decode() -> None:
            vae.decode(z)

        def alone(fn: Callable[[], Any]) -> float:
            synchronize(args.device)
            start = time.perf_counter()
            fn()
            synchronize(args.device)
            return time.perf_counter() - start

        dit(), decode()  # warm-up
        results: dict[str, list[float]] = {"denoising alone": [], "decode alone": [], "both, one after the other": []}
        concurrent = {"both at once (default priorities)": 0, "both at once (denoising stream at high priority)": -1}
        results.update({label: [] for label in concurrent})
        for _ in range(args.repeats):
            a, b = alone(dit), alone(decode)
            results["denoising alone"].append(a)
            results["decode alone"].append(b)
            results["both, one after the other"].append(a + b)
            for label, priority in concurrent.items():
                results[label].append(both(device, dit, decode, priority))
    sequential = min(results["both, one after the other"])
    decode_s = min(results["decode alone"])
    lines = [
        f"## MiniMax-H3: decode beside denoising, {args.preset}: {device}, {args.dtype}, hidden {hidden} ({heads} heads), "
        f"{calls} block calls on {args.rows} rows, video decode of {latent_frames} latent frames at {width}x{height}",
        "",
        f"Best of {args.repeats} after a warm-up. `hidden`: the share of the decode's time saved against one after the other.",
        "",
        "| what | s | hidden |",
        "|---|---:|---:|",
    ]
    for label, values in results.items():
        best = min(values)
        share = f"{(sequential - best) / decode_s:.0%}" if label.startswith("both at once") else ""
        lines.append(f"| {label} | {best:.3f} | {share} |")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"minimax-overlap-{args.preset}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
