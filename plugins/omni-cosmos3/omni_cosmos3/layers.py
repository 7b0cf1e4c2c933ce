"""The generator tower's tensor work for `Cosmos3Model`: rotary embedding, patching, attention over
each row's reasoner keys plus its own tokens (`Context`), and one decoder layer batched over rows."""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
import torch.nn.functional as F

from omni_core.stages.diffusion_cache import device_rows
from omni_core.stages.diffusion_parallel import SINGLE, Parallel


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[S, C, T, H, W] -> [S, T*ceil(H/p)*ceil(W/p), p*p*C], the transformer's token order.

    Sizes that are not a multiple of the patch are zero-padded, as the transformer does (action
    conditioning keeps the frames' content size, which need not be a multiple).
    """
    s, c, t, h, w = latents.shape
    ph, pw = -(-h // p) * p, -(-w // p) * p
    if (ph, pw) != (h, w):
        latents = F.pad(latents, (0, pw - w, 0, ph - h))
    x = latents.reshape(s, c, t, ph // p, p, pw // p, p)
    return torch.einsum("bcthpwq->bthwpqc", x).reshape(s, -1, p * p * c)


def unpatchify(tokens: torch.Tensor, shape: torch.Size, p: int) -> torch.Tensor:
    """[B, T*ceil(H/p)*ceil(W/p), p*p*C] -> [B, C, T, H, W] (the padding cut off)."""
    c, t, h, w = shape
    ph, pw = -(-h // p) * p, -(-w // p) * p
    x = tokens.reshape(tokens.shape[0], t, ph // p, pw // p, p, p, c)
    return torch.einsum("bthwpqc->bcthpwq", x).reshape(tokens.shape[0], c, t, ph, pw)[..., :h, :w]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False,
    expand_kv: bool | None = None,
) -> torch.Tensor:
    """Grouped-query attention over [B, L, heads, head_dim] inputs -> [B, heads, Lq, head_dim].

    `expand_kv` (default: on CUDA when a mask is given) repeats the key/value heads instead of
    passing ``enable_gqa``: PyTorch's fused CUDA kernels do not take a mask together with
    ``enable_gqa`` and fall back to the math kernel, which materialises every score in float32
    (tens of GiB for a batch of 1024x1024 images). The result is the same either way.
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    if expand_kv is None:
        expand_kv = mask is not None and q.device.type == "cuda"
    if expand_kv and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=groups > 1)


def attention_per_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: "Context") -> torch.Tensor:
    """Attention row by row over each row's real keys, with no mask.

    `keys`/`values` are [B, N_max + M, kvh, hd]: each row's reasoner keys right-aligned before
    N_max (padding in front), then its generator keys, so a row's real keys are one contiguous
    slice. On CUDA a padding mask rules out the flash kernels (and grouped heads must then be
    expanded); each row's generator tokens are thousands of queries, so one unmasked fused call per
    row (cuDNN's, on an H200) is faster than one masked call for the batch, while the linears around
    it stay batched. One variable-length flash call for all rows measured slower too (0.43 against
    0.35 ms a layer for 16 rows of 1024 queries at 512 pixels).

    The rows are joined in [B, Lq, heads, head_dim] order, the layout the fused kernels write and the
    output projection reads: joined as [B, heads, Lq, head_dim], the copy reads every row strided and
    the projection needs a second, transposing copy (together 2 ms of a 41 ms H200 step at 512 pixels).
    """
    n_max = context.keys[0].shape[1]
    end = None if context.gen_tokens is None else n_max + context.gen_tokens  # Ulysses padding cut off
    outs = [
        attention(q[i : i + 1], keys[i : i + 1, n_max - length : end], values[i : i + 1, n_max - length : end]).transpose(1, 2)
        for i, length in enumerate(context.lengths)
    ]
    return torch.cat(outs, dim=0).transpose(1, 2)


