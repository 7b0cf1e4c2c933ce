"""HunyuanImage-3.0's text path as an out-of-tree vLLM model class (the `ar` stage's model).

vLLM 0.32 has no HunYuan V1 model of its own (it maps HunYuanMoEV1 to the Transformers backend, which
cannot read the release's fused, per-KV-head interleaved qkv). This class keeps the release's weight
names and our own modules (`omni_hunyuan.layers`: the interleaved qkv, the fp32 router, the [up; gate]
experts) and uses vLLM's paged `Attention` for the KV cache, its `ParallelLMHead` and `LogitsProcessor`:
so the weights load by name, without a remap, and vLLM owns scheduling and the cache.
Images in (``i2t``): a multimodal processor of our own (`HunyuanImage3Processor`) turns each image
into the release's joint block (`omni_hunyuan.understanding`: VAE and ViT slots, embedded by the
checkpoint's VAE, ``patch_embed``, Siglip2 tower and aligner); positions are 2-D as vLLM M-RoPE
positions (rows t, y, x: y and x rotate, t marks the block), and the block's span, which must attend
both ways, is recomputed after vLLM's causal attention in each layer (vLLM's CPU attention has no
bidirectional ranges: see `_Attention.forward`). Single-device only (no tensor parallelism).

For think/recaption-then-draw the ``dit`` stage reuses this stage's keys/values of the prompt and
reasoning instead of computing them again: a request whose sampling parameters carry `KV_EXPORT_ARG`
gets each token's rotated, normalised keys and values of every layer (`kv_rows`) as it computes them,
through the core's side channel for per-token rows (`HiddenStateCapture.omni_emit_rows`), so they
reach the ``dit`` stage as chunk data. (vLLM's own paged cache cannot be read back for this: on CPU it
keeps keys in an instruction-set-specific packed layout.) Other requests export nothing.

vLLM reads its config through transformers, which does not know ``hunyuan_image_3_moe`` (the release
sets ``auto_map`` to Tencent's remote code, which we never run): the stage points vLLM's
``hf_config_path`` at a derived config of a type transformers knows (`vllm_config_dir`).
This module imports vLLM: load it only in a worker.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from transformers import BatchFeature
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)

from omni_core.stages.vllm_bridge import HiddenStateCapture
from omni_hunyuan.ar import ARCHITECTURE, KV_EXPORT_ARG
from omni_hunyuan.config import HunyuanConfig
from omni_hunyuan.layers import MoE, RMSNorm, group_experts
from omni_hunyuan.pipeline import MAX_IMAGES
from omni_hunyuan.resolution import ratio_sizes
from omni_hunyuan.rope import apply_rope, rope_tables
from omni_hunyuan.tokens import SpecialTokens
from omni_hunyuan.understanding import (
    ENCODER_PREFIXES,
    HEAD_TOKENS,
    BlockShape,
    CondImage,
    ImageEncoder,
    preprocess,
    vit_processor,
)
from omni_hunyuan.vae import VAE_PREFIX

IMAGE_PREFIXES = (
    "patch_embed.", "final_layer.", "timestep_emb.", "time_embed.", "time_embed_2.", "guidance_emb.", "timestep_r_emb.",
    "vae.", "vision_model.", "vision_aligner.",
)


TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt", "chat_template*")
"""The checkpoint's tokenizer files (names as transformers saves them), linked beside the derived config."""


