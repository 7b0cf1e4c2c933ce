"""HunyuanImage-3.0's decoder layers (attention, the MoE), named as the release names its weights.

Module and parameter names follow the release's on-disk keys (FAMILIES.md 2.2), so a release checkpoint
loads with ``load_state_dict`` and no renaming: the fused qkv stays interleaved per KV head, the experts
keep their ``[up; gate]`` rows and the router its fp32 ``gate.wg``. The image-token embedder and head
and the timestep embeddings are `omni_hunyuan.patches`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from omni_hunyuan.config import HunyuanConfig
from omni_hunyuan.quantized import (
    dequantize_stacked,
    fp8_grouped_mm,
    quantize_stacked,
    rows_fp8,
)
from omni_hunyuan.rope import apply_rope


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the weight multiplies the normalised input cast back to its dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@attrs.frozen
class ImageRowsMask:
    """The attention of a denoising forward (`HunyuanImage3.velocity`), without a dense mask.

    Row b's keys are its prefix, the last ``lengths[b]`` of ``padded`` cached prefix keys (the padding
    comes first: `PrefixCache.concat` right-aligns the prefixes), then its new tokens: the step tokens
    (``<timestep>``; a -Distil checkpoint's also ``<guidance>`` and ``<timestep_r>``) and the image.
    A step token's query sees the prefix and the step tokens up to itself; the image queries see every
    key of the row. `attend` runs that as unmasked attention per run of consecutive rows with one
    prefix length, which SDPA runs on its flash kernels: a dense boolean mask sends it to a kernel ~3x
    slower at 1024x1024 (bench/hunyuan_profile.py), a key-padding mask makes cuDNN's 2.1x slower
    (bench/hunyuan_attention.py). Rows sorted by prefix length make the fewest runs
    (`HunyuanDiT.denoise` sorts its requests so).
    """

    lengths: tuple[int, ...]
    padded: int
    step_tokens: int = 1  # text tokens before the image: <timestep> (-Distil: and <guidance>, <timestep_r>)

    def rows(self, index: list[int]) -> ImageRowsMask:
        return ImageRowsMask(tuple(self.lengths[i] for i in index), self.padded, self.step_tokens)

    def runs(self) -> list[tuple[int, int, int]]:
        """``(start, stop, length)`` of each run of consecutive rows with one prefix length."""
        runs: list[tuple[int, int, int]] = []
        for row, length in enumerate(self.lengths):
            if runs and runs[-1][2] == length:
                runs[-1] = (runs[-1][0], row + 1, length)
            else:
                runs.append((row, row + 1, length))
        return runs

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``q``/``k``/``v`` ``[B, heads or kv_heads, step_tokens + image, dim]`` of the new tokens, `past`
        the right-aligned prefix keys/values ``[B, kv_heads, padded, dim]``: the output ``[B, heads, step_tokens + image, dim]``.

        Every row's keys (values) are copied once into one buffer, the prefixes then the new keys; a
        run's keys are then a view of it (its rows, from its prefix on), and its queries run in one
        call, the step tokens included (they then saw the image too: their outputs are recomputed over
        the prefix and the step tokens up to each, one query a row, in place). Several runs write into one output laid out
        as ``o_proj`` reads it (`Attention.output`)."""
        keys, values = (_prefix_then_new(*pair, self.padded) for pair in ((past[0], k), (past[1], v)))
        return self.attend_buffers(q, keys, values)

    def attend_buffers(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`attend` given the buffers: every row's keys/values ``[B, kv_heads, padded + step_tokens + image, dim]``,
        the right-aligned prefix then the new tokens (any strides with the last dim contiguous)."""
        runs = self.runs()
        batch, heads, seq, dim = q.shape
        padded = self.padded
        out = None
        for start, stop, length in runs:
            run_k, run_v = keys[start:stop, :, padded - length :], values[start:stop, :, padded - length :]
            queries = q[start:stop]
            part = F.scaled_dot_product_attention(queries, run_k, run_v, enable_gqa=True)
            for token in range(self.step_tokens):  # (causal text: the prefix and the step tokens up to itself)
                seen = length + token + 1
                part[:, :, token : token + 1] = F.scaled_dot_product_attention(
                    queries[:, :, token : token + 1], run_k[:, :, :seen], run_v[:, :, :seen], enable_gqa=True
                )
            if len(runs) == 1:
                return part
            if out is None:
                out = q.new_empty(batch, seq, heads, dim).transpose(1, 2)
            out[start:stop] = part
        assert out is not None
        return out


def _prefix_then_new(past: torch.Tensor, new: torch.Tensor, padded: int) -> torch.Tensor:
    """``cat([past, new], dim=2)`` as two copies into one buffer. (On an H100 at 1024x1024 and
    concurrency 4, 0.21 ms a layer against 0.62 for the per-run `torch.cat`s and output copy it
    replaced: bench/results/hunyuan-attention-h100.md.)"""
    batch, heads, seq, dim = new.shape
    out = new.new_empty(batch, heads, padded + seq, dim)
    out[:, :, :padded] = past
    out[:, :, padded:] = new
    return out


class Attention(nn.Module):
    """GQA attention with the release's fused ``qkv_proj``, QK RMSNorm applied *after* RoPE: `project`,
    `attend`, `output` (a `DecoderLayer` runs them with its `LayerKernels`).

    ``qkv_proj`` rows are grouped per KV head: for each of the ``num_kv_heads`` groups, its
    ``heads_per_kv`` query heads, then one key head, then one value head.
    """

    def __init__(self, config: HunyuanConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.group = config.heads_per_kv
        self.qkv_proj = nn.Linear(
            config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.attention_bias)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.query_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.key_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[B, heads, S, head_dim]`` of (normed) ``x [B, S, H]``: rotated, then
        QK-normed, in `x`'s dtype."""
        batch, seq, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, self.num_kv_heads, self.group + 2, self.head_dim)
        q = qkv[:, :, :, : self.group].reshape(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, self.group].transpose(1, 2)
        v = qkv[:, :, :, self.group + 1].transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if self.use_qk_norm:
            q = self.query_layernorm(q)
            k = self.key_layernorm(k)
        return q.to(v.dtype), k.to(v.dtype), v

    @staticmethod
    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | ImageRowsMask,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Attention of the new tokens to `past` keys/values plus their own: the output ``[B, heads, S,
        head_dim]`` and the keys/values of past + new tokens (what a cache keeps).

        `mask` is boolean ``[B, 1, S, past + S]``, true where a query may see a key, or the layout
        of a denoising forward (`ImageRowsMask`, which needs `past` and keeps no cache: a denoising
        step's keys are not reused, so they are never concatenated whole)."""
        if isinstance(mask, ImageRowsMask):
            if past is None:
                raise ValueError("ImageRowsMask attends to a cached prefix: pass past")
            return mask.attend(q, k, v, past), None
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), (k, v)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of the attention output ``[B, heads, S, head_dim]``: ``[B, S, H]``."""
        batch, _, seq, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


def swiglu(fused: torch.Tensor) -> torch.Tensor:
    """``up * silu(gate)`` of a fused ``[..., 2I]`` projection whose halves are ``[up; gate]``."""
    up, gate = fused.chunk(2, dim=-1)
    return up * F.silu(gate)


def swiglu_fp8(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`swiglu`'s rows scaled to FP8 (`omni_hunyuan.quantized.rows_fp8`): the FP8 experts' down input."""
    return rows_fp8(swiglu(fused))


class MLP(nn.Module):
    """SwiGLU with the release's fused ``gate_and_up_proj``, rows ``[up; gate]``: ``down(up * silu(gate))``."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor] = swiglu) -> torch.Tensor:
        return self.down_proj(act(self.gate_and_up_proj(x)))


class Router(nn.Module):
    """The top-k router; its weight ``wg`` stays fp32 (the release keeps it so) whatever the model dtype."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Expert probabilities ``[tokens, experts]`` (fp32 softmax of fp32 logits)."""
        return F.softmax(F.linear(x.float(), self.wg.weight.float()), dim=-1)


@attrs.frozen
class Dispatch:
    """A grouped MoE layer's routing, sorted by expert (`MoE.dispatch`)."""

    order: torch.Tensor  # [T*k]: the (token, slot) pairs grouped by expert, tokens in order
    ends: torch.Tensor  # int32 [experts]: where each expert's pairs end in `order`
    host_ends: torch.Tensor | None = None  # `ends` on the host (one matmul per expert needs the counts)
    ready: torch.cuda.Event | None = None  # recorded after `host_ends`' asynchronous copy

    def counts(self) -> list[int]:
        """Each expert's number of (token, slot) pairs, on the host (waits for the copy)."""
        assert self.host_ends is not None
        if self.ready is not None:
            self.ready.synchronize()
        ends = self.host_ends.tolist()
        return [stop - start for start, stop in zip([0, *ends[:-1]], ends)]


class MoE(nn.Module):
    """Every layer's MLP: routed experts (softmax, top-k, renormalised) plus the shared expert(s)."""

    def __init__(self, config: HunyuanConfig) -> None:
        super().__init__()
        self.topk = config.moe_topk
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Router(config.hidden_size, config.num_experts)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size, config.mlp_bias) for _ in range(config.num_experts)
        )
        self.shared_mlp = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts, config.mlp_bias)
            if config.num_shared_experts
            else None
        )

        # `group_experts` stacks the experts into `grouped_up` [E, 2I, H] and `grouped_down` [E, H, I];
        # `quantize_experts` stores those as `quantized` says (with per-channel scales `*_scale` [E, out]).
        self.grouped = False
        self.quantized: str | None = None

    def group_experts(self) -> None:
        """Stack the experts' weights for grouped GEMMs (``torch._grouped_mm``: one kernel per projection
        for every expert, no host sync). For CUDA, bias-free experts in bfloat16 (what the kernel
        takes); the per-expert modules are freed, so memory does not grow."""
        first = self.experts[0]
        if first.gate_and_up_proj.bias is not None:
            raise ValueError("grouped experts take bias-free experts (mlp_bias false, as released)")
        up = torch.stack([expert.gate_and_up_proj.weight for expert in self.experts])
        down = torch.stack([expert.down_proj.weight for expert in self.experts])
        self.experts = nn.ModuleList()
        self.grouped_up = nn.Parameter(up, requires_grad=False)
        self.grouped_down = nn.Parameter(down, requires_grad=False)
        self.grouped = True

    def quantize_experts(self, method: str) -> None:
        """Store the grouped experts quantized (`omni_hunyuan.quantized`: ``fp8`` runs FP8 grouped GEMMs,
        ``int8_weight_only`` dequantizes at each call)."""
        if not self.grouped or self.quantized is not None:
            raise ValueError("quantize_experts takes grouped, unquantized experts (`group_experts`)")
        for name in ("grouped_up", "grouped_down"):
            weight, scale = quantize_stacked(getattr(self, name), method)
            setattr(self, name, nn.Parameter(weight, requires_grad=False))
            self.register_buffer(f"{name}_scale", scale)
        self.quantized = method

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k expert weights (renormalised if configured) and expert indexes ``[T, k]``."""
        weights, chosen = torch.topk(self.gate(tokens), self.topk, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def dispatch(self, chosen: torch.Tensor, kernels: LayerKernels | None = None) -> Dispatch:
        """Where the routed (token, slot) pairs go (`Dispatch`). Called as soon as the routing is known:
        with one matmul per expert (``kernels.expert_gemms``) the counts start their copy to the
        host here, so the GPU works through what is queued after (the shared expert, the row gather)
        while `grouped_experts` waits for them."""
        kernels = EAGER if kernels is None else kernels
        experts, order = chosen.reshape(-1).sort(stable=True)
        # Each expert's end in the sorted list (a bincount's cumsum, without the host sync CUDA's
        # bincount makes to size its output).
        everyone = torch.arange(self.grouped_up.shape[0], device=experts.device, dtype=experts.dtype)
        ends = torch.searchsorted(experts, everyone, right=True).to(torch.int32)
        host, ready = None, None
        if kernels.expert_gemms != "grouped" and self.quantized != "fp8":
            host = ends
            if ends.is_cuda:  # into pinned memory, asynchronously; `ready` marks the copy's end
                host, ready = ends.to("cpu", non_blocking=True), torch.cuda.Event()
                ready.record()
        return Dispatch(order, ends, host, ready)

    def grouped_experts(
        self, tokens: torch.Tensor, plan: Dispatch, kernels: LayerKernels | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' outputs ``[T*k, H]`` in expert order, and the inverse permutation that
        brings them back to (token, slot) order (`weigh_slots`); `plan` is `dispatch`'s; `kernels` run
        SwiGLU (and the FP8 scaling of rows: `quantize_experts`)."""
        kernels = EAGER if kernels is None else kernels
        order, ends = plan.order, plan.ends
        rows = order // self.topk
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        if self.quantized == "fp8":
            # Each token is scaled once, then its FP8 row taken k times (half a bf16 gather's bytes).
            x, x_scale = kernels.rows_fp8(tokens, rows, inverse, self.topk)
            hidden = fp8_grouped_mm(x, x_scale, self.grouped_up, self.grouped_up_scale, ends, tokens.dtype)
            out = fp8_grouped_mm(*kernels.act_fp8(hidden), self.grouped_down, self.grouped_down_scale, ends, tokens.dtype)
            return out, inverse
        up, down = self.grouped_up, self.grouped_down
        if self.quantized == "int8_weight_only":
            up = dequantize_stacked(up, self.grouped_up_scale, tokens.dtype)
            down = dequantize_stacked(down, self.grouped_down_scale, tokens.dtype)
        x = kernels.rows(tokens, rows, inverse, self.topk)
        if plan.host_ends is not None:
            counts = plan.counts()  # (waits for the copy `dispatch` started; the GPU still has the gather)
            if kernels.expert_gemms == "interleaved":
                out = interleaved_experts(x, up, down, counts, kernels.act, kernels.expert_rows)
            else:
                out = per_expert_mm(kernels.act(per_expert_mm(x, up, counts)), down, counts)
        else:
            out = torch._grouped_mm(kernels.act(torch._grouped_mm(x, up.transpose(1, 2), offs=ends)), down.transpose(1, 2), offs=ends)
        return out, inverse

    def looped_experts(self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum ``[T, H]``, one expert at a time (the ungrouped experts)."""
        routed = torch.zeros_like(tokens)
        # Only the experts some token picked run; each sees just its tokens (a gather, not a dense pass).
        for expert in chosen.unique().tolist():
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            out = self.experts[expert](tokens[rows]) * weights[rows, slot, None].to(tokens.dtype)
            routed.index_add_(0, rows, out)
        return routed

    def forward(self, x: torch.Tensor, kernels: LayerKernels | None = None) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, chosen = self.route(tokens)
        if self.grouped:
            routed = weigh_slots(*self.grouped_experts(tokens, self.dispatch(chosen, kernels), kernels), weights)
        else:
            routed = self.looped_experts(tokens, weights, chosen)
        if self.shared_mlp is not None:
            routed = routed + self.shared_mlp(tokens)
        return routed.reshape(shape)


def group_experts(layers: Iterable[nn.Module]) -> None:
    """Stack each layer's experts for grouped GEMMs (`MoE.group_experts`) where the kernel takes them:
    bias-free experts in bfloat16 on CUDA. Elsewhere (CPU, fp32, biases), and for experts already
    grouped, the experts stay as they are."""
    for layer in layers:
        moe = layer.mlp
        if moe.grouped or not len(moe.experts):
            continue
        down = moe.experts[0].down_proj
        if down.weight.is_cuda and down.weight.dtype == torch.bfloat16 and down.bias is None:
            moe.group_experts()


def per_expert_mm(x: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert e's ``counts[e]`` rows of `x` (in expert order) times ``weights[e].T``, into one ``[rows,
    out]`` tensor: `torch._grouped_mm`'s product, one dense matmul per expert. (The views come from
    one `split` and one `unbind` each: the host launches ~130 matmuls a layer.)"""
    out = x.new_empty(x.shape[0], weights.shape[1])
    for rows, weight, into in zip(x.split(counts), weights.transpose(1, 2).unbind(0), out.split(counts), strict=True):
        if rows.shape[0]:
            torch.mm(rows, weight, out=into)
    return out


def interleaved_experts(
    x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, counts: list[int], act: Callable[[torch.Tensor], torch.Tensor], rows: int = 0
) -> torch.Tensor:
    """`per_expert_mm`'s ``down(act(up(x)))`` one expert at a time (with `rows`, each expert's rows in
    near-equal parts of at most that many): an expert's up product is read back by `act`, and `act`'s
    output by the down matmul, right after they are written, while they may still be in the GPU's L2
    cache, not after every expert's (the whole up product is ~3 GiB at concurrency 4). Without
    `rows`, the same matmuls on the same rows as `per_expert_mm`, so the same values."""
    out = x.new_empty(x.shape[0], down.shape[1])
    ups, downs = up.transpose(1, 2).unbind(0), down.transpose(1, 2).unbind(0)
    for block, w_up, w_down, into in zip(x.split(counts), ups, downs, out.split(counts), strict=True):
        count = block.shape[0]
        parts = max(1, -(-count // rows)) if rows and count else 1
        for part, target in zip(block.tensor_split(parts), into.tensor_split(parts)):
            if part.shape[0]:
                torch.mm(act(torch.mm(part, w_up)), w_down, out=target)
    return out


def gather_rows(tokens: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, topk: int) -> torch.Tensor:
    """Each routed (token, slot) pair's token, in expert order ``[T*k, H]``: ``tokens[rows]``
    (`MoE.grouped_experts`: ``rows`` each pair's token, ``inverse`` each pair's place; `scatter_rows`)."""
    return tokens.index_select(0, rows)


def scatter_rows(tokens: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, topk: int) -> torch.Tensor:
    """`gather_rows` written for `torch.compile`: the pairs in token order, each token's row read once
    and written to its k places (``out[inverse] = tokens repeated k times``, one scatter kernel). A
    gather in expert order reads each token k times, far apart, from memory: ~2x the bytes. On an
    H100 at concurrency 4 (262k rows of 4096): 0.92 ms a layer against 1.49, 0.9% more images/s
    (bench/results/hunyuan-fused-moe-h100.md, hunyuan-image3-h100-8layers-50steps-scatter.md).
    (``rows`` is unused: the signature is `gather_rows`', so `LayerKernels.rows` takes either.)"""
    count = tokens.shape[0]
    out = tokens.new_empty(count * topk, *tokens.shape[1:])
    repeated = tokens.unsqueeze(1).expand(count, topk, *tokens.shape[1:]).reshape(count * topk, *tokens.shape[1:])
    return out.index_put_((inverse,), repeated)


def gather_rows_fp8(tokens: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_rows` for FP8 experts: each token scaled to FP8 once (`rows_fp8`), then its FP8 row and
    scale gathered in expert order."""
    x, scale = rows_fp8(tokens)
    return x.index_select(0, rows), scale.index_select(0, rows)


def scatter_rows_fp8(tokens: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_rows_fp8` written for `torch.compile` (`scatter_rows`' order): one pass that reads each
    bf16 token once, scales it and writes its FP8 row and scale to the token's k places."""
    x, scale = rows_fp8(tokens)
    return scatter_rows(x, rows, inverse, topk), scatter_rows(scale, rows, inverse, topk)


def weigh_slots(out: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs (`MoE.grouped_experts`) weighed and summed: ``[T, H]``.

    A gather by the inverse permutation (a scatter's indexed writes cost ~4x as much on CUDA), then
    the k slots weighed and summed in one batched matmul: no atomic adds, fp32 accumulation."""
    slots = out.index_select(0, inverse).view(weights.shape[0], weights.shape[1], -1)
    return torch.bmm(weights.to(slots.dtype).unsqueeze(1), slots).squeeze(1)


def layer_qkv(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer up to attention: input norm, fused qkv, RoPE, QK norm."""
    return layer.self_attn.project(layer.input_layernorm(x), cos, sin)


def layer_route(layer: DecoderLayer, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer from attention to its experts: ``o_proj`` and the residual, the MoE's norm and router.
    Returns the residual stream ``[B, S, H]``, the normed tokens ``[T, H]`` and the routing (`MoE.route`)."""
    x = x + layer.self_attn.output(out)
    tokens = layer.post_attention_layernorm(x).reshape(-1, x.shape[-1])
    return (x, tokens, *layer.mlp.route(tokens))


def layer_combine(
    x: torch.Tensor, out: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None
) -> torch.Tensor:
    """A grouped MoE layer's end: ``x + (weigh_slots(...) + shared)``."""
    routed = weigh_slots(out, inverse, weights)
    if shared is not None:
        routed = routed + shared
    return x + routed.view(x.shape)


def layer_combine_fused(
    x: torch.Tensor, out: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None
) -> torch.Tensor:
    """`layer_combine` written for `torch.compile`: one pointwise pass over the output in which each
    element gathers its token's k expert rows (contiguous loads), weighs them in fp32 and adds the
    shared expert and the residual (no gathered copy, no bmm)."""
    slot = inverse.view(weights.shape)
    routed = out[slot[:, 0]].float() * weights[:, :1]
    for k in range(1, weights.shape[1]):
        routed = routed + out[slot[:, k]].float() * weights[:, k : k + 1]
    routed = routed.to(x.dtype)
    if shared is not None:
        routed = routed + shared
    return x + routed.view(x.shape)


@attrs.frozen
class LayerKernels:
    """The attention-free pieces of a decoder layer, eager or compiled with `torch.compile`.

    Compiling fuses what surrounds the matrix products into few passes: the norms, RoPE and QK norm
    (fp32 elementwise work), the residual adds, the router's softmax and top-k, SwiGLU's
    ``up * silu(gate)``, the experts' input rows written in token order (`scatter_rows`; FP8 rows
    and their scales: `scatter_rows_fp8`), and the MoE's gather-weigh-sum of each token's k expert
    outputs. Attention and the grouped expert GEMMs stay eager (their routing has data-dependent
    sizes). The pieces take the layer as an argument, so one compiled graph serves every layer.
    """

    qkv: Callable[..., tuple[torch.Tensor, ...]] = layer_qkv
    route: Callable[..., tuple[torch.Tensor, ...]] = layer_route
    act: Callable[[torch.Tensor], torch.Tensor] = swiglu
    combine: Callable[..., torch.Tensor] = layer_combine
    rows: Callable[..., torch.Tensor] = gather_rows  # the experts' input rows in expert order (bf16 experts)
    rows_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gather_rows_fp8  # FP8 experts (`MoE.quantize_experts`)
    act_fp8: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = swiglu_fp8
    # How grouped bf16 experts multiply (`MoE.grouped_experts`): "grouped", one `torch._grouped_mm` a
    # projection (no host sync), or "per_expert", one dense matmul an expert on its slice of rows (the
    # host waits a layer for the counts; `MoE.dispatch` starts their copy early). With thousands
    # of rows an expert (denoising forwards: `compiled`) cuBLAS runs them faster than the grouped kernel:
    # served on an H100 at concurrency 4, 4.7% more images/s (bench/results/hunyuan-image3-h100-8layers-50steps-gemms.md).
    # "interleaved": per_expert's matmuls with each expert's up, SwiGLU and down run back to back
    # (`interleaved_experts`; `expert_rows` rows at a time if set), so SwiGLU may read from L2.
    expert_gemms: str = attrs.field(default="grouped", validator=attrs.validators.in_(("grouped", "per_expert", "interleaved")))
    expert_rows: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    @classmethod
    def compiled(cls, expert_gemms: str = "per_expert") -> LayerKernels:
        """The pieces under `torch.compile`, for denoising forwards (many rows an expert: `expert_gemms`)."""
        return cls(
            torch.compile(layer_qkv, dynamic=None),
            torch.compile(layer_route, dynamic=None),
            torch.compile(swiglu, dynamic=None),
            torch.compile(layer_combine_fused, dynamic=None),
            torch.compile(scatter_rows, dynamic=None),
            torch.compile(scatter_rows_fp8, dynamic=None),
            # (autotuned: inductor's default reduction over a row of 3,072 took 2.8 ms for 262k rows, tuned 1.9)
            torch.compile(swiglu_fp8, dynamic=None, mode="max-autotune-no-cudagraphs"),
            expert_gemms,
        )


EAGER = LayerKernels()


class DecoderLayer(nn.Module):
    """Pre-norm block: attention, then the MoE."""

    def __init__(self, config: HunyuanConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | ImageRowsMask,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        kernels: LayerKernels | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The layer's output for new tokens ``x`` and its keys/values of past + new tokens (None under
        an `ImageRowsMask`); `kernels` (`LayerKernels`) run the pieces around attention and the experts."""
        kernels = EAGER if kernels is None else kernels
        q, k, v = kernels.qkv(self, x, cos, sin)
        out, cache = self.self_attn.attend(q, k, v, mask, past)
        x, tokens, weights, chosen = kernels.route(self, x, out)
        moe = self.mlp
        plan = moe.dispatch(chosen, kernels) if moe.grouped else None  # (before the shared expert: see `dispatch`)
        shared = None if moe.shared_mlp is None else moe.shared_mlp(tokens, kernels.act)
        if plan is not None:
            return kernels.combine(x, *moe.grouped_experts(tokens, plan, kernels), weights, shared), cache
        routed = moe.looped_experts(tokens, weights, chosen)
        if shared is not None:
            routed = routed + shared
        return x + routed.view(x.shape), cache
