"""The sizes of a HunyuanImage-3.0 checkpoint, read from its release-schema ``config.json``.

Every module of the plugin is sized from this object, never from constants, so the tiny checkpoint and
the 80B release go through the same code. Fields the release stores as per-layer lists (experts, top-k,
shared experts, MoE widths) must be uniform here: the released checkpoints are, and a clear error beats a
silently wrong layer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

ARCHITECTURE = "HunyuanImage3ForCausalMM"
MODEL_TYPES = ("Hunyuan", "hunyuan_image_3_moe")


def _uniform(config: Mapping[str, Any], key: str, default: Any = None) -> int:
    """A field that the release may store per layer: one value, or a list whose values all agree."""
    value = config.get(key, default)
    if value is None:
        raise ValueError(f"config.json has no {key!r}, which HunyuanImage-3.0 needs")
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"config.json {key!r} differs between layers ({value}); only uniform layers are supported")
        value = value[0]
    return int(value)


@attrs.frozen
class HunyuanConfig:
    """The transformer's sizes plus the raw ``vae`` / ``vit`` sections (their own modules read those)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    moe_topk: int
    moe_intermediate_size: int
    num_shared_experts: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    use_qk_norm: bool
    attention_bias: bool
    mlp_bias: bool
    patch_size: int
    patch_embed_hidden_dim: int
    image_base_size: int
    latent_channels: int
    vae: Mapping[str, Any]
    raw: Mapping[str, Any] = attrs.field(repr=False)
    # The -Distil releases: a <guidance> token embedding the guidance scale (no CFG rows), and a
    # <timestep_r> token embedding the next step's timestep (mean flow), after <timestep>.
    cfg_distilled: bool = False
    use_meanflow: bool = False

    @property
    def heads_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def step_tokens(self) -> int:
        """Tokens between an image's ratio token and its first ``<img>``: ``<timestep>``, then
        ``<guidance>`` (cfg_distilled) and ``<timestep_r>`` (use_meanflow)."""
        return 1 + self.cfg_distilled + self.use_meanflow

    @property
    def vae_downsample(self) -> int:
        """Pixels per latent along each spatial axis (16 in the release)."""
        return int(self.vae.get("ffactor_spatial", 16))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> HunyuanConfig:
        """Read a release-schema config dict; raise ValueError for what this implementation cannot run."""
        if config.get("img_proj_type", "unet") != "unet":
            raise ValueError(f"img_proj_type {config.get('img_proj_type')!r} is not supported (only 'unet')")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("attention_head_dim") or config.get("head_dim") or hidden // heads)
        if head_dim % 4:
            raise ValueError(f"attention_head_dim {head_dim} must be a multiple of 4 (2-D RoPE splits it in y/x pairs)")
        use_mixed = bool(config.get("use_mixed_mlp_moe", True))
        vae = dict(config.get("vae") or {})
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            num_experts=_uniform(config, "num_experts"),
            moe_topk=_uniform(config, "moe_topk"),
            moe_intermediate_size=_uniform(config, "moe_intermediate_size", config.get("intermediate_size")),
            num_shared_experts=_uniform(config, "num_shared_expert", 1) if use_mixed else 0,
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            use_qk_norm=bool(config.get("use_qk_norm", True)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            patch_size=int(config.get("patch_size", 1)),
            patch_embed_hidden_dim=int(config.get("patch_embed_hidden_dim", 1024)),
            image_base_size=int(config.get("image_base_size", 1024)),
            latent_channels=int(vae.get("latent_channels", 32)),
            vae=vae,
            cfg_distilled=bool(config.get("cfg_distilled", False)),
            use_meanflow=bool(config.get("use_meanflow", False)),
            raw=dict(config),
        )

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> HunyuanConfig:
        return cls.from_dict(json.loads((Path(model_path) / "config.json").read_text()))


def generation_defaults(model_path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``generation_config.json`` (sampler and prompt-template defaults), or {}."""
    path = Path(model_path) / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def text_sampling_defaults(defaults: dict[str, Any]) -> dict[str, Any]:
    """The ``ar`` stage's default sampling parameters from generation_config (`defaults`), as the release's
    transformers ``generate`` reads them: greedy (temperature 0) unless ``do_sample``; when sampling, its
    ``temperature``, ``top_k`` and ``top_p`` with transformers' defaults (1.0, 50, 1.0) for those it leaves
    out; ``repetition_penalty`` when set. A request's own parameters win."""
    if not defaults.get("do_sample"):
        return {"temperature": 0.0}
    params = {"temperature": float(defaults.get("temperature", 1.0)), "top_p": float(defaults.get("top_p", 1.0))}
    top_k = defaults.get("top_k", 50)
    if top_k:  # (0 or null: no top-k)
        params["top_k"] = int(top_k)
    if defaults.get("repetition_penalty") not in (None, 1.0):
        params["repetition_penalty"] = float(defaults["repetition_penalty"])
    return params


# generation_config ``use_system_prompt`` -> the module-level string in the checkpoint's system_prompt.py
SYSTEM_PROMPT_NAMES = {
    "en_vanilla": "t2i_system_prompt_en_vanilla",
    "en_recaption": "t2i_system_prompt_en_recaption",
    "en_think_recaption": "t2i_system_prompt_en_think_recaption",
    "en_unified": "unified_system_prompt_en",
    "likeness": "likeness_system_prompt_en",
}
DYNAMIC_SYSTEM_PROMPTS = {"think": "en_think_recaption", "recaption": "en_recaption", "image": "en_vanilla"}  # by bot_task


def system_prompt_texts(model_path: str | Path) -> dict[str, str]:
    """The module-level string constants of the checkpoint's ``system_prompt.py`` (remote code shipped
    with the weights): parsed with `ast`, never executed; {} without the file."""
    import ast

    source = Path(model_path) / "system_prompt.py"
    texts: dict[str, str] = {}
    if source.is_file():
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                texts.update({target.id: node.value.value for target in node.targets if isinstance(target, ast.Name)})
    return texts


def default_system_prompts(model_path: str | Path) -> dict[str, str | None]:
    """The system text the release puts before an image request that brings none, by ``bot_task``
    (``image``, ``think``, ``recaption``, ``think_recaption``): generation_config's ``use_system_prompt`` (``en_unified`` on
    the Instruct release; ``dynamic`` picks one per task), read from the checkpoint's
    ``system_prompt.py`` (remote code shipped with the weights) as a module-level string: parsed, never
    executed. None: the checkpoint names none (``None``, absent, ``custom``) or does not ship the text
    (logged once)."""
    import logging

    kind = generation_defaults(model_path).get("use_system_prompt")
    # ("dynamic" names none for think_recaption: the release then takes the caller's, here the request's)
    kinds = {task: DYNAMIC_SYSTEM_PROMPTS.get(task) if kind == "dynamic" else kind for task in (*DYNAMIC_SYSTEM_PROMPTS, "think_recaption")}
    names = {task: SYSTEM_PROMPT_NAMES.get(k) if isinstance(k, str) else None for task, k in kinds.items()}
    if not any(names.values()):
        return dict.fromkeys(names)
    source = Path(model_path) / "system_prompt.py"
    texts = system_prompt_texts(model_path)
    missing = sorted({name for name in names.values() if name is not None and name not in texts})
    if missing:
        logging.getLogger(__name__).warning(
            "generation_config.json names the system prompt %r, but %s holds no %s: image requests without a system "
            "message go without it", kind, source, ", ".join(missing),
        )
    return {task: (texts.get(name) or "").strip() or None if name else None for task, name in names.items()}