def vllm_config_dir(model_path: str | Path, cache: Path) -> Path:
    """A directory holding ``config.json`` for vLLM: the release config typed ``hunyuan_v1_moe`` (which
    transformers knows) with our architecture; every release field is kept for `HunyuanConfig`.

    The checkpoint's tokenizer files are linked beside it, so the engine's tokenizer is read from here:
    vLLM reads the tokenizer directory's config.json too, and the release's model type is one
    transformers does not know (vLLM retries that read, seconds of start-up, logging errors)."""
    release = json.loads((Path(model_path) / "config.json").read_text())
    config = HunyuanConfig.from_dict(release)
    derived = {
        **{k: v for k, v in release.items() if k not in ("auto_map", "rope_scaling")},
        "model_type": "hunyuan_v1_moe",
        "architectures": [ARCHITECTURE],
        "head_dim": config.head_dim,
        "num_experts": config.num_experts,
        "moe_topk": config.moe_topk,
        "intermediate_size": config.moe_intermediate_size,
        # mrope_section makes vLLM hand the model (t, y, x) positions (`get_mrope_input_positions`):
        # frequencies rotate with y and x only (`omni_hunyuan.rope`); t marks image spans.
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta, "mrope_section": [0, config.head_dim // 4, config.head_dim // 4]},
        "hunyuan_release_config": release,
    }
    cache.mkdir(parents=True, exist_ok=True)
    text = json.dumps(derived, indent=2)
    target = cache / "config.json"
    if not target.exists() or target.read_text() != text:
        staging = cache / f".config.json.{os.getpid()}"
        staging.write_text(text)
        os.replace(staging, target)  # atomic: a concurrent reader never sees half a file
    for pattern in TOKENIZER_FILES:
        for source in Path(model_path).glob(pattern):
            link = cache / source.name
            if not (link.is_symlink() and link.resolve() == source.resolve()):
                staging = cache / f".{source.name}.{os.getpid()}"
                staging.unlink(missing_ok=True)
                staging.symlink_to(source.resolve())
                os.replace(staging, link)  # atomic, as above
    return cache


@attrs.define
class _Export:
    """The keys/values a forward exports: those of batch `rows` (the requests that asked), per layer."""

    rows: torch.Tensor
    layers: list[torch.Tensor] = attrs.Factory(list)

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.layers.append(torch.stack([k[self.rows], v[self.rows]], dim=1))  # [rows, 2, kv_heads, head_dim]


class _Attention(nn.Module):
    """The release attention (fused interleaved qkv, QK norm after RoPE where ``use_qk_norm``) over vLLM's paged cache."""

    def __init__(self, config: HunyuanConfig, cache_config: Any, prefix: str) -> None:
        super().__init__()
        self.config = config
        self.qkv_proj = nn.Linear(config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.attention_bias)
        if config.use_qk_norm:
            self.query_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.key_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.attn = Attention(
            config.num_heads, config.head_dim, config.head_dim**-0.5, num_kv_heads=config.num_kv_heads,
            cache_config=cache_config, prefix=f"{prefix}.attn",
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, keep: _Export | None = None, spans: list[tuple[int, int, int]] = ()
    ) -> torch.Tensor:
        """`positions`: ``[tokens]`` or M-RoPE's ``[3, tokens]`` (t, y, x). `spans`: ``(first, start,
        end)`` rows of this batch: rows start..end-1 attend both ways to rows first..end-1."""
        c = self.config
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, c.num_kv_heads, c.heads_per_kv + 2, c.head_dim)
        q = qkv[:, :, : c.heads_per_kv].reshape(tokens, c.num_heads, c.head_dim)
        k = qkv[:, :, c.heads_per_kv]
        v = qkv[:, :, c.heads_per_kv + 1]
        yx = positions[1:].T if positions.ndim == 2 else torch.stack([positions, positions], dim=-1)
        cos, sin = rope_tables(yx[None], c.head_dim, c.rope_theta)
        # apply_rope takes [batch, heads, seq, dim]: here batch 1, tokens as the sequence.
        q, k = apply_rope(q.transpose(0, 1)[None], cos, sin), apply_rope(k.transpose(0, 1)[None], cos, sin)
        if c.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = q[0].transpose(0, 1).to(v.dtype), k[0].transpose(0, 1).to(v.dtype)
        if keep is not None:
            keep.add(k, v)
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1))
        if spans:
            # vLLM wrote the span's keys/values to its cache and attended causally; the span's rows
            # attend to everything before the span and to the whole span: recompute those rows.
            out = out.clone()
            for first, start, end in spans:
                keys = k[first:end].transpose(0, 1).repeat_interleave(c.heads_per_kv, dim=0)
                values = v[first:end].transpose(0, 1).repeat_interleave(c.heads_per_kv, dim=0)
                rows = torch.nn.functional.scaled_dot_product_attention(q[start:end].transpose(0, 1), keys, values)
                out[start:end] = rows.transpose(0, 1).reshape(end - start, -1).to(out.dtype)
        return self.o_proj(out)


