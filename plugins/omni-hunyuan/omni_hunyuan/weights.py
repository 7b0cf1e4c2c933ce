"""Reading a checkpoint in the release layout: sharded or single safetensors, by key prefix.

The release stores the transformer, the VAE (``vae.*``) and the vision tower (``vision_model.*``,
``vision_aligner.*``) in one set of shards; each part loads only its own keys, so the DiT does not pay for
the ViT and a text-only stage not for the VAE.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from omni_hunyuan.config import HunyuanConfig
from omni_hunyuan.layers import group_experts
from omni_hunyuan.transformer import HunyuanImage3

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
NON_TRANSFORMER_PREFIXES = ("vae.", "vision_model.", "vision_aligner.")


def _shards(model_path: Path) -> dict[str, list[str] | None]:
    """Shard file -> its keys (None: read all the file's keys)."""
    index = model_path / INDEX_FILE
    if index.exists():
        shards: dict[str, list[str] | None] = {}
        for key, shard in json.loads(index.read_text())["weight_map"].items():
            keys = shards.setdefault(shard, [])
            assert keys is not None
            keys.append(key)
        return shards
    if (model_path / SINGLE_FILE).exists():
        return {SINGLE_FILE: None}
    raise FileNotFoundError(f"{model_path} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def read_tensors(
    model_path: str | Path, include: Iterable[str] = ("",), exclude: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """Tensors whose keys start with one of `include` and none of `exclude`; shards without any are not opened."""
    from safetensors import safe_open

    include, exclude = tuple(include), tuple(exclude)
    model_path = Path(model_path)

    def wanted(key: str) -> bool:
        return key.startswith(include) and not key.startswith(exclude)

    tensors: dict[str, torch.Tensor] = {}
    for shard, keys in _shards(model_path).items():
        if keys is not None and not any(wanted(key) for key in keys):
            continue
        with safe_open(str(model_path / shard), framework="pt") as reader:
            for key in reader.keys():  # noqa: SIM118 (a safetensors reader, not a dict)
                if wanted(key):
                    tensors[key] = reader.get_tensor(key)
    return tensors


def load_transformer(
    model_path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, backbone: nn.Module | None = None
) -> HunyuanImage3:
    """The transformer from any release-layout checkpoint, strictly (a missing or extra key is an error).

    The router stays fp32 whatever `dtype` is, as in the release. On CUDA in bfloat16 the experts are
    stacked for grouped GEMMs (`MoE.group_experts`).

    `backbone`: the ``ar`` stage's loaded vLLM model (`omni_hunyuan.vllm_model.HunyuanImage3ForVLLM`,
    handed over by ``share_model_with``). Its decoder modules (embedding, layers, final norm) become
    this transformer's, so the weights exist once; only what the text model lacks (the timestep
    embedders, the UNet embedder and head, the LM head) is read from the checkpoint. Its experts are
    taken as they are (the vLLM model groups them itself on CUDA in bfloat16).
    """
    config = HunyuanConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = HunyuanImage3(config)
    exclude = NON_TRANSFORMER_PREFIXES
    if backbone is not None:
        _share_backbone(model, backbone, device, dtype)
        exclude = (*exclude, "model.")
    state = read_tensors(model_path, exclude=exclude)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [key for key in result.missing_keys if backbone is None or not key.startswith("model.")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{model_path} does not match HunyuanImage-3.0's layout: missing {missing[:8]}, "
            f"unexpected {result.unexpected_keys[:8]}"
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.") and backbone is not None:
                continue  # the text model's tensors, as they are
            # Cast each tensor once, from the file's dtype: the fp32 router never goes through `dtype`.
            target = torch.float32 if ".mlp.gate." in name else dtype
            param.data = param.data.to(device=device, dtype=target)
    if backbone is None:
        group_experts(model.model.layers)
    return model.eval()


class SharedBackboneError(ValueError):
    """The model another stage offers (``share_model_with``) cannot serve as this transformer's decoder;
    `setting` is the stage's deploy key to change (``share_model_with`` or ``options.dtype``, the key
    `resolve()` names for the same dtype refusal)."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


def _share_backbone(model: HunyuanImage3, vllm_model: nn.Module, device: str, dtype: torch.dtype) -> None:
    """Make `model`'s decoder modules those of the text stage's vLLM model (same classes and
    parameter names: `omni_hunyuan.vllm_model`), refusing a model of another layout, dtype or device
    (`SharedBackboneError`)."""
    source = getattr(vllm_model, "model", None)
    layers = getattr(source, "layers", ())
    if not isinstance(source, nn.Module) or not hasattr(source, "wte") or len(layers) != len(model.model.layers):
        raise SharedBackboneError(
            f"the shared model ({type(vllm_model).__name__}) is not Omni's HunyuanImage-3.0 vLLM model with "
            f"{len(model.model.layers)} layers",
            "share_model_with",
        )
    weight = source.wte.weight
    if weight.dtype != dtype or weight.device.type != torch.device(device).type:
        raise SharedBackboneError(
            f"the shared model holds its weights as {weight.dtype} on {weight.device}, this stage runs {dtype} on "
            f"{device}: give both stages one dtype and device",
            "options.dtype",
        )
    target = model.model
    target.wte, target.ln_f = source.wte, source.ln_f
    for mine, theirs in zip(target.layers, layers):
        mine.input_layernorm, mine.post_attention_layernorm, mine.mlp = (
            theirs.input_layernorm, theirs.post_attention_layernorm, theirs.mlp
        )
        attention, text_attention = mine.self_attn, theirs.self_attn
        attention.qkv_proj, attention.o_proj = text_attention.qkv_proj, text_attention.o_proj
        if attention.use_qk_norm:
            attention.query_layernorm, attention.key_layernorm = text_attention.query_layernorm, text_attention.key_layernorm
