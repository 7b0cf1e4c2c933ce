"""HunyuanImage-3.0 denoising attention on one layer's shapes (8 rows: 4 requests x CFG, 32 heads, 8 KV
heads, 1 + 64x64 new tokens, prefixes of a few lengths), in the layouts tried for `ImageRowsMask`.

Baseline: the runs-with-cats layout the dit stage used before (each run of rows with one prefix length
concatenates its prefix and new keys, `torch.cat`). Against it: one buffer per layer with the
prefixes right-aligned (what `ImageRowsMask.attend` does now: runs are views), BHSD or BSHD, with and
without the buffer's allocation; one unmasked call (a lower bound: no padding); one call with a key
padding mask, boolean or additive, [B,1,1,K] or expanded, under each SDPA backend. CUDA only.

    python3 bench/hunyuan_attention.py     (on the GPU machine: torch is all it needs)
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev, dt = "cuda", torch.bfloat16
B, H, KV, D, N = 8, 32, 8, 128, 4097
G = H // KV


def timeit(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def top_kernels(fn, n=4):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:n]
    return "; ".join(f"{e.key[:60]} x{e.count} {e.device_time_total / 1e3:.2f}ms" for e in rows)


def runs_of(lengths):
    runs = []
    for row, length in enumerate(lengths):
        if runs and runs[-1][2] == length:
            runs[-1] = (runs[-1][0], row + 1, length)
        else:
            runs.append((row, row + 1, length))
    return runs


def attention(lengths):
    P = max(lengths)
    runs = runs_of(lengths)
    q = torch.randn(B, N, H, D, device=dev, dtype=dt).transpose(1, 2)
    k = torch.randn(B, N, KV, D, device=dev, dtype=dt).transpose(1, 2)
    qkv = torch.randn(B, N, KV, G + 2, D, device=dev, dtype=dt)
    v = qkv[:, :, :, G + 1].transpose(1, 2)
    past_k = torch.randn(B, KV, P, D, device=dev, dtype=dt)
    past_v = torch.randn(B, KV, P, D, device=dev, dtype=dt)
    for b, n in enumerate(lengths):  # right-padded, as PrefixCache.concat padded them before the buffer
        past_k[b, :, n:] = 0
        past_v[b, :, n:] = 0

    def current():
        out = q.new_empty(B, N, H, D).transpose(1, 2)
        for start, stop, length in runs:
            keys = torch.cat([past_k[start:stop, :, :length], k[start:stop]], dim=2)
            values = torch.cat([past_v[start:stop, :, :length], v[start:stop]], dim=2)
            part = F.scaled_dot_product_attention(q[start:stop], keys, values, enable_gqa=True)
            part[:, :, :1] = F.scaled_dot_product_attention(q[start:stop, :, :1], keys[:, :, : length + 1], values[:, :, : length + 1], enable_gqa=True)
            out[start:stop] = part
        return out

    # right-aligned prefixes, built once (per batch), new keys copied in per layer
    right_k = torch.zeros(B, KV, P, D, device=dev, dtype=dt)
    right_v = torch.zeros_like(right_k)
    for b, n in enumerate(lengths):
        right_k[b, :, P - n :] = past_k[b, :, :n]
        right_v[b, :, P - n :] = past_v[b, :, :n]

    def attend_views(bk, bv):
        """Each run on views of the [B, KV, P + N, D] buffers (as `ImageRowsMask.attend`)."""
        out = q.new_empty(B, N, H, D).transpose(1, 2)
        for start, stop, length in runs:
            keys, values = bk[start:stop, :, P - length :], bv[start:stop, :, P - length :]
            part = F.scaled_dot_product_attention(q[start:stop], keys, values, enable_gqa=True)
            part[:, :, :1] = F.scaled_dot_product_attention(q[start:stop, :, :1], keys[:, :, : length + 1], values[:, :, : length + 1], enable_gqa=True)
            if len(runs) == 1:
                return part
            out[start:stop] = part
        return out

    def buffer_bhsd(persistent=None):
        if persistent is None:
            bk = q.new_empty(B, KV, P + N, D)
            bv = q.new_empty(B, KV, P + N, D)
            bk[:, :, :P] = right_k
            bv[:, :, :P] = right_v
        else:
            bk, bv = persistent
        bk[:, :, P:] = k
        bv[:, :, P:] = v
        return attend_views(bk, bv)

    def buffer_bshd(persistent=None):
        if persistent is None:
            bk = q.new_empty(B, P + N, KV, D)
            bv = q.new_empty(B, P + N, KV, D)
            bk[:, :P] = right_k.transpose(1, 2)
            bv[:, :P] = right_v.transpose(1, 2)
        else:
            bk, bv = persistent
        bk[:, P:] = k.transpose(1, 2)
        bv[:, P:] = v.transpose(1, 2)
        bk, bv = bk.transpose(1, 2), bv.transpose(1, 2)
        return attend_views(bk, bv)

    kfull = torch.randn(B, KV, P + N, D, device=dev, dtype=dt)
    vfull = torch.randn_like(kfull)
    keys_idx = torch.arange(P + N, device=dev)
    lens = torch.tensor(lengths, device=dev)
    real = (keys_idx[None] >= P - lens[:, None])[:, None, None, :]  # right-aligned prefix
    bias = torch.zeros(B, 1, 1, P + N, device=dev, dtype=dt).masked_fill(~real, float("-inf"))
    results = {}
    results["current (runs, cats)"] = (timeit(current), top_kernels(current))
    results["buffer bhsd (alloc+prefix copy per layer)"] = (timeit(buffer_bhsd), top_kernels(buffer_bhsd))
    pers = (q.new_empty(B, KV, P + N, D), q.new_empty(B, KV, P + N, D))
    results["buffer bhsd persistent (new copy only)"] = (timeit(lambda: buffer_bhsd(pers)), top_kernels(lambda: buffer_bhsd(pers)))
    results["buffer bshd (alloc+prefix copy per layer)"] = (timeit(buffer_bshd), top_kernels(buffer_bshd))
    results["one unmasked call (lower bound)"] = (timeit(lambda: F.scaled_dot_product_attention(q, kfull, vfull, enable_gqa=True)),
                                                   top_kernels(lambda: F.scaled_dot_product_attention(q, kfull, vfull, enable_gqa=True)))
    for name, mask in (("bool [B,1,1,K]", real), ("additive bf16 [B,1,1,K]", bias), ("bool expanded [B,1,N,K]", real.expand(B, 1, N, P + N))):
        for backend in (None, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            label = f"one call, mask {name}, backend {backend.name if backend else 'default'}"
            try:
                if backend is None:
                    fn = lambda: F.scaled_dot_product_attention(q, kfull, vfull, attn_mask=mask, enable_gqa=True)  # noqa: E731
                    results[label] = (timeit(fn), top_kernels(fn))
                else:
                    def fn(backend=backend, mask=mask):
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(q, kfull, vfull, attn_mask=mask, enable_gqa=True)
                    results[label] = (timeit(fn), top_kernels(fn))
            except Exception as exc:  # noqa: BLE001
                results[label] = (float("nan"), f"{type(exc).__name__}: {str(exc)[:150]}")
    # exactness of the buffer layout against current
    ref = current().float()
    diff = (buffer_bhsd().float() - ref).abs().max().item()
    diff2 = (buffer_bshd().float() - ref).abs().max().item()
    # masked cuDNN against the right-aligned buffer
    print(f"\n### attention, lengths {lengths} (runs {len(runs)}), P {P}; buffer (BHSD / BSHD) vs current, max diff {diff:.2e} / {diff2:.2e}\n")
    base = results["current (runs, cats)"][0]
    print("| layout | ms | vs the runs with cats | top kernels |\n|---|---:|---:|---|")
    for name, (ms, kernels) in results.items():
        print(f"| {name} | {ms:.3f} | {ms / base:.2f}x | {kernels} |")
    sys.stdout.flush()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), torch.backends.cudnn.version())
    attention([70, 70, 74, 74, 81, 81, 90, 90])
    attention([52, 52, 52, 52, 60, 60, 60, 60])
    attention([60] * 8)