@attrs.define
class Context:
    """Per-row attention context of a generator step: padded reasoner keys/values and positions.

    Reasoner keys are right-aligned: row i's real keys are ``keys[layer][i, N_max - lengths[i]:]``.
    Under Ulysses (`parallel`), `cos`/`sin` are this rank's share of the generator tokens (padded to
    a multiple of the ranks), the keys/values this rank's share of the heads, and `gen_tokens`
    the real generator tokens (the padded keys are masked).
    """

    keys: list[torch.Tensor]  # per layer [B, N_max, kvh, hd]
    values: list[torch.Tensor]
    mask: torch.Tensor  # [B, 1, 1, N_max + M] True where a key is real
    cos: torch.Tensor  # [B, M, 1, hd]
    sin: torch.Tensor
    lengths: list[int] = attrs.field(factory=list)  # real reasoner keys per row
    parallel: Parallel = SINGLE
    expand_kv: bool = False  # repeat the key/value heads to the query heads before the all-to-all
    gen_tokens: int | None = None  # real generator tokens, when padded for Ulysses

    def for_ranks(self, parallel: Parallel, gen_tokens: int, heads: int) -> "Context":
        """This context as a Ulysses rank uses it (built over the padded tokens, whole keys):
        the padded keys masked, this rank's share of the heads and of the rotary tables."""
        if parallel.ulysses == 1:
            return self
        kv_heads = self.keys[0].shape[2]
        expand = kv_heads % parallel.ulysses != 0
        if heads % parallel.ulysses:
            raise ValueError(f"{heads} attention heads do not split over {parallel.ulysses} Ulysses ranks")

        def share(x: torch.Tensor) -> torch.Tensor:
            return parallel.head_share(x.repeat_interleave(heads // kv_heads, dim=2) if expand else x).contiguous()

        mask = self.mask.clone()
        mask[..., self.keys[0].shape[1] + gen_tokens :] = False
        return attrs.evolve(
            self, keys=[share(k) for k in self.keys], values=[share(v) for v in self.values], mask=mask,
            cos=parallel.shard(self.cos, 1), sin=parallel.shard(self.sin, 1), parallel=parallel, expand_kv=expand,
            gen_tokens=gen_tokens,
        )

    @classmethod
    def build(cls, rows: list[Any], cos: torch.Tensor, sin: torch.Tensor, gen_len: int, device: torch.device) -> "Context":
        lengths = [row.kv[0][0].shape[0] for row in rows]
        n_max = max(lengths)
        keys, values = [], []
        for layer in range(len(rows[0].kv)):
            k0, v0 = rows[0].kv[layer]
            k = k0.new_zeros(len(rows), n_max, *k0.shape[1:])
            v = v0.new_zeros(len(rows), n_max, *v0.shape[1:])
            for i, row in enumerate(rows):
                k[i, n_max - lengths[i] :], v[i, n_max - lengths[i] :] = row.kv[layer]
            keys.append(k)
            values.append(v)
        mask = torch.ones(len(rows), n_max + gen_len, dtype=torch.bool, device=device)
        for i, length in enumerate(lengths):
            mask[i, : n_max - length] = False
        return cls(keys, values, mask[:, None, None, :], cos, sin, lengths)

    def select(self, index: list[int]) -> "Context":
        rows = device_rows(index, self.mask.device)

        def pick(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, rows)

        return Context(
            [pick(k) for k in self.keys], [pick(v) for v in self.values], pick(self.mask), pick(self.cos), pick(self.sin),
            [self.lengths[i] for i in index], self.parallel, self.expand_kv, self.gen_tokens,
        )


def generator_qkv(layer: Any, gen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The generator pathway of a decoder layer up to attention: norm, projections, q/k norms, rope."""
    attn = layer.self_attn
    normed = layer.input_layernorm_moe_gen(gen)
    q = attn.norm_added_q(attn.add_q_proj(normed).unflatten(-1, (attn.num_attention_heads, attn.head_dim)))
    k = attn.norm_added_k(attn.add_k_proj(normed).unflatten(-1, (attn.num_key_value_heads, attn.head_dim)))
    v = attn.add_v_proj(normed).unflatten(-1, (attn.num_key_value_heads, attn.head_dim))
    return rope(q, cos, sin), rope(k, cos, sin), v


def generator_out(layer: Any, gen: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The rest of the layer after attention: output projection, residuals, norm and MLP."""
    gen = gen + layer.self_attn.to_add_out(out.transpose(1, 2).flatten(-2))
    return gen + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(gen))


@attrs.frozen
class LayerKernels:
    """The two attention-free halves of a generator layer, eager or compiled with `torch.compile`.

    Compiling fuses the norms, rotary embedding and residual adds around the matrix products. The
    attention between the halves stays eager: on CUDA it is one unmasked fused call per row
    (`attention_per_row`), which measured faster on an H200 than one flex-attention kernel with a
    padding `BlockMask` for all rows, at 512 and at 1024 pixels. The halves take the layer as an
    argument, so one compiled graph serves every layer of the tower.
    """

    qkv: Callable[..., tuple[torch.Tensor, ...]] = generator_qkv
    out: Callable[..., torch.Tensor] = generator_out

    @classmethod
    def compiled(cls) -> "LayerKernels":
        return cls(torch.compile(generator_qkv, dynamic=None), torch.compile(generator_out, dynamic=None))


EAGER = LayerKernels()


def generator_layer(layer: Any, gen: torch.Tensor, context: Context, index: int, kernels: LayerKernels = EAGER) -> torch.Tensor:
    """One decoder layer's generator pathway (`Cosmos3VLTextMoTDecoderLayer`), batched over rows.

    Under Ulysses `gen` is this rank's share of the tokens: all-to-alls around attention give it
    every token of its share of the heads, then its tokens of every head back."""
    q, k, v = kernels.qkv(layer, gen, context.cos, context.sin)
    parallel = context.parallel
    if parallel.ulysses > 1:
        if context.expand_kv:
            k, v = (x.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for x in (k, v))
        q, k, v = parallel.seq_to_heads(q), parallel.seq_to_heads(k), parallel.seq_to_heads(v)
    keys = torch.cat([context.keys[index], k], dim=1)
    values = torch.cat([context.values[index], v], dim=1)
    if gen.is_cuda and context.lengths:
        out = attention_per_row(q, keys, values, context)
    else:
        out = attention(q, keys, values, mask=context.mask)
    if parallel.ulysses > 1:
        out = parallel.heads_to_seq(out.transpose(1, 2)).transpose(1, 2)
    return kernels.out(layer, gen, out)
