"""HunyuanImage-3.0's text path as an out-of-tree vLLM model class (the `ar` stage's model).

vLLM 0.32 has no HunYuan V1 model of its own (it maps HunYuanMoEV1 to the Transformers backend, which
cannot read the release's fused, per-KV-head interleaved qkv). This class keeps the release's weight
names and our own modules (`omni_hunyuan.layers`: the interleaved qkv, the fp32 router, the [up; gate]
experts) and uses vLLM's paged `Attention` for the KV cache, its `ParallelLMHead` and `LogitsProcessor`:
so the weights load by name, without a remap, and vLLM owns scheduling and the cache.
Text positions are 1-D (y = x = position): the 2-D RoPE of image tokens (I2T prompts) needs mrope
positions, not wired yet. Single-device only (no tensor parallelism).

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

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from omni_core.stages.vllm_bridge import HiddenStateCapture
from omni_hunyuan.ar import ARCHITECTURE, KV_EXPORT_ARG
from omni_hunyuan.config import HunyuanConfig
from omni_hunyuan.layers import MoE, RMSNorm
from omni_hunyuan.rope import apply_rope, rope_tables

IMAGE_PREFIXES = ("patch_embed.", "final_layer.", "timestep_emb.", "time_embed.", "time_embed_2.", "vae.", "vision_model.", "vision_aligner.")


def vllm_config_dir(model_path: str | Path, cache: Path) -> Path:
    """A directory holding ``config.json`` for vLLM: the release config typed ``hunyuan_v1_moe`` (which
    transformers knows) with our architecture; every release field is kept for `HunyuanConfig`."""
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
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "hunyuan_release_config": release,
    }
    cache.mkdir(parents=True, exist_ok=True)
    text = json.dumps(derived, indent=2)
    target = cache / "config.json"
    if not target.exists() or target.read_text() != text:
        staging = cache / f".config.json.{os.getpid()}"
        staging.write_text(text)
        os.replace(staging, target)  # atomic: a concurrent reader never sees half a file
    return cache


class _Attention(nn.Module):
    """The release attention (fused interleaved qkv, QK norm after RoPE) over vLLM's paged cache."""

    def __init__(self, config: HunyuanConfig, cache_config: Any, prefix: str) -> None:
        super().__init__()
        self.config = config
        self.qkv_proj = nn.Linear(config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.attention_bias)
        self.query_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.key_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.attn = Attention(
            config.num_heads, config.head_dim, config.head_dim**-0.5, num_kv_heads=config.num_kv_heads,
            cache_config=cache_config, prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
        c = self.config
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, c.num_kv_heads, c.heads_per_kv + 2, c.head_dim)
        q = qkv[:, :, : c.heads_per_kv].reshape(tokens, c.num_heads, c.head_dim)
        k = qkv[:, :, c.heads_per_kv]
        v = qkv[:, :, c.heads_per_kv + 1]
        cos, sin = rope_tables(torch.stack([positions, positions], dim=-1)[None], c.head_dim, c.rope_theta)
        # apply_rope takes [batch, heads, seq, dim]: here batch 1, tokens as the sequence.
        q = self.query_layernorm(apply_rope(q.transpose(0, 1)[None], cos, sin))[0].transpose(0, 1)
        k = self.key_layernorm(apply_rope(k.transpose(0, 1)[None], cos, sin))[0].transpose(0, 1).to(v.dtype)
        if keep is not None:
            keep.append(torch.stack([k, v], dim=1))  # [tokens, 2, kv_heads, head_dim]
        out = self.attn(q.to(v.dtype).reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1))
        return self.o_proj(out)


class _Layer(nn.Module):
    def __init__(self, config: HunyuanConfig, cache_config: Any, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config, cache_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), keep)
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
        for name, tensor in weights:
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
        return loaded


class HunyuanImage3ForVLLM(HiddenStateCapture, _TextModel):
    """vLLM model class of the text path; weights under the release's names (image parts skipped).

    Mixes in the core's `HiddenStateCapture` for its side channel only: the rows it sends are the
    keys/values of the requests that asked for them (`KV_EXPORT_ARG`), not hidden states.
    """

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        exporting = [rows for rows in self.omni_batch_layout() if self.omni_extra_args(rows.request_id).get(KV_EXPORT_ARG)]
        keep: list[torch.Tensor] | None = [] if exporting else None
        hidden = inputs_embeds if inputs_embeds is not None else self.model.wte(input_ids)
        for layer in self.model.layers:
            hidden = layer(positions, hidden, keep)
        if keep:
            rows = kv_rows(keep)
            for request_id, start, end, position in exporting:
                self.omni_emit_rows(request_id, position, rows[start:end].to("cpu", copy=True))
        return self.model.ln_f(hidden)
