"""Several MiniMax-H3 requests in ONE transformer forward: their packed sequences, end to end.

`MiniMaxH3Transformer3DModel.forward` takes one packed layout (the batch axis only replicates it),
so requests of different prompts, keyframes or steps cannot share its batch. But every part of
its forward is per row except attention: the input projections, the AdaLN table lookups
(``timestep_indices * 3 + token_tags``), the rotary angles and the output heads. So the packed
sequences of several requests are concatenated into one (timestep tables and row indexes offset
per request), and attention runs per request, over that request's rows only: `SegmentedAttention`
(an attention processor of the library's own interface) takes the requests' row spans as its
``attention_mask`` argument, which `MiniMaxH3TransformerBlock` passes through. Each request then
sees exactly what it sees alone (no padding, no mask), with the same kernels.

The token refiner (attention over each request's text) runs the same way, segment by segment.
`forward_packed` is the transformer's `forward` with those two changes; its steps and dtype casts
follow diffusers' line by line, so one request gives the library's output. Each block runs as
`MiniMaxH3TransformerBlock.forward` does, split at attention (`run_block`): the two halves around
it are what the ``compile`` option compiles (`BlockKernels`).

Ulysses (`omni_core.stages.diffusion_parallel`): every block is per row except attention, and its
attention is one self-attention over the request's whole packed sequence (text, video and audio
rows alike; the model has no cross-attention). So each rank runs the block stack on a share of
every request's rows (`Segments.for_ranks`); around attention one all-to-all gives it every row of
a share of the heads, and attention then runs per request over its real rows only (the padding
that evens the shares out is never a key). The rows are joined again after the stack, so the
output heads and every scheduler step see the whole sequence on every rank.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from omni_core.stages.diffusion_parallel import SINGLE, Parallel
from omni_minimax_h3 import diffusers_private


@attrs.frozen
class Segments:
    """Row spans ``[start, end)`` of each request in a concatenated sequence, and each request's rows.

    Under Ulysses (`parallel`, from `for_ranks`) a rank holds a share of every request: the
    request's rows padded to a multiple of the ranks, split into equal shares; `spans` are then
    this rank's shares in its own sequence and `lengths` the requests' real rows. Splitting each
    request, not the whole concatenation, keeps a request's share the same whatever else shares
    the step (its first-block cache compares that share from step to step).
    """

    spans: tuple[tuple[int, int], ...]
    lengths: tuple[int, ...]
    parallel: Parallel = SINGLE

    @classmethod
    def of_lengths(cls, lengths: list[int]) -> Segments:
        spans, start = [], 0
        for length in lengths:
            spans.append((start, start + length))
            start += length
        return cls(tuple(spans), tuple(lengths))

    def for_ranks(self, parallel: Parallel) -> Segments:
        """The layout of this rank's shares (itself on one rank)."""
        if parallel.ulysses == 1:
            return self
        shares = [parallel.padded(length) // parallel.ulysses for length in self.lengths]
        return Segments(Segments.of_lengths(shares).spans, self.lengths, parallel)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shares of `x`, which holds every request's rows along `dim`, end to end."""
        parallel = self.parallel
        if parallel.ulysses == 1:
            return x
        starts = [span[0] for span in Segments.of_lengths(list(self.lengths)).spans]
        return torch.cat([parallel.shard(x.narrow(dim, start, length), dim) for start, length in zip(starts, self.lengths)], dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every request's rows end to end, from each rank's shares (`x`): the inverse of `shard`."""
        parallel = self.parallel
        if parallel.ulysses == 1:
            return x
        everyone = parallel.gather(x, parallel.ulysses * x.shape[dim], dim)
        return torch.cat(self.requests(everyone, dim), dim)

    def requests(self, x: torch.Tensor, dim: int = 1) -> list[torch.Tensor]:
        """Each request's real rows of `x`, which holds every rank's shares rank after rank (the
        order an all-to-all or all-gather over the Ulysses ranks gives), or this rank's sequence."""
        u = self.parallel.ulysses
        if u == 1:
            return [x.narrow(dim, start, end - start) for start, end in self.spans]
        x = x.unflatten(dim, (u, -1))
        return [
            x.narrow(dim + 1, start, end - start).flatten(dim, dim + 1).narrow(dim, 0, length)
            for (start, end), length in zip(self.spans, self.lengths)
        ]

    def join(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The inverse of `requests`: per-request rows back to every rank's shares, padding zeroed."""
        u = self.parallel.ulysses
        if u == 1:
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        shares = []
        for part, (start, end) in zip(parts, self.spans):
            extra = u * (end - start) - part.shape[dim]
            if extra:
                part = torch.cat([part, part.new_zeros(*part.shape[:dim], extra, *part.shape[dim + 1 :])], dim)
            shares.append(part.unflatten(dim, (u, end - start)))
        return torch.cat(shares, dim + 1).flatten(dim, dim + 1)

    def real(self) -> list[int]:
        """How many of each request's rows in this rank's share are real (the rest is padding)."""
        rank = self.parallel.ulysses_rank
        return [max(0, min(end - start, length - rank * (end - start))) for (start, end), length in zip(self.spans, self.lengths)]

    def groups(self, rows: int) -> list[list[int]]:
        """Consecutive requests, as many to a group as fit in `rows` rows (a larger request alone)."""
        groups: list[list[int]] = []
        used = 0
        for index, (start, end) in enumerate(self.spans):
            if not groups or used + end - start > rows:
                groups.append([])
                used = 0
            groups[-1].append(index)
            used += end - start
        return groups

    def select(self, chosen: list[int]) -> Segments:
        """The layout of requests `chosen` alone (their shares kept, packed end to end)."""
        shares = [self.spans[i][1] - self.spans[i][0] for i in chosen]
        return Segments(Segments.of_lengths(shares).spans, tuple(self.lengths[i] for i in chosen), self.parallel)


class SegmentedAttention:
    """`MiniMaxH3AttnProcessor` with block-diagonal attention: given `Segments` as the attention
    mask, each request attends to itself only (one unmasked attention per request); otherwise the
    library's processor as it is. (The block stack calls `project_qkv`, `attend` and
    `project_out` itself, `run_block`; the token refiner's blocks come through here.)

    Under Ulysses the hidden states are this rank's shares: the projections, norms and rotary
    angles are per row, so they run on the shares; one all-to-all (queries, keys and values side by
    side in each head) then gives every row of a share of the heads, attention runs per request
    on its real rows, and the inverse all-to-all gives the shares back with every head."""

    def __init__(self) -> None:
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

        self.plain = MiniMaxH3AttnProcessor()

    def __call__(self, attn: Any, hidden_states: torch.Tensor, rotary_emb: Any = None, attention_mask: Any = None) -> torch.Tensor:
        if not isinstance(attention_mask, Segments):
            return self.plain(attn, hidden_states, rotary_emb, attention_mask)
        query, key, value = project_qkv(attn, hidden_states, rotary_emb)
        return project_out(attn, attend(attention_mask, query, key, value))


def project_qkv(attn: Any, hidden_states: torch.Tensor, rotary_emb: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`MiniMaxH3AttnProcessor` up to attention: the projections, QK norms and rotary angles
    (``[1, rows, heads, head_dim]`` each)."""
    query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
    key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
    value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
    query, key = attn.norm_q(query), attn.norm_k(key)
    if rotary_emb is not None:
        query = diffusers_private.apply_rotary_emb(query, *rotary_emb)
        key = diffusers_private.apply_rotary_emb(key, *rotary_emb)
    return query, key, value


def attend(segments: Segments, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Each request's rows attend to that request's rows only; ``[1, rows, heads * head_dim]`` in the
    queries' dtype (under Ulysses: one all-to-all each way around it)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    parallel = segments.parallel
    if parallel.ulysses > 1:
        query, key, value = parallel.seq_to_heads(torch.cat([query, key, value], dim=-1)).chunk(3, dim=-1)
    rows = segments.requests
    outputs = [
        dispatch_attention_fn(q.contiguous(), k.contiguous(), v.contiguous(), attn_mask=None, dropout_p=0.0, is_causal=False)
        for q, k, v in zip(rows(query), rows(key), rows(value))
    ]
    out = segments.join(outputs)
    if parallel.ulysses > 1:
        out = parallel.heads_to_seq(out)
    return out.flatten(2, 3).type_as(query)


def project_out(attn: Any, out: torch.Tensor) -> torch.Tensor:
    """`MiniMaxH3AttnProcessor` after attention: the output projection."""
    return attn.to_out[1](attn.to_out[0](out))


def block_before_attention(
    block: Any, hidden_states: torch.Tensor, temb: torch.Tensor, adaln_indices: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[Any, ...]:
    """`MiniMaxH3TransformerBlock.forward` up to attention: the block's modulation tables, the
    modulated first norm, queries, keys and values; and the tables the rest of the block needs."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj(temb)
    norm_hidden_states = block.norm1(hidden_states)
    norm_hidden_states = norm_hidden_states * (1.0 + scale_msa.index_select(0, adaln_indices)) + shift_msa.index_select(0, adaln_indices)
    query, key, value = project_qkv(block.attn, norm_hidden_states, (cos, sin))
    return query, key, value, (gate_msa, shift_mlp, scale_mlp, gate_mlp)


def block_after_attention(
    block: Any, hidden_states: torch.Tensor, out: torch.Tensor, tables: tuple[torch.Tensor, ...], adaln_indices: torch.Tensor
) -> torch.Tensor:
    """`MiniMaxH3TransformerBlock.forward` from attention on: output projection, gated residual, the
    modulated second norm, the feed-forward and its gated residual."""
    gate_msa, shift_mlp, scale_mlp, gate_mlp = tables
    hidden_states = hidden_states + gate_msa.index_select(0, adaln_indices) * project_out(block.attn, out)
    norm_hidden_states = block.norm2(hidden_states)
    norm_hidden_states = norm_hidden_states * (1.0 + scale_mlp.index_select(0, adaln_indices)) + shift_mlp.index_select(0, adaln_indices)
    return hidden_states + gate_mlp.index_select(0, adaln_indices) * block.ff(norm_hidden_states)


BLOCK_ROWS = 16384  # rows a block runs on at a time (`BlockKernels.rows`)


@attrs.frozen
class BlockKernels:
    """A transformer block's attention-free halves, eager or compiled with `torch.compile`.

    Compiling fuses what surrounds the matrix products into few passes: the RMS norms, the AdaLN
    table lookups (an ``index_select`` per row) with their scale, shift and gate, the QK norms,
    the rotary angles, SwiGLU and the residual adds. Attention stays eager: its per-request calls
    depend on the requests that share the step. The halves take the block as an argument, so one
    compiled graph serves every block (and the row count is a dynamic dimension after its first
    change: requests join and leave the step).

    A block runs on at most about `rows` rows at a time (`run_block`): its activations (queries,
    keys, values, the feed-forward's two ``ffn_dim``-wide rows for each row) are then those of one
    480p request, however many share the step, instead of growing with them; a matrix product of
    16,384 rows already fills a GPU, so the pieces cost no speed.
    """

    before: Any = block_before_attention
    after: Any = block_after_attention
    rows: int = BLOCK_ROWS

    @classmethod
    def compiled(cls) -> BlockKernels:
        return cls(torch.compile(block_before_attention, dynamic=None), torch.compile(block_after_attention, dynamic=None))

    def second_half(
        self, block: Any, hidden_states: torch.Tensor, out: torch.Tensor, tables: tuple[torch.Tensor, ...], adaln_indices: torch.Tensor
    ) -> torch.Tensor:
        """`after` on pieces of at most `rows` rows (as equal as can be), joined."""
        total = hidden_states.shape[1]
        if total <= self.rows:
            return self.after(block, hidden_states, out, tables, adaln_indices)
        pieces = -(-total // self.rows)  # (ceiling divisions)
        size = -(-total // pieces)
        return torch.cat([
            self.after(block, hidden_states[:, start : start + size], out[:, start : start + size], tables, adaln_indices[start : start + size])
            for start in range(0, total, size)
        ], dim=1)


EAGER = BlockKernels()


def run_block(
    block: Any, hidden_states: torch.Tensor, temb: torch.Tensor, adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor], rows: Segments, kernels: BlockKernels = EAGER,
) -> torch.Tensor:
    """`MiniMaxH3TransformerBlock.forward` over several requests' rows, attention per request: on
    groups of consecutive requests of at most ``kernels.rows`` rows (`Segments.groups`; every op but
    attention is per row, attention per request), the second half in pieces of at most that many.
    Under Ulysses the step's rows stay one group (attention's all-to-all spans them); only the
    second half is in pieces."""
    groups = rows.groups(kernels.rows) if rows.parallel.ulysses == 1 else [list(range(len(rows.spans)))]
    if len(groups) == 1:
        return _run_group(block, hidden_states, temb, adaln_indices, rotary_emb, rows, kernels)
    outputs = []
    for chosen in groups:
        start, end = rows.spans[chosen[0]][0], rows.spans[chosen[-1]][1]
        cos, sin = rotary_emb[0][start:end], rotary_emb[1][start:end]
        outputs.append(_run_group(block, hidden_states[:, start:end], temb, adaln_indices[start:end], (cos, sin), rows.select(chosen), kernels))
    return torch.cat(outputs, dim=1)


def _run_group(
    block: Any, hidden_states: torch.Tensor, temb: torch.Tensor, adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor], rows: Segments, kernels: BlockKernels,
) -> torch.Tensor:
    query, key, value, tables = kernels.before(block, hidden_states, temb, adaln_indices, *rotary_emb)
    out = attend(rows, query, key, value)
    del query, key, value  # (freed before the feed-forward's intermediate is made)
    return kernels.second_half(block, hidden_states, out, tables, adaln_indices)


@attrs.define
class PackedInput:
    """One request's transformer input at one step, in the library's argument names."""

    hidden_states: torch.Tensor  # [Nv, Cv * prod(patch)] video rows, conditioning rows first
    audio_hidden_states: torch.Tensor  # [Na, Ca]
    encoder_hidden_states: torch.Tensor  # [T, text_dim]
    timestep: torch.Tensor  # [num_timesteps] distinct values in [0, 1]
    timestep_indices: torch.Tensor  # [L]
    token_tags: torch.Tensor  # [L]
    position_ids: torch.Tensor  # [L, 3]
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.position_ids.shape[0])


def use_segmented_attention(transformer: Any) -> None:
    """Give every attention of `transformer` the segment-aware processor (the library's setter)."""
    transformer.set_attn_processor(SegmentedAttention())


@attrs.frozen
class CacheRow:
    """A request's first-block cache (`omni_core.stages.diffusion_cache`) and where it is in its schedule."""

    state: Any  # CacheState
    step: int
    total: int


@torch.no_grad()
def forward_packed(
    transformer: Any, inputs: list[PackedInput], caches: list[CacheRow | None] | None = None, parallel: Parallel = SINGLE,
    kernels: BlockKernels = EAGER,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Video and audio velocities of each request (``[Nv, ...]``, ``[Na, ...]``), with one forward for all.

    `caches`: per request, its first-block cache, or None (the whole stack runs). With a cache, the
    first block runs for everyone and the others only for the requests whose first-block output
    changed enough; the rest reuse the residual those blocks added at their last full step.
    `parallel`: under Ulysses, this rank runs the block stack on its share of each request's rows
    (every rank of the group calls this on the same inputs); every rank returns all velocities.
    `kernels`: the blocks' attention-free halves, eager or compiled (`BlockKernels`).
    The transformer must use `SegmentedAttention` (`use_segmented_attention`: its token refiner).
    """
    from diffusers.models.modeling_utils import get_parameter_dtype
    from diffusers.models.transformers.transformer_minimax_h3 import MINIMAX_H3_MODALITY_NUM

    lengths = [item.length for item in inputs]
    offsets = [span[0] for span in Segments.of_lengths(lengths).spans]
    rows = Segments.of_lengths(lengths)
    text_rows = Segments.of_lengths([int(item.encoder_hidden_states.shape[0]) for item in inputs])

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(item, name) for item in inputs])

    def shifted(name: str) -> torch.Tensor:
        return torch.cat([getattr(item, name) + offset for item, offset in zip(inputs, offsets)])

    timestep_offsets, total = [], 0
    for item in inputs:
        timestep_offsets.append(total)
        total += int(item.timestep.shape[0])
    timestep = cat("timestep")
    timestep_indices = torch.cat([item.timestep_indices + off for item, off in zip(inputs, timestep_offsets)])
    token_tags = cat("token_tags")
    position_ids = cat("position_ids")
    video_indices, audio_indices, text_indices = shifted("video_indices"), shifted("audio_indices"), shifted("text_indices")

    t = transformer
    rotary_emb = t.rope(position_ids)
    video_embeds = t.proj_in(cat("hidden_states")[None].to(get_parameter_dtype(t.proj_in)))
    audio_embeds = t.audio_proj_in(cat("audio_hidden_states")[None].to(get_parameter_dtype(t.audio_proj_in)))
    text_embeds = t.context_embedder(cat("encoder_hidden_states")[None].to(get_parameter_dtype(t.context_embedder)))
    text_embeds = _refine(t.token_refiner, text_embeds, text_rows)
    sequence_length = int(position_ids.shape[0])
    hidden_states = text_embeds.new_zeros((1, sequence_length, text_embeds.shape[-1]))
    hidden_states = hidden_states.index_copy(1, text_indices, text_embeds)
    hidden_states = hidden_states.index_copy(1, video_indices, video_embeds.to(text_embeds.dtype))
    hidden_states = hidden_states.index_copy(1, audio_indices, audio_embeds.to(text_embeds.dtype))
    temb = t.time_embedder(t.time_proj(timestep).to(get_parameter_dtype(t.time_embedder)))
    adaln_indices = timestep_indices * MINIMAX_H3_MODALITY_NUM + token_tags
    # The block stack runs on this rank's shares (all rows on one rank); the text refiner and the
    # input and output projections are cheap next to it and run on every row everywhere.
    rows = rows.for_ranks(parallel)
    hidden_states = rows.shard(hidden_states, 1)
    rotary_emb = (rows.shard(rotary_emb[0], 0), rows.shard(rotary_emb[1], 0))
    adaln_indices = rows.shard(adaln_indices, 0)
    blocks = list(t.transformer_blocks)
    if caches is None or all(cache is None for cache in caches):
        for block in blocks:
            hidden_states = run_block(block, hidden_states, temb, adaln_indices, rotary_emb, rows, kernels)
    else:
        hidden_states = _cached_blocks(blocks, hidden_states, temb, adaln_indices, rotary_emb, rows, caches, kernels)
    hidden_states = rows.gather(hidden_states, 1)
    hidden_states = t.norm_out(hidden_states, temb, timestep_indices).to(get_parameter_dtype(t.proj_out))
    video_out = t.proj_out(hidden_states).index_select(1, video_indices)[0]
    audio_out = t.audio_proj_out(hidden_states).index_select(1, audio_indices)[0]
    results, video_start, audio_start = [], 0, 0
    for item in inputs:
        nv, na = int(item.video_indices.shape[0]), int(item.audio_indices.shape[0])
        results.append((video_out[video_start : video_start + nv], audio_out[audio_start : audio_start + na]))
        video_start, audio_start = video_start + nv, audio_start + na
    return results


def _refine(refiner: Any, hidden_states: torch.Tensor, segments: Segments) -> torch.Tensor:
    """`MiniMaxH3TokenRefiner.forward`, each request's text attending to itself only."""
    for block in refiner.refiner_blocks:
        hidden_states = hidden_states + block.attn(block.norm1(hidden_states), None, segments)
        hidden_states = hidden_states + block.ff(block.norm2(hidden_states))
    return refiner.final_norm(hidden_states)


def _cached_blocks(
    blocks: list[Any], hidden_states: torch.Tensor, temb: torch.Tensor, adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor], rows: Segments, caches: list[CacheRow | None], kernels: BlockKernels,
) -> torch.Tensor:
    """First-block caching over packed requests: block 0 for all, the rest for the requests that must compute.

    Under Ulysses each rank measures its share of a request's rows (the padding zeroed) and the
    ranks add their sums (`diffusion_cache.decide`), so they all take the same decisions."""
    from omni_core.stages import diffusion_cache

    before = hidden_states
    hidden_states = run_block(blocks[0], hidden_states, temb, adaln_indices, rotary_emb, rows, kernels)
    signal = hidden_states - before
    parallel = rows.parallel
    sum_over_tokens = None
    if parallel.ulysses > 1:
        for (start, end), real in zip(rows.spans, rows.real()):
            signal[:, start + real : end] = 0
        sum_over_tokens = parallel.sum_over_tokens
    compute = []
    for (start, end), cache in zip(rows.spans, caches):
        if cache is None:
            compute.append(True)
            continue
        decided = diffusion_cache.decide([(cache.state, 0)], signal[:, start:end], [cache.step], [cache.total], sum_over_tokens)
        compute.append(decided[0])
    out = hidden_states.clone()
    chosen = [i for i, c in enumerate(compute) if c]
    if chosen:
        index = torch.cat([torch.arange(*rows.spans[i], device=hidden_states.device) for i in chosen])
        sub = hidden_states.index_select(1, index)
        sub_rows = rows.select(chosen)
        sub_rotary = (rotary_emb[0].index_select(0, index), rotary_emb[1].index_select(0, index))
        sub_adaln = adaln_indices.index_select(0, index)
        for block in blocks[1:]:
            sub = run_block(block, sub, temb, sub_adaln, sub_rotary, sub_rows, kernels)
        out.index_copy_(1, index, sub)
    for (start, end), cache, computed in zip(rows.spans, caches, compute):
        if cache is None:
            continue
        if computed:
            diffusion_cache.record(cache.state, 0, signal[0, start:end], out[0, start:end] - hidden_states[0, start:end])
        else:
            out[0, start:end] = hidden_states[0, start:end] + cache.state.residual[0]
            diffusion_cache.record(cache.state, 0, signal[0, start:end], None)
    return out
