"""HunyuanImage-3.0's transformer: one MoE decoder that writes text and predicts image-flow velocity.

Text runs causally. For an image the sequence is ``... <timestep> <img>*(h*w) <eoi>``: the ``<timestep>``
slot holds a timestep embedding (a -Distil checkpoint's ``<guidance>`` and ``<timestep_r>`` after it: the
guidance scale's and the next step's), the ``<img>`` slots the noisy latents through `UNetDown`, the image tokens
see each other both ways, and the final hidden states at the image slots (before ``ln_f``) go through
`UNetUp` as the velocity. Text never attends to the image, and no image token's output depends on
``<eoi>`` (image rows cannot see it), so a denoising step only needs the keys/values of the text prefix,
computed once per request (`encode_prefix`), plus a forward over ``<timestep>`` and the image tokens
(`velocity`): the same numbers as a forward over the whole sequence, at a fraction of the work.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from omni_core.stages import diffusion_cache
from omni_hunyuan.config import HunyuanConfig
from omni_hunyuan.layers import (
    EAGER,
    DecoderLayer,
    ImageRowsMask,
    LayerKernels,
    RMSNorm,
)
from omni_hunyuan.patches import TimestepEmbedder, UNetDown, UNetUp
from omni_hunyuan.rope import image_positions, rope_tables, text_positions

KV = tuple[torch.Tensor, torch.Tensor]


@attrs.frozen
class PrefixCache:
    """Per-layer keys/values ``[B, kv_heads, length, head_dim]`` of a batch of text prefixes.

    Rows may be shorter than `length` (`lengths` per row): `concat` pads them on the left (each row's
    prefix ends at `length`) so prompts of different lengths share one denoising forward, and
    `velocity` leaves the padding out (`ImageRowsMask`).
    """

    layers: tuple[KV, ...]
    lengths: tuple[int, ...]

    @property
    def length(self) -> int:
        return max(self.lengths)

    @staticmethod
    def from_rows(rows: torch.Tensor, config: HunyuanConfig, *, device: Any = None, dtype: torch.dtype | None = None) -> PrefixCache:
        """The cache of one sequence from per-token rows ``[n, layers * 2 * kv_heads * head_dim]`` (each
        token's keys then values, layer by layer: what the ``ar`` stage's vLLM model exports,
        `omni_hunyuan.vllm_model.kv_rows`)."""
        n = rows.shape[0]
        shaped = rows.to(device=device, dtype=dtype).view(n, config.num_layers, 2, config.num_kv_heads, config.head_dim)
        layers = tuple(
            (shaped[:, i, 0].transpose(0, 1)[None].contiguous(), shaped[:, i, 1].transpose(0, 1)[None].contiguous())
            for i in range(config.num_layers)
        )
        return PrefixCache(layers, (n,))

    @staticmethod
    def concat(caches: list[PrefixCache]) -> PrefixCache:
        """One cache of every row of `caches`, each padded with zeros on the left to the longest."""
        if len(caches) == 1:
            return caches[0]
        longest = max(cache.length for cache in caches)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0, longest - t.shape[2], 0))

        layers = tuple(
            (torch.cat([pad(c.layers[i][0]) for c in caches]), torch.cat([pad(c.layers[i][1]) for c in caches]))
            for i in range(len(caches[0].layers))
        )
        return PrefixCache(layers, tuple(n for cache in caches for n in cache.lengths))


class Backbone(nn.Module):
    """``model.*`` of the release: token embedding ``wte``, the decoder layers, final norm ``ln_f``."""

    def __init__(self, config: HunyuanConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.ln_f = RMSNorm(config.hidden_size, config.rms_norm_eps)


class HunyuanImage3(nn.Module):
    """The release's ``HunyuanImage3ForCausalMM`` minus its VAE and vision tower (loaded on their own)."""

    def __init__(self, config: HunyuanConfig) -> None:
        super().__init__()
        if config.patch_size != 1:
            raise ValueError(f"patch_size {config.patch_size} is not supported (the release uses 1)")
        self.config = config
        hidden, latent, patch_hidden = config.hidden_size, config.latent_channels, config.patch_embed_hidden_dim
        self.model = Backbone(config)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.timestep_emb = TimestepEmbedder(hidden)  # the <timestep> token
        if config.cfg_distilled:
            self.guidance_emb = TimestepEmbedder(hidden)  # the <guidance> token: 1000 x the guidance scale
        if config.use_meanflow:
            self.timestep_r_emb = TimestepEmbedder(hidden)  # the <timestep_r> token: the next step's timestep
        self.time_embed = TimestepEmbedder(hidden)  # conditions UNetDown
        self.time_embed_2 = TimestepEmbedder(hidden)  # conditions UNetUp
        self.patch_embed = UNetDown(latent, hidden, patch_hidden)
        self.final_layer = UNetUp(latent, hidden, patch_hidden)
        self.kernels = EAGER  # what runs a denoising forward's layers (`compile_layers`)

    def compile_layers(self) -> None:
        """Denoising forwards run the layers' pieces around attention and the experts compiled with
        `torch.compile` (`LayerKernels`), and the UNet embedder and head compiled whole (their norms,
        activations and modulation fused around the convolutions); text forwards stay eager (their
        lengths vary per request)."""
        self.kernels = LayerKernels.compiled()
        self.patch_embed.compile(dynamic=None)
        self.final_layer.compile(dynamic=None)

    # -- the decoder over new tokens, given what is cached -------------------------------------------

    def _run(
        self, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | ImageRowsMask, past: PrefixCache | None,
        kernels: LayerKernels = EAGER,
    ) -> tuple[torch.Tensor, tuple[KV | None, ...]]:
        """Hidden states (before ``ln_f``) of new tokens, and the caches of past + new tokens (None
        under an `ImageRowsMask`: a denoising forward keeps none)."""
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        batch = embeds.shape[0]
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
        hidden = embeds
        caches = []
        for index, layer in enumerate(self.model.layers):
            hidden, cache = layer(hidden, cos, sin, mask, None if past is None else past.layers[index], kernels)
            caches.append(cache)
        return hidden, tuple(caches)

    def _causal_mask(self, new: int, past: int, device: torch.device) -> torch.Tensor:
        query = torch.arange(past, past + new, device=device)[:, None]
        key = torch.arange(past + new, device=device)[None, :]
        return (key <= query)[None, None]

    # -- text ------------------------------------------------------------------------------------------

    def text_forward(self, input_ids: torch.Tensor, past: PrefixCache | None = None) -> tuple[torch.Tensor, PrefixCache]:
        """fp32 logits ``[B, S, vocab]`` of causal text tokens after `past`, and the extended cache."""
        start = 0 if past is None else past.length
        seq = input_ids.shape[1]
        positions = text_positions(start, seq, input_ids.device)[None]
        mask = self._causal_mask(seq, start, input_ids.device)
        hidden, caches = self._run(self.model.wte(input_ids), positions, mask, past)
        logits = self.lm_head(self.model.ln_f(hidden)).float()
        return logits, PrefixCache(caches, (start + seq,) * input_ids.shape[0])

    def prompt_forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, spans: tuple[tuple[int, int], ...] = (), last: bool = False,
    ) -> tuple[torch.Tensor, PrefixCache]:
        """fp32 logits ``[1, S, vocab]`` of one prompt given as embeddings ``[1, S, hidden]`` and (y, x)
        `positions` ``[1, S, 2]``: causal, but each of `spans` ([start, end)) attends both ways within
        itself (a conditioning image's block, `omni_hunyuan.understanding`). `last`: the last token's only."""
        seq = embeds.shape[1]
        hidden, caches = self._run(embeds, positions, self._span_mask(seq, spans, embeds.device), None)
        if last:
            hidden = hidden[:, -1:]
        return self.lm_head(self.model.ln_f(hidden)).float(), PrefixCache(caches, (seq,))

    def _span_mask(self, seq: int, spans: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
        """Causal, but each of `spans` ([start, end)) attends both ways within itself."""
        mask = self._causal_mask(seq, 0, device)[0, 0].clone()
        for start, end in spans:
            mask[start:end, start:end] = True
        return mask[None, None]

    @torch.no_grad()
    def greedy(
        self, input_ids: torch.Tensor, max_new_tokens: int, stop_ids: frozenset[int] = frozenset(),
        prompt: tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]] | None = None,
    ) -> list[int]:
        """Greedy continuation of one prompt ``[1, S]`` with a KV cache (the text path's own decode);
        `prompt` (embeddings, positions, spans: `prompt_forward`) replaces the ids' plain embedding."""
        logits, cache = self.text_forward(input_ids) if prompt is None else self.prompt_forward(*prompt)
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if token in stop_ids:
                break
            logits, cache = self.text_forward(torch.tensor([[token]], device=input_ids.device), cache)
        return tokens

    # -- image -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prefix(self, prefix_ids: torch.Tensor, past: PrefixCache | None = None) -> PrefixCache:
        """Keys/values of the text before ``<timestep>`` (``[B, L]``, equal lengths): once per request.

        With `past` (the keys/values of the tokens before `prefix_ids`, e.g. the ``ar`` stage's), only
        `prefix_ids` run, after them; the cache returned covers both.
        """
        start = 0 if past is None else past.length
        seq = prefix_ids.shape[1]
        if seq == 0 and past is not None:
            return past
        positions = text_positions(start, seq, prefix_ids.device)[None]
        mask = self._causal_mask(seq, start, prefix_ids.device)
        _, caches = self._run(self.model.wte(prefix_ids), positions, mask, past)
        return PrefixCache(caches, (start + seq,) * prefix_ids.shape[0])

    @torch.no_grad()
    def encode_prompt_prefix(self, embeds: torch.Tensor, positions: torch.Tensor, spans: tuple[tuple[int, int], ...] = ()) -> PrefixCache:
        """`encode_prefix` of rows given as embeddings ``[B, L, hidden]`` that share (y, x) `positions`
        ``[L, 2]`` and two-way `spans` (input images' blocks: `omni_hunyuan.understanding.layout`)."""
        seq = embeds.shape[1]
        _, caches = self._run(embeds, positions[None], self._span_mask(seq, spans, embeds.device), None)
        return PrefixCache(caches, (seq,) * embeds.shape[0])

    def velocity(
        self, prefix: PrefixCache, latents: torch.Tensor, timestep: torch.Tensor, cache_rows: list[Any] | None = None,
        steps: list[int] | None = None, totals: list[int] | None = None, repeats: list[int] | None = None,
        guidance: torch.Tensor | None = None, timestep_r: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flow velocity ``[B, C, h, w]`` of noisy `latents` at `timestep` (``[B]``, sigma * 1000).

        With `repeats`, `latents` and `timestep` hold one entry per image and entry i stands for
        ``repeats[i]`` consecutive rows (its CFG branches: the same latents and timestep under
        different prefixes), so the UNet embedder runs once per image, not once per row.

        Row b's new tokens are the k step tokens at index L_b (its prefix length) and the h*w image
        tokens from L_b + k: ``<timestep>`` (k = 1), on a -Distil checkpoint followed by ``<guidance>``
        (`guidance`, ``[B]``: 1000 x the guidance scale; cfg_distilled) and ``<timestep_r>``
        (`timestep_r`, ``[B]``: the next step's sigma * 1000; use_meanflow). A step token sees the
        prefix and the step tokens up to itself, the image tokens the prefix, the step tokens and every
        image token; nobody sees another row's padding.

        `cache_rows` (row b's ``(CacheState | None, branch)``, with the rows' `steps` and `totals`)
        turns on the core's first-block caching (`omni_core.stages.diffusion_cache`): every row runs
        layer 0, and only the rows whose layer-0 residual changed enough run the rest; the others add
        the residual the rest added at their last computed step.
        """
        _, _, height, width = latents.shape
        device = latents.device
        dtype = self.model.wte.weight.dtype
        image_tokens = self.patch_embed(latents.to(dtype), self.time_embed(timestep).to(dtype))
        scalars = [(self.timestep_emb, timestep)]
        for flag, name, values in ((self.config.cfg_distilled, "guidance", guidance), (self.config.use_meanflow, "timestep_r", timestep_r)):
            if flag != (values is not None):
                raise ValueError(f"{name} is needed by, and only by, a checkpoint with {name}_emb")
            if flag:
                scalars.append((getattr(self, f"{name}_emb"), values))
        if repeats is not None:  # (expanded views concatenated: no counts tensor copied to the device each step)
            image_tokens = torch.cat([t[None].expand(n, -1, -1) for t, n in zip(image_tokens, repeats, strict=True)])
            scalars = [(embedder, torch.cat([t[None].expand(n) for t, n in zip(values, repeats, strict=True)])) for embedder, values in scalars]
            timestep = scalars[0][1]
        k = len(scalars)
        step_tokens = [embedder(values).to(dtype)[:, None] for embedder, values in scalars]
        embeds = torch.cat([*step_tokens, image_tokens.to(dtype)], dim=1)
        positions = torch.stack(
            [torch.cat([text_positions(n, k, device), image_positions(n + k, height, width, device)]) for n in prefix.lengths]
        )
        # The step tokens are text: each sees the prefix and those up to itself, not the image after them (`ImageRowsMask`).
        mask = ImageRowsMask(prefix.lengths, prefix.length, k)
        if cache_rows is not None and any(state is not None for state, _ in cache_rows):
            assert steps is not None and totals is not None
            hidden = self._cached_run(embeds, positions, mask, prefix, cache_rows, steps, totals)
        else:
            hidden, _ = self._run(embeds, positions, mask, prefix, self.kernels)
        return self.final_layer(hidden[:, k:], self.time_embed_2(timestep).to(dtype), height, width)

    def _cached_run(
        self, embeds: torch.Tensor, positions: torch.Tensor, mask: ImageRowsMask, prefix: PrefixCache,
        cache_rows: list[Any], steps: list[int], totals: list[int],
    ) -> torch.Tensor:
        """`_run` with first-block caching (see `velocity`); the hidden states of every row."""
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        layers = self.model.layers
        first, _ = layers[0](embeds, cos, sin, mask, prefix.layers[0], self.kernels)
        signal = first - embeds
        compute = diffusion_cache.decide(cache_rows, signal, steps, totals)

        def rest(index: list[int], rows: torch.Tensor) -> torch.Tensor:
            hidden, sub_cos, sub_sin = (t.index_select(0, rows) for t in (first, cos, sin))
            sub_mask = mask.rows(index)
            for number, layer in enumerate(layers[1:], start=1):
                past = tuple(t.index_select(0, rows) for t in prefix.layers[number])
                hidden, _ = layer(hidden, sub_cos, sub_sin, sub_mask, past, self.kernels)
            return hidden

        return diffusion_cache.finish_rows(cache_rows, first, signal, compute, rest)

    def velocity_from_ids(
        self, input_ids: torch.Tensor, latents: torch.Tensor, timestep: torch.Tensor, image_token_id: int, **scalars: Any,
    ) -> torch.Tensor:
        """`velocity` for whole rows ``prefix <timestep> <img>*(h*w) <eoi>...`` (same layout in every row;
        a -Distil checkpoint's step tokens and their `scalars` as `velocity` takes them).

        `image_token_id` comes from the tokenizer (`SpecialTokens.image`), never a constant.
        """
        span = latents.shape[2] * latents.shape[3]
        is_image = input_ids == image_token_id
        starts = is_image.int().argmax(dim=1)
        if not bool((starts == starts[0]).all()) or not bool((is_image.sum(dim=1) == span).all()):
            raise ValueError(f"every row needs one span of {span} <img> tokens, at the same index")
        return self.velocity(self.encode_prefix(input_ids[:, : int(starts[0]) - self.config.step_tokens]), latents, timestep, **scalars)