class _Layer(nn.Module):
    def __init__(self, config: HunyuanConfig, cache_config: Any, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config, cache_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, keep: _Export | None = None, spans: list[tuple[int, int, int]] = ()
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), keep, spans)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, config: HunyuanConfig, cache_config: Any, prefix: str) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Layer(config, cache_config, f"{prefix}.layers.{i}") for i in range(config.num_layers))
        self.ln_f = RMSNorm(config.hidden_size, config.rms_norm_eps)


def kv_rows(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Per-token rows ``[tokens, layers * 2 * kv_heads * head_dim]`` of the layers' ``[tokens, 2, kv_heads,
    head_dim]`` keys and values: what `omni_hunyuan.transformer.PrefixCache.from_rows` reads."""
    return torch.stack(per_layer, dim=1).flatten(1)


class _TextModel(nn.Module):
    """The text path's modules and weights; `HunyuanImage3ForVLLM` adds the forward."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        self.config = HunyuanConfig.from_dict(getattr(hf_config, "hunyuan_release_config", None) or hf_config.to_dict())
        self.model = _Backbone(self.config, vllm_config.cache_config, f"{prefix}model" if not prefix else f"{prefix}.model")
        self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(self.config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.wte(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        encoding = hasattr(self, "encoder")
        for name, tensor in weights:
            if encoding and name.startswith(ENCODER_PREFIXES) and not name.startswith("vae.decoder."):
                # The image encoder (images in): the VAE in fp32, the rest in the model dtype.
                vae = name.startswith(VAE_PREFIX)
                name = f"encoder.{name}"
                with torch.no_grad():
                    params[name].data = tensor.to(device=params[name].device, dtype=torch.float32 if vae else params[name].dtype)
                loaded.add(name)
                continue
            if name.startswith(IMAGE_PREFIXES):
                continue
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            with torch.no_grad():
                if loader is not None:
                    loader(param, tensor)
                else:
                    # The router stays fp32 (the release keeps it so); everything else takes the model dtype.
                    param.data = tensor.to(device=param.device, dtype=torch.float32 if ".mlp.gate." in name else param.dtype)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)[:8]}")
        # Grouped GEMMs where they apply, as `omni_hunyuan.weights.load_transformer` runs them; here, before
        # vLLM captures its graphs, so a dit stage sharing these modules (share_model_with) takes them grouped.
        group_experts(self.model.layers)
        return loaded


