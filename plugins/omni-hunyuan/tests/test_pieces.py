"""Pieces checked against straightforward independent computations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from omni_hunyuan.rope import image_positions, rope_tables


def test_image_positions_centre_the_grid() -> None:
    """A 2x3 image at index 10: y = 10 + (6-2)//2 + row, x = 10 + (6-3)//2 + col."""
    positions = image_positions(10, 2, 3).tolist()
    assert positions == [[12, 11], [12, 12], [12, 13], [13, 11], [13, 12], [13, 13]]


def test_text_rope_is_1d_rope() -> None:
    """With y = x = index the 2-D tables are ordinary RoPE (what transformers' default rope computes)."""
    head_dim, theta = 32, 10000.0
    index = torch.arange(7)
    cos, _ = rope_tables(torch.stack([index, index], -1), head_dim, theta)
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = index[:, None].float() * inv
    torch.testing.assert_close(cos, torch.cat([angles, angles], -1).cos())


def test_even_frequencies_follow_y_odd_follow_x() -> None:
    cos, _ = rope_tables(torch.tensor([[5, 0]]), 8, 10000.0)
    assert (cos[0, 0::2][:2] != 1).all() and (cos[0, 1::2][:2] == 1).all()


def test_velocity_equals_a_dense_masked_forward(checkpoint: Path, model: Any, tokenizer: Any, tokens: Any) -> None:
    """The cached-prefix step equals one forward over the whole row under the joint mask (text causal,
    the image block bidirectional, ``<eoi>`` seeing everything), written out densely here."""
    from omni_hunyuan.prompt import t2i_rows
    from omni_hunyuan.rope import text_positions

    side = 4
    rows = t2i_rows(tokenizer, tokens, "a cat", 16, side, side, cfg=False).rows
    latents = torch.randn(1, model.config.latent_channels, side, side, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([600.0])
    start = int((rows[0] == tokens.image).nonzero()[0])
    span = side * side
    seq = rows.shape[1]
    with torch.no_grad():
        embeds = model.model.wte(rows)
        embeds[0, start - 1] = model.timestep_emb(t)[0]
        embeds[0, start : start + span] = model.patch_embed(latents, model.time_embed(t))[0]
        positions = text_positions(0, seq)
        positions[start : start + span] = image_positions(start, side, side)
        index = torch.arange(seq)
        image = (index >= start) & (index < start + span)
        mask = (index[None] <= index[:, None]) | (image[:, None] & image[None])
        hidden, _ = model._run(embeds, positions[None], mask[None, None], None)
        dense = model.final_layer(hidden[:, start : start + span], model.time_embed_2(t), side, side)
        cached = model.velocity_from_ids(rows, latents, t, tokens.image)
    torch.testing.assert_close(cached, dense, atol=1e-5, rtol=1e-5)


def test_decode_latents_keeps_the_last_of_the_frames_a_latent_decodes_to(checkpoint: Path, vae: Any, decoder: Any) -> None:
    """Every ``vae.*`` tensor of the checkpoint is a parameter of ours under its own name; a one-frame
    latent decodes to ``ffactor_temporal`` frames, and `decode_latents` gives each image of a batch (of
    two sizes) the last of them, unscaled first and rounded to 8 bits (the release decoder's numbers:
    test_release.py)."""
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.vae import VAE_PREFIX, decode_latents
    from omni_hunyuan.weights import read_tensors

    config = HunyuanConfig.from_pretrained(checkpoint)
    stored = {key[len(VAE_PREFIX) :] for key in read_tensors(checkpoint, (VAE_PREFIX,))}
    assert stored == set(vae.state_dict()) and any(".norm1.bias" in key for key in stored)
    scale = config.vae["scaling_factor"]
    for side in (4, 6):
        latents = torch.randn(3, config.latent_channels, side, side, generator=torch.Generator().manual_seed(side))
        with torch.no_grad():
            frames = decoder(latents[:, :, None] / scale)
        assert frames.shape == (3, 3, config.vae["ffactor_temporal"], side * 16, side * 16)
        assert not torch.allclose(frames[:, :, 0], frames[:, :, -1])  # (the frames differ: which one is kept matters)
        pixels = decode_latents(decoder, latents, config.vae)
        expected = ((frames[:, :, -1] / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1) * 255).round().to(torch.uint8)
        assert pixels.shape == (3, side * 16, side * 16, 3)
        assert (pixels.int() - expected.int()).abs().max() <= 1


def test_the_vae_group_norm_by_reduction_equals_the_library(vae: Any) -> None:
    """`GroupNorm`'s CUDA path (statistics from ``torch.var_mean``), run here on CPU, against
    ``F.group_norm`` with a decoder norm's own parameters, on fp32 and on fp16 input (autocast's case)."""
    from omni_hunyuan.vae import group_norm_by_reduction

    norm = vae.decoder.up[0].block[0].norm1
    x = torch.randn(2, norm.num_channels, 4, 6, 5, generator=torch.Generator().manual_seed(0)) * 3 + 1
    for given in (x, x.half()):
        expected = torch.nn.functional.group_norm(given.float(), norm.num_groups, norm.weight, norm.bias, norm.eps)
        with torch.no_grad():
            ours = group_norm_by_reduction(given, norm.num_groups, norm.weight, norm.bias, norm.eps)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_frame_convolutions_equal_the_plain_convolution(vae: Any) -> None:
    """`FrameConv3d` (only the kernel frames that meet an input frame) against the plain zero-padded
    3-D convolution it replaces (`use_release_ops`), with a decoder convolution's own weights, for one
    to five frames (an image decodes through one, two and four); the whole decoder too."""
    import copy

    from omni_hunyuan.vae import FrameConv3d, use_release_ops

    conv = vae.decoder.up[0].block[0].conv1
    assert isinstance(conv, FrameConv3d) and conv.by_frames
    plain = use_release_ops(copy.deepcopy(conv))
    assert not plain.by_frames
    for frames in range(1, 6):
        x = torch.randn(2, conv.in_channels, frames, 6, 5, generator=torch.Generator().manual_seed(frames))
        with torch.no_grad():
            ours, expected = conv(x), plain(x)
        assert ours.shape == expected.shape == (2, conv.out_channels, frames, 6, 5)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    latents = torch.randn(1, vae.decoder.conv_in.in_channels, 1, 3, 4, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(vae.decoder(latents), use_release_ops(copy.deepcopy(vae.decoder))(latents), atol=1e-5, rtol=1e-5)


def test_cached_text_prefix_gives_the_image_a_full_recompute_gives(checkpoint: Path, model: Any, decoder: Any, tokenizer: Any, tokens: Any) -> None:
    """The sampler's text KV, computed once and reused by every step, against recomputing it from the
    whole row at every step: latents within 1e-5, the same 8-bit image up to rounding-boundary values
    (issue 25's KV-reuse criterion; the cached step's equality with one dense masked forward is the
    test above)."""
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.prompt import t2i_rows
    from omni_hunyuan.sampler import flow_sigmas, initial_noise, sample_t2i
    from omni_hunyuan.vae import decode_latents

    config = HunyuanConfig.from_pretrained(checkpoint)
    side, steps, guidance, shift = 4, 3, 5.0, 3.0
    rows = t2i_rows(tokenizer, tokens, "a lighthouse at night", 16, side, side, cfg=True)
    noise = initial_noise(5, config.latent_channels, side, side)
    cached = sample_t2i(model, rows.prefix, noise, steps, guidance, shift)

    latents = noise
    sigmas = flow_sigmas(steps, shift)
    with torch.no_grad():
        for step in range(steps):
            t = (sigmas[step] * 1000).repeat(2)
            cond, uncond = model.velocity_from_ids(rows.rows, latents.expand(2, -1, -1, -1), t, tokens.image).chunk(2)
            latents = latents + (uncond + guidance * (cond - uncond)) * (sigmas[step + 1] - sigmas[step])
    torch.testing.assert_close(cached, latents, atol=1e-5, rtol=1e-5)
    # The same 8-bit image up to values on a rounding boundary: latents ~4e-6 apart can move such a
    # value one level (1 of 12,288 values on one CPU, none on another), as in the contract test.
    with_cache, recomputed = (decode_latents(decoder, x, config.vae).int() for x in (cached, latents))
    assert (with_cache - recomputed).abs().max() <= 1 and (with_cache != recomputed).float().mean() < 0.001


def test_grouped_experts_equal_the_loop_over_experts(checkpoint: Path) -> None:
    """`MoE.group_experts` (the CUDA bf16 path: one grouped GEMM per projection, or one matmul per
    expert, or each expert's matmuls and SwiGLU back to back; the rows gathered or scattered) routes
    and weighs every token as the per-expert loop does, including experts no token picked."""
    import copy

    from omni_hunyuan.layers import LayerKernels, scatter_rows
    from omni_hunyuan.weights import load_transformer

    moe = load_transformer(checkpoint).model.layers[0].mlp
    grouped = copy.deepcopy(moe)
    grouped.group_experts()
    assert len(grouped.experts) == 0 and grouped.grouped_up.shape[0] == moe.gate.wg.weight.shape[0]
    tokens = torch.randn(3, 7, moe.gate.wg.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        picked = torch.topk(moe.gate(tokens.reshape(-1, tokens.shape[-1])), moe.topk, dim=-1).indices
        one = moe(tokens[:1, :1])
        torch.testing.assert_close(grouped(tokens[:1, :1]), one, atol=1e-5, rtol=1e-5)  # most experts idle
        torch.testing.assert_close(grouped(tokens), moe(tokens), atol=1e-5, rtol=1e-5)
        per_expert = LayerKernels(expert_gemms="per_expert")  # one matmul per expert: the same products
        torch.testing.assert_close(grouped(tokens[:1, :1], per_expert), one, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grouped(tokens, per_expert), moe(tokens), atol=1e-5, rtol=1e-5)
        # The experts' input rows scattered in token order (`scatter_rows`, compiled) instead of gathered.
        scattered = LayerKernels(rows=torch.compile(scatter_rows, dynamic=None), expert_gemms="per_expert")
        torch.testing.assert_close(grouped(tokens[:1, :1], scattered), one, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grouped(tokens, scattered), moe(tokens), atol=1e-5, rtol=1e-5)
        # Each expert's up, SwiGLU and down back to back (`interleaved_experts`): whole, the same matmuls on
        # the same rows as one matmul per expert (the same values); 2 rows at a time, other matmul shapes.
        for rows in (0, 2):
            interleaved = LayerKernels(expert_gemms="interleaved", expert_rows=rows)
            torch.testing.assert_close(grouped(tokens[:1, :1], interleaved), one, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(grouped(tokens, interleaved), moe(tokens), atol=1e-5, rtol=1e-5)
        assert torch.equal(grouped(tokens, LayerKernels(expert_gemms="interleaved")), grouped(tokens, per_expert))
    assert picked.unique().numel() > 1


def test_image_rows_attention_equals_a_dense_mask() -> None:
    """`ImageRowsMask.attend` (runs of rows with one prefix length, sliced; ``<timestep>`` recomputed
    over the prefix and itself) equals SDPA under the dense mask it stands for, for rows in any order:
    one run, runs of several rows, equal lengths apart, a row with no prefix."""
    from omni_hunyuan.layers import ImageRowsMask

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, new = 4, 2, 8, 1 + 9
    for lengths in ((3, 3), (5, 3, 3, 5, 2), (0, 4)):
        batch, padded = len(lengths), max(lengths)
        q = torch.randn(batch, heads, new, dim, generator=generator)
        k, v = (torch.randn(batch, kv_heads, new, dim, generator=generator) for _ in range(2))
        past = tuple(torch.randn(batch, kv_heads, padded, dim, generator=generator) for _ in range(2))
        keys = torch.arange(padded + new)
        real = keys[None] >= padded - torch.tensor(lengths)[:, None]  # (each prefix ends at `padded`)
        dense = real[:, None, None, :].expand(batch, 1, new, padded + new).clone()
        dense[:, :, 0, padded + 1 :] = False  # <timestep> does not see the image
        want = F.scaled_dot_product_attention(
            q, torch.cat([past[0], k], 2), torch.cat([past[1], v], 2), attn_mask=dense, enable_gqa=True
        )
        mask = ImageRowsMask(lengths, padded)
        assert len(mask.runs()) == len([i for i in range(batch) if i == 0 or lengths[i] != lengths[i - 1]])
        torch.testing.assert_close(mask.attend(q, k, v, past), want, atol=1e-6, rtol=1e-6)


def test_compiled_layer_kernels_equal_eager(checkpoint: Path) -> None:
    """`LayerKernels.compiled()` (torch.compile around attention and the experts; the fused gather,
    weighing and sum of the k expert outputs) gives the eager layer's outputs and cache, with grouped
    and with looped experts, and again for a new batch shape."""
    import copy

    from omni_hunyuan.layers import EAGER, ImageRowsMask, LayerKernels
    from omni_hunyuan.rope import image_positions, rope_tables, text_positions
    from omni_hunyuan.weights import load_transformer

    model = load_transformer(checkpoint)
    config = model.config
    looped = model.model.layers[0]
    grouped = copy.deepcopy(looped)
    grouped.mlp.group_experts()
    compiled = LayerKernels.compiled()
    generator = torch.Generator().manual_seed(0)
    for lengths in ((5, 3), (5, 3, 4, 2)):
        batch, padded, side = len(lengths), max(lengths), 3
        x = torch.randn(batch, 1 + side * side, config.hidden_size, generator=generator)
        past = tuple(torch.randn(batch, config.num_kv_heads, padded, config.head_dim, generator=generator) for _ in range(2))
        positions = torch.stack([torch.cat([text_positions(n, 1), image_positions(n + 1, side, side)]) for n in lengths])
        cos, sin = rope_tables(positions, config.head_dim, config.rope_theta)
        mask = ImageRowsMask(lengths, padded)
        with torch.no_grad():
            for layer in (looped, grouped):
                want, no_cache = layer(x, cos, sin, mask, past, EAGER)
                got, _ = layer(x, cos, sin, mask, past, compiled)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32, sums in another order
                assert no_cache is None  # a denoising forward keeps no keys/values


def test_a_shared_model_of_another_layout_or_dtype_is_refused_naming_the_setting(checkpoint: Path) -> None:
    """`load_transformer(backbone=...)` takes the decoder of the text stage's model only if it has this
    checkpoint's layout and runs in this stage's dtype; else `SharedBackboneError` names the setting."""
    import pytest
    from omni_hunyuan.weights import SharedBackboneError, load_transformer
    from torch import nn

    text_model = load_transformer(checkpoint)  # has `.model` (wte, layers, ln_f), as the vLLM model does
    with pytest.raises(SharedBackboneError, match="is not Omni's HunyuanImage-3.0 vLLM model") as wrong:
        load_transformer(checkpoint, backbone=nn.Linear(2, 2))
    assert wrong.value.setting == "share_model_with"
    with pytest.raises(SharedBackboneError, match="torch.float32 on cpu, this stage runs torch.bfloat16") as dtype:
        load_transformer(checkpoint, dtype=torch.bfloat16, backbone=text_model)
    assert dtype.value.setting == "options.dtype"  # the key resolve() names too
    shared = load_transformer(checkpoint, backbone=text_model)
    assert shared.model.layers[0].mlp is text_model.model.layers[0].mlp


def test_the_vllm_config_dir_holds_a_known_config_and_the_checkpoints_tokenizer(checkpoint: Path, tmp_path: Path) -> None:
    """vLLM reads config.json of the tokenizer's directory too: the derived directory (our model type
    for vLLM, one transformers knows) carries the checkpoint's tokenizer files, so the release's own
    model type is never parsed there (vLLM retries that, seconds of start-up, logging errors)."""
    from omni_hunyuan.vllm_model import vllm_config_dir
    from transformers import AutoConfig, AutoTokenizer

    derived = vllm_config_dir(checkpoint, tmp_path / "derived")
    assert AutoConfig.from_pretrained(derived).model_type == "hunyuan_v1_moe"
    text = "a red apple <boi>"
    assert AutoTokenizer.from_pretrained(derived).encode(text) == AutoTokenizer.from_pretrained(checkpoint).encode(text)
    assert vllm_config_dir(checkpoint, tmp_path / "derived") == derived  # again: the links are reused


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def test_quantized_grouped_experts_stay_close_to_the_unquantized_ones(checkpoint: Path) -> None:
    """`MoE.quantize_experts` (the dit's ``quantization`` on grouped experts): FP8 weights per expert
    and channel with FP8 token rows (here the CPU path, `fp8_grouped_mm_reference`), and int8 weights
    dequantized per call, give the unquantized MoE's output within a few percent, eager and compiled."""
    import copy

    from omni_hunyuan.layers import LayerKernels, weigh_slots
    from omni_hunyuan.weights import load_transformer

    moe = load_transformer(checkpoint).model.layers[0].mlp
    moe.group_experts()
    tokens = torch.randn(3 * 7, moe.grouped_up.shape[-1], generator=torch.Generator().manual_seed(0))
    compiled = LayerKernels.compiled()
    with torch.no_grad():
        want = moe(tokens)
        for method, tolerance in (("fp8", 0.08), ("int8_weight_only", 0.02)):
            quantized = copy.deepcopy(moe)
            quantized.quantize_experts(method)
            dtype = torch.float8_e4m3fn if method == "fp8" else torch.int8
            assert quantized.grouped_up.dtype == quantized.grouped_down.dtype == dtype
            assert quantized.grouped_up_scale.shape == quantized.grouped_up.shape[:2]  # per expert and channel
            got = quantized(tokens)
            assert 0 < _relative_error(got, want) <= tolerance, method
            weights, chosen = quantized.route(tokens)
            plan = quantized.dispatch(chosen, compiled)
            fused = weigh_slots(*quantized.grouped_experts(tokens, plan, compiled), weights) + quantized.shared_mlp(tokens)
            torch.testing.assert_close(fused, got, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="grouped, unquantized"):
        quantized.quantize_experts("fp8")


def test_rows_scattered_in_token_order_equal_the_gathered_ones() -> None:
    """The compiled experts' input rows (`scatter_rows`, `scatter_rows_fp8`: each token read once,
    written to its k places) are the expert-ordered gathers' (`gather_rows`, `gather_rows_fp8`) bit for
    bit, FP8 rows and their scales included."""
    from omni_hunyuan.layers import gather_rows, gather_rows_fp8, scatter_rows, scatter_rows_fp8

    generator = torch.Generator().manual_seed(0)
    count, hidden, topk, experts = 37, 64, 3, 8
    tokens = torch.randn(count, hidden, generator=generator).to(torch.bfloat16) * 4
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:topk] for _ in range(count)])
    order = chosen.reshape(-1).sort(stable=True).indices
    rows = order // topk
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    want = gather_rows(tokens, rows, inverse, topk)
    assert torch.equal(torch.compile(scatter_rows, dynamic=None)(tokens, rows, inverse, topk), want)
    want_fp8, want_scale = gather_rows_fp8(tokens, rows, inverse, topk)
    got_fp8, got_scale = torch.compile(scatter_rows_fp8, dynamic=None)(tokens, rows, inverse, topk)
    assert got_fp8.dtype == torch.float8_e4m3fn and got_fp8.shape == (count * topk, hidden)
    assert torch.equal(got_fp8.view(torch.uint8), want_fp8.view(torch.uint8))
    assert torch.equal(got_scale, want_scale)
    assert not torch.equal(want[:count], tokens)  # (expert order is not token order)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a CUDA GPU with FP8 grouped GEMMs (Hopper: compute capability 9.0)")
def test_fp8_grouped_kernel_equals_its_reference_on_gpu() -> None:
    """``torch._scaled_grouped_mm`` (CUDA) computes what `fp8_grouped_mm_reference` does (with empty
    groups), and FP8 experts stay within a few percent of bf16 ones at a release-like width."""
    from omni_hunyuan.quantized import fp8_grouped_mm, fp8_grouped_mm_reference, quantize_stacked, rows_fp8

    generator = torch.Generator("cuda").manual_seed(0)
    weight = torch.randn(8, 768, 512, device="cuda", generator=generator).to(torch.bfloat16) * 0.02
    x = torch.randn(1000, 512, device="cuda", generator=generator).to(torch.bfloat16)
    ends = torch.tensor([100, 100, 350, 600, 600, 800, 990, 1000], device="cuda", dtype=torch.int32)
    w8, scale = quantize_stacked(weight, "fp8")
    x8, x_scale = rows_fp8(x)
    got = fp8_grouped_mm(x8, x_scale, w8, scale, ends, torch.bfloat16)
    reference = fp8_grouped_mm_reference(x8, x_scale, w8, scale, ends, torch.bfloat16)
    assert _relative_error(got, reference) <= 0.01  # (fast accumulation: ~0.5% measured)
    bf16 = torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
    assert _relative_error(got, bf16) <= 0.05
