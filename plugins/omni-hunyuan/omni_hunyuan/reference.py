"""Library references for the equality tests, on the same weights as our modules.

- Text: transformers' ``HunYuanMoEV1ForCausalLM`` is the release's LM block (QK norm after RoPE, fp32
  softmax-top-k-renormalise router, one shared expert). Its weights are the release's, remapped
  (FAMILIES.md 2.5): ``wte``/``ln_f`` renamed, ``qkv_proj`` de-interleaved, the expert halves swapped
  from ``[up; gate]`` to ``[gate; up]`` and stacked, the shared MLP split.
- Image: nemo-automodel's Apache-2.0 ``hunyuan_image3`` (``HunyuanImage3ForCausalMM``), loaded through its
  own state-dict adapter from the release keys, with its torch backends. It has no VAE: the sampler
  comparison stops at the latents.
Neither is used to serve; they exist so that our code is checked against someone else's.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

from omni_hunyuan.config import HunyuanConfig
from omni_hunyuan.weights import NON_TRANSFORMER_PREFIXES, read_tensors


def hunyuan_v1_state_dict(release: dict[str, torch.Tensor], config: HunyuanConfig) -> dict[str, torch.Tensor]:
    """Release transformer keys -> ``HunYuanMoEV1ForCausalLM`` keys."""
    out: dict[str, torch.Tensor] = {}
    d, g, nkv, hidden = config.head_dim, config.heads_per_kv, config.num_kv_heads, config.hidden_size
    inter = config.moe_intermediate_size
    for layer in range(config.num_layers):
        src = f"model.layers.{layer}."
        qkv = release.pop(src + "self_attn.qkv_proj.weight").view(nkv, g + 2, d, hidden)
        out[src + "self_attn.q_proj.weight"] = qkv[:, :g].reshape(nkv * g * d, hidden)
        out[src + "self_attn.k_proj.weight"] = qkv[:, g].reshape(nkv * d, hidden)
        out[src + "self_attn.v_proj.weight"] = qkv[:, g + 1].reshape(nkv * d, hidden)
        shared = release.pop(src + "mlp.shared_mlp.gate_and_up_proj.weight")
        half = shared.shape[0] // 2
        out[src + "mlp.shared_mlp.up_proj.weight"] = shared[:half]
        out[src + "mlp.shared_mlp.gate_proj.weight"] = shared[half:]
        out[src + "mlp.shared_mlp.down_proj.weight"] = release.pop(src + "mlp.shared_mlp.down_proj.weight")
        fused = [release.pop(f"{src}mlp.experts.{e}.gate_and_up_proj.weight") for e in range(config.num_experts)]
        out[src + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[inter:], w[:inter]]) for w in fused])
        out[src + "mlp.experts.down_proj"] = torch.stack(
            [release.pop(f"{src}mlp.experts.{e}.down_proj.weight") for e in range(config.num_experts)]
        )
    for key, value in release.items():
        key = key.replace("model.wte.", "model.embed_tokens.").replace("model.ln_f.", "model.norm.")
        out[key] = value
    return out


def hunyuan_v1_model(model_path: str | Path) -> Any:
    """``HunYuanMoEV1ForCausalLM`` (fp32, eval) on the checkpoint's transformer weights, strictly loaded."""
    from transformers import HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM

    config = HunyuanConfig.from_pretrained(model_path)
    if config.num_shared_experts != 1:
        raise ValueError("HunYuanMoEV1 sizes its shared MLP like one expert: the reference needs exactly one")
    image_prefixes = ("patch_embed.", "final_layer.", "timestep_emb.", "time_embed.", "time_embed_2.")
    release = read_tensors(model_path, exclude=NON_TRANSFORMER_PREFIXES + image_prefixes)
    hf_config = HunYuanMoEV1Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_experts=config.num_experts,
        moe_topk=config.moe_topk,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=int(config.raw.get("max_position_embeddings", 2048)),
        attention_bias=config.attention_bias,
        tie_word_embeddings=False,
        # The checkpoint's own ids: HunYuanMoEV1's defaults (pad 0) would mask our bos out of the prompt.
        bos_token_id=config.raw.get("bos_token_id"),
        eos_token_id=config.raw.get("eos_token_id"),
        pad_token_id=config.raw.get("pad_token_id"),
    )
    model = HunYuanMoEV1ForCausalLM(hf_config).to(torch.float32)
    model.load_state_dict(hunyuan_v1_state_dict(release, config), strict=True)
    return model.eval()


def nemo_model(model_path: str | Path, image_token_id: int, timestep_token_id: int) -> Any:
    """nemo-automodel's ``HunyuanImage3ForCausalMM`` (fp32, torch backends) from the release keys."""
    import json

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.hunyuan_image3 import (
        HunyuanImage3Config,
        HunyuanImage3ForCausalMM,
    )

    raw = json.loads((Path(model_path) / "config.json").read_text())
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = HunyuanImage3Config(
        **fields, image_token_id=image_token_id, timestep_token_id=timestep_token_id, torch_dtype="float32"
    )
    backend = BackendConfig(attn="sdpa", linear="torch", experts="torch", dispatcher="torch", rms_norm="torch_fp32")
    model = HunyuanImage3ForCausalMM(config, backend=backend)
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    state = model.state_dict_adapter.from_hf(read_tensors(model_path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"nemo reference: missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}")
    return model.float().eval()


class NemoPrompts:
    """The prompt tokenizer nemo's ``HunyuanImage3Pipeline`` asks for the ids around the image span:
    ours (`t2i_rows`), for a square image of ratio index `ratio` and `side` latent tokens a side."""

    def __init__(self, tokenizer: Any, tokens: Any, ratio: int, side: int) -> None:
        self.tokenizer, self.tokens, self.ratio, self.side = tokenizer, tokens, ratio, side

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        return width, height

    def __call__(self, prompt: str, height: int, width: int) -> dict[str, torch.Tensor]:
        import nemo_automodel.components.models.hunyuan_image3.pipeline as nemo_pipeline

        from omni_hunyuan.prompt import t2i_rows

        rows = t2i_rows(self.tokenizer, self.tokens, prompt, self.ratio, self.side, self.side, cfg=True)
        prefix_end = rows.prefix.shape[1] + 1  # through <timestep>
        return {
            nemo_pipeline.PROMPT_IDS_KEY: rows.rows[0, :prefix_end],
            nemo_pipeline.UNCOND_PROMPT_IDS_KEY: rows.rows[1, :prefix_end],
            nemo_pipeline.PROMPT_SUFFIX_IDS_KEY: rows.rows[0, prefix_end + self.side * self.side :],
        }


class ReleaseVAECall:
    """The release VAE's call shape (``config.scaling_factor``, ``ffactor_temporal``, ``decode(z,
    return_dict, generator)`` of ``[B, C, 1, h, w]`` latents to ``[B, 3, 1, H, W]``: the last decoded frame)
    over our `omni_hunyuan.vae.VAE`, so nemo's pipeline decodes with the same weights without the release's
    remote code (which `load_release_vae` imports from the checkpoint); it keeps what it was given."""

    def __init__(self, vae: Any) -> None:
        settings = vae.settings
        self.vae, self.ffactor_temporal, self.seen = vae, settings.ffactor_temporal, None
        self.config = types.SimpleNamespace(scaling_factor=settings.scaling_factor, shift_factor=settings.shift_factor or None)

    def decode(self, latents: torch.Tensor, return_dict: bool = False, generator: Any = None) -> tuple[torch.Tensor]:
        self.seen = latents.clone()
        return (self.vae.decoder(latents.to(self.vae.decoder.dtype))[:, :, -1:],)