class HunyuanImage3ProcessingInfo(BaseProcessingInfo):
    """Images only, up to `MAX_IMAGES` per prompt; sizes and token ids from the checkpoint."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": MAX_IMAGES}

    @functools.cached_property
    def release(self) -> HunyuanConfig:
        hf_config = self.get_hf_config()
        return HunyuanConfig.from_dict(getattr(hf_config, "hunyuan_release_config", None) or hf_config.to_dict())

    @functools.cached_property
    def tokens(self) -> SpecialTokens:
        return SpecialTokens.from_tokenizer(self.get_tokenizer(), self.release.image_base_size)

    @functools.cached_property
    def vit_processor(self) -> Any:
        return vit_processor(self.release)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        c = self.release
        sizes = ratio_sizes(c.image_base_size, len(self.tokens.ratios))
        vae = max((w // c.vae_downsample) * (h // c.vae_downsample) for w, h in sizes)
        vit = int((c.raw.get("vit_processor") or {}).get("max_num_patches", 0))
        return {"image": HEAD_TOKENS + vae + 1 + vit + 1}


class HunyuanImage3DummyInputs(BaseDummyInputsBuilder[HunyuanImage3ProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return "<img>" * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any = None) -> Any:
        size = self.info.release.image_base_size
        return {"image": self._get_dummy_images(width=size, height=size, num_images=mm_counts.get("image", 0))}


class HunyuanImage3Processor(BaseMultiModalProcessor[HunyuanImage3ProcessingInfo]):
    """Each image (`omni_hunyuan.understanding.preprocess`) -> its fields, and its ``<img>`` -> its block."""

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        info = self.info
        stretch = bool(hf_kwargs.get("align_image_size", False))  # (a request's mm_processor_kwargs: `pipeline.ALIGN_PARAM`)
        images = [preprocess(image, info.release, len(info.tokens.ratios), info.vit_processor, stretch) for image in hf_data.get("images") or ()]  # type: ignore[union-attr]
        return BatchFeature(
            {
                "vae_pixels": [image.vae_pixels for image in images],
                "vit_pixels": [image.vit_pixels for image in images],
                "vit_mask": [image.vit_mask for image in images],
                "vit_grid": torch.tensor([image.vit_grid for image in images], dtype=torch.long).reshape(-1, 2),
                "ratio": torch.tensor([image.ratio for image in images], dtype=torch.long),
            }
        )

    def _get_mm_fields_config(self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]) -> Mapping[str, MultiModalFieldConfig]:
        return {key: MultiModalFieldConfig.batched("image") for key in ("vae_pixels", "vit_pixels", "vit_mask", "vit_grid", "ratio")}

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any) -> Sequence[PromptUpdate]:
        tokens = self.info.tokens

        def replace(index: int) -> PromptUpdateDetails:
            ids = _shape(out_mm_kwargs["image"][index], self.info.release.vae_downsample).ids(tokens)
            return PromptUpdateDetails.select_token_ids(ids, [tokens.image, tokens.joint_img_sep])

        return [PromptReplacement(modality="image", target=[tokens.image], replacement=replace)]


def _shape(item: Any, downsample: int) -> BlockShape:
    """The block layout of one processed image (a vLLM multimodal item of `HunyuanImage3Processor`)."""
    pixels = item["vae_pixels"].data
    grid = item["vit_grid"].data.tolist()
    return BlockShape(int(item["ratio"].data), (pixels.shape[1] // downsample, pixels.shape[2] // downsample), (grid[0], grid[1]), item["vit_pixels"].data.shape[0])


@MULTIMODAL_REGISTRY.register_processor(HunyuanImage3Processor, info=HunyuanImage3ProcessingInfo, dummy_inputs=HunyuanImage3DummyInputs)
class HunyuanImage3ForVLLM(HiddenStateCapture, _TextModel, SupportsMultiModal, SupportsMRoPE):
    """vLLM model class of HunyuanImage-3.0's text path, images in; weights under the release's names
    (the image-generation parts skipped).

    Mixes in the core's `HiddenStateCapture` for its side channel and batch layout only: the rows it
    sends are the keys/values of the requests that asked for them (`KV_EXPORT_ARG`), not hidden states.
    M-RoPE positions (`get_mrope_input_positions`): y and x rotate; t is a token's index, except in an
    image block's bidirectional span, where it is the span's end (so `forward` finds the spans).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        mm = vllm_config.model_config.multimodal_config
        split = vllm_config.cache_config.enable_prefix_caching or vllm_config.scheduler_config.enable_chunked_prefill
        if mm is not None and mm.get_limit_per_prompt("image") > 0 and split:
            raise ValueError(
                "HunyuanImage-3.0 with images needs vLLM's enable_prefix_caching and enable_chunked_prefill off "
                "(an image block attends both ways within one forward); or set limit_mm_per_prompt image 0"
            )
        self.encoder = ImageEncoder(self.config)  # (its VAE has no decoder: the decoder's weights are skipped on load)
        self.tokenizer_path = vllm_config.model_config.tokenizer

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return "<img>" if modality.startswith("image") else None

    def get_language_model(self) -> nn.Module:
        return self

    @functools.cached_property
    def special_tokens(self) -> SpecialTokens:
        """The checkpoint's special token ids (``<timestep>``, ``<joint_img_sep>``), as the processor reads them."""
        from transformers import AutoTokenizer

        return SpecialTokens.from_tokenizer(AutoTokenizer.from_pretrained(self.tokenizer_path), self.config.image_base_size)

    def embed_multimodal(self, **kwargs: object) -> tuple[torch.Tensor, ...]:
        """Each image's embedded run (`ImageEncoder.embed`: VAE slots, separator, ViT slots)."""
        pixels = kwargs.get("vae_pixels")
        if pixels is None:
            return ()
        separator = self.model.wte(torch.tensor([self.special_tokens.joint_img_sep], device=self.model.wte.weight.device))[0]
        out = []
        for index in range(len(pixels)):  # type: ignore[arg-type]
            grid = kwargs["vit_grid"][index].tolist()  # type: ignore[index]
            image = CondImage(
                ratio=int(kwargs["ratio"][index]),  # type: ignore[index]
                vae_pixels=pixels[index],  # type: ignore[index]
                vit_pixels=kwargs["vit_pixels"][index],  # type: ignore[index]
                vit_mask=kwargs["vit_mask"][index],  # type: ignore[index]
                vit_grid=(int(grid[0]), int(grid[1])),
                downsample=self.config.vae_downsample,
            )
            out.append(self.encoder.embed(image, separator).to(self.model.wte.weight.dtype))
        return tuple(out)

    def embed_input_ids(
        self, input_ids: torch.Tensor, multimodal_embeddings: Any = None, *, is_multimodal: torch.Tensor | None = None, **_: Any
    ) -> torch.Tensor:
        embeds = self.model.wte(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return embeds
        from vllm.model_executor.models.utils import _merge_multimodal_embeddings

        embeds = _merge_multimodal_embeddings(embeds, multimodal_embeddings, is_multimodal)
        is_timestep = input_ids == self.special_tokens.timestep
        if bool(is_timestep.any()):
            embeds[is_timestep] = self.encoder.timestep_token().to(embeds.dtype)
        return embeds

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        positions = torch.arange(len(input_tokens)).repeat(3, 1)
        for feature in mm_features:
            start = feature.mm_position.offset
            shape = _shape(feature.data, self.config.vae_downsample)
            positions[1:, start : start + shape.length] = shape.positions(start).T
            first, end = shape.span(start)
            positions[0, first:end] = end
        return positions, 0

    def _spans(self, positions: torch.Tensor, layout: list[Any]) -> list[tuple[int, int, int]]:
        """This batch's bidirectional spans as ``(first row of the sequence, span start, span end)``."""
        if positions.ndim != 2:
            return []
        spans = []
        for request_id, start, end, position in layout:
            index = torch.arange(position, position + end - start, device=positions.device)
            marks = positions[0, start:end]
            inside = (marks != index).nonzero().flatten().tolist()
            if not inside:
                continue
            if position != 0:
                raise RuntimeError(
                    f"request {request_id}: an image block is computed in a later step than its prompt's start "
                    "(chunked prefill or a prefix-cache hit): the ar stage runs with both off (HunyuanAR.engine_args)"
                )
            # With the prompt from its start in this batch, row i is sequence index i, and a span's rows
            # all carry its end as their mark.
            marks_inside = marks[inside].tolist()
            for end_mark in sorted(set(marks_inside)):
                rows = [row for row, mark in zip(inside, marks_inside) if mark == end_mark]
                if rows[-1] + 1 != end_mark or len(rows) != end_mark - rows[0]:
                    raise RuntimeError(f"request {request_id}: an image block is split between steps (chunked prefill)")
                spans.append((start, start + rows[0], start + end_mark))
        return spans

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        layout = self.omni_batch_layout()
        exporting = [rows for rows in layout if self.omni_extra_args(rows.request_id).get(KV_EXPORT_ARG)]
        keep = None
        if exporting:
            keep = _Export(torch.cat([torch.arange(rows.start, rows.end) for rows in exporting]).to(positions.device))
        spans = self._spans(positions, layout)
        hidden = inputs_embeds if inputs_embeds is not None else self.model.wte(input_ids)
        for layer in self.model.layers:
            hidden = layer(positions, hidden, keep, spans)
        if keep is not None:
            rows = kv_rows(keep.layers)
            offset = 0
            for request_id, start, end, position in exporting:
                self.omni_emit_rows(request_id, position, rows[offset : offset + end - start].to("cpu", copy=True))
                offset += end - start
        return self.model.ln_f(hidden)
