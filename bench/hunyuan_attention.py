"""HunyuanImage-3.0 denoising attention on one layer's shapes (8 rows: 4 requests x CFG, 32 heads, 8 KV
heads, 1 + 64x64 new tokens, prefixes of a few lengths), in the layouts tried for `ImageRowsMask`.

Baseline: the runs-with-cats layout the dit stage used before (each run of rows with one prefix length
concatenates its prefix and new keys, `torch.cat`). Against it: `ImageRowsMask.attend` as shipped (one
buffer per layer, the prefixes right-aligned, each run a view); the same runs on a buffer kept across
layers (only the new keys copied) and on a BSHD buffer (`ImageRowsMask.attend_buffers`); one unmasked
call (a lower bound: no padding); one call with a key-padding mask, boolean or additive, [B,1,1,K] or
expanded, under each SDPA backend. Times are the best of `--repeats` calls.

    OMNI_BENCH=hunyuan_attention bash bench/gpu/run.sh h200        (the GPU machine)
    python bench/hunyuan_attention.py --tokens 17                  (a CPU smoke test: 1 + 4x4 new tokens)
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from diffusion import timed

HEADS, KV_HEADS, DIM, ROWS = 32, 8, 128, 8
LENGTHS = ((70, 70, 74, 74, 81, 81, 90, 90), (52, 52, 52, 52, 60, 60, 60, 60), (60,) * 8)


def top_kernels(device: str, fn: Any, n: int = 4) -> str:
    """The `n` kernels of one call with the most GPU time (CUDA only)."""
    if not device.startswith("cuda"):
        return "-"
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:n]
    return "; ".join(f"{e.key[:60]} x{e.count} {e.device_time_total / 1e3:.2f}ms" for e in events)


def attention(lengths: tuple[int, ...], device: str, dtype: Any, tokens: int, repeats: int) -> list[str]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from omni_hunyuan.layers import ImageRowsMask

    padded, group = max(lengths), HEADS // KV_HEADS
    mask = ImageRowsMask(lengths, padded)
    runs = mask.runs()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    # The layouts the compiled qkv leaves: q and k [B, S, heads, D] transposed, v a view of the fused qkv.
    q = randn(ROWS, tokens, HEADS, DIM).transpose(1, 2)
    k = randn(ROWS, tokens, KV_HEADS, DIM).transpose(1, 2)
    v = randn(ROWS, tokens, KV_HEADS, group + 2, DIM)[:, :, :, group + 1].transpose(1, 2)
    # The prefixes right-aligned (as `PrefixCache.concat` pads them now), and left-aligned (before).
    right_k, right_v = randn(ROWS, KV_HEADS, padded, DIM), randn(ROWS, KV_HEADS, padded, DIM)
    left_k, left_v = torch.zeros_like(right_k), torch.zeros_like(right_v)
    for row, n in enumerate(lengths):
        right_k[row, :, : padded - n] = 0
        right_v[row, :, : padded - n] = 0
        left_k[row, :, :n] = right_k[row, :, padded - n :]
        left_v[row, :, :n] = right_v[row, :, padded - n :]

    def cats() -> torch.Tensor:
        """The layout before the buffer: each run concatenates its prefix and new keys."""
        out = q.new_empty(ROWS, tokens, HEADS, DIM).transpose(1, 2)
        for start, stop, length in runs:
            keys = torch.cat([left_k[start:stop, :, :length], k[start:stop]], dim=2)
            values = torch.cat([left_v[start:stop, :, :length], v[start:stop]], dim=2)
            part = F.scaled_dot_product_attention(q[start:stop], keys, values, enable_gqa=True)
            part[:, :, :1] = F.scaled_dot_product_attention(
                q[start:stop, :, :1], keys[:, :, : length + 1], values[:, :, : length + 1], enable_gqa=True
            )
            out[start:stop] = part
        return out

    kept = (q.new_empty(ROWS, KV_HEADS, padded + tokens, DIM), q.new_empty(ROWS, KV_HEADS, padded + tokens, DIM))
    for buffer, prefix in zip(kept, (right_k, right_v)):
        buffer[:, :, :padded] = prefix

    def kept_buffer() -> torch.Tensor:
        kept[0][:, :, padded:] = k
        kept[1][:, :, padded:] = v
        return mask.attend_buffers(q, *kept)

    def bshd_buffer() -> torch.Tensor:
        buffers = []
        for prefix, new in ((right_k, k), (right_v, v)):
            buffer = q.new_empty(ROWS, padded + tokens, KV_HEADS, DIM).transpose(1, 2)
            buffer[:, :, :padded] = prefix
            buffer[:, :, padded:] = new
            buffers.append(buffer)
        return mask.attend_buffers(q, *buffers)

    whole_k, whole_v = randn(ROWS, KV_HEADS, padded + tokens, DIM), randn(ROWS, KV_HEADS, padded + tokens, DIM)
    real = (torch.arange(padded + tokens, device=device)[None] >= padded - torch.tensor(lengths, device=device)[:, None])[:, None, None]
    bias = torch.zeros(real.shape, device=device, dtype=dtype).masked_fill(~real, float("-inf"))
    variants: dict[str, Any] = {
        "runs with cats (before)": cats,
        "one buffer a layer, `ImageRowsMask.attend` (as shipped)": lambda: mask.attend(q, k, v, (right_k, right_v)),
        "a buffer kept across layers (the new keys copied only)": kept_buffer,
        "a BSHD buffer a layer": bshd_buffer,
        "one unmasked call (no padding: a lower bound)": lambda: F.scaled_dot_product_attention(q, whole_k, whole_v, enable_gqa=True),
    }
    for name, attn_mask in (("boolean [B,1,1,K]", real), ("additive [B,1,1,K]", bias), ("boolean expanded [B,1,N,K]", real.expand(-1, -1, tokens, -1))):
        for backend in (None, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            def masked(attn_mask: Any = attn_mask, backend: Any = backend) -> torch.Tensor:
                with sdpa_kernel([backend]) if backend else contextlib.nullcontext():
                    return F.scaled_dot_product_attention(q, whole_k, whole_v, attn_mask=attn_mask, enable_gqa=True)
            variants[f"one call, {name} mask, {backend.name if backend else 'default'} backend"] = masked

    want = cats().float()
    differences = [float((variant().float() - want).abs().max()) for variant in (variants[name] for name in list(variants)[1:4])]
    lines = [f"### prefixes {lengths} ({len(runs)} runs), {tokens} new tokens; the buffers against the cats, max diff: "
             + " / ".join(f"{d:.1e}" for d in differences), "",
             "| layout | ms | vs the runs with cats | top kernels |", "|---|---:|---:|---|"]
    base = None
    for name, fn in variants.items():
        try:
            ms = timed(device, fn, repeats) * 1e3
        except RuntimeError as exc:  # (a backend that takes no such mask: SDPA says so)
            lines.append(f"| {name} | - | - | {str(exc).splitlines()[0][:120]} |")
            continue
        base = base or ms
        lines.append(f"| {name} | {ms:.3f} | {ms / base:.2f}x | {top_kernels(device, fn)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--preset", default="h200", help="(taken for bench/gpu/run.sh; the shapes are the release's)")
    parser.add_argument("--tokens", type=int, default=1 + 64 * 64, help="new tokens a row: <timestep> and the image's")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import torch

    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"torch {torch.__version__}, {name}, cuDNN {torch.backends.cudnn.version()}", flush=True)
    for lengths in LENGTHS:
        print("\n".join(["", *attention(lengths, args.device, getattr(torch, args.dtype), args.tokens, args.repeats)]), flush=True)


if __name__ == "__main__":
    main()
