"""MiniMax-H3's native partition layout (``FL2VA/``, ``Ref2VA/``), read through diffusers' modular layout.

The release ships two layouts in one repository (FAMILIES.md 1.4): diffusers' (``modular_model_index.json``
at the top) and the native partitions, each with ``model_index.json`` (``_class_name``
``MiniMaxH3Pipeline`` and a ``_minimax_h3`` block: partition, tasks, ``sigma_shift_scales``),
``transformer/``, ``text_encoder/``, ``video_vae/``, ``audio_vae/``, ``tokenizer/``, ``processor/``.
Given a partition, `diffusers_layout` writes (once, under Omni's cache) the diffusers layout of it,
so every part of this plugin loads one layout through the library's own loaders. The transforms are
those of diffusers' ``scripts/convert_minimax_h3_to_diffusers.py``:

- transformer: the per-head-interleaved fused ``attn.qkv_proj`` (``[h0: q k v, h1: q k v, ...]``) is
  reordered and split into ``to_q``/``to_k``/``to_v``; ``mlp.fc1`` ``[gate; value]`` becomes
  ``ff.net.0.proj`` ``[value; gate]`` (diffusers' SwiGLU); keys renamed (``video_patch_proj`` ->
  ``proj_in``, ``final_layer.video_out`` -> ``proj_out``, ...); ``rope.inv_freq`` dropped (recomputed);
- video VAE (``video_vae/source/``): the ViT decoder's ``attn.to_qkv`` split the same way, ``ff.w1``
  halves swapped, the encoder's CompVis names onto diffusers' (``down.i.block.j`` -> ``down_blocks.i.resnets.j``);
- audio VAE: the same keys; its config from ``metadata.json`` and ``config.json``;
- schedulers: ``scheduler`` / ``audio_scheduler`` at the ``sigma_shift_scales`` of ``model_index.json``.

A partition's sibling serves the other task: given ``FL2VA/`` with a ``Ref2VA/`` beside it, the Ref2VA
transformer becomes ``transformer_ref`` (and the other way round). Where the release's files do not say
(the transformer's and video VAE's native ``config.json`` field names beyond those the conversion script
names; sizes the release fixes, which a tiny checkpoint changes), this module reads the names listed in
`TRANSFORMER_NAMES`, `VIDEO_VAE_NAMES` and `AUDIO_VAE_FIXED`, and a tiny checkpoint may carry the fixed
ones explicitly. The text encoder is read as a transformers Qwen3-VL checkpoint (``text_encoder/``
symlinked); the release's remote-code wrapper class ``MiniMaxH3Qwen3VLHFEncoder`` is refused with that fact.
`write_native` is the inverse (diffusers layout -> native partitions), for tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omni_core.errors import ConfigError

NATIVE_CLASS = "MiniMaxH3Pipeline"
PARTITIONS = {"FL2VA": "transformer", "Ref2VA": "transformer_ref"}  # native partition -> the diffusers component
LAYOUT_VERSION = 1  # raise when the converted layout changes: older conversions are then rewritten

# The native transformer config's names (the conversion script's comments) -> diffusers' argument names.
TRANSFORMER_NAMES = {
    "token_refiner_num_layers": "num_refiner_layers", "ffn_hidden_size": "ffn_dim", "latents_dim": "in_channels",
    "audio_latents_dim": "audio_in_channels", "timestep_input_dim": "freq_dim",
    "time_embed_hidden_size": "time_embed_hidden_dim", "rope_inv_freq_len": "rope_freq_dim",
}
TRANSFORMER_DERIVED = ("adaln_out_features", "final_adaln_out_features")
TRANSFORMER_RENAMES = (  # native -> diffusers, applied in order (the conversion script's `convert_transformer_key`)
    ("time_embedder.proj_in.", "time_embedder.linear_1."), ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("video_patch_proj.", "proj_in."), ("audio_patch_proj.", "audio_proj_in."), ("condition_proj.", "context_embedder."),
    ("final_layer.norm.", "norm_out.norm."), ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.video_out.", "proj_out."), ("final_layer.audio_out.", "audio_proj_out."),
    (".attn.q_norm.", ".attn.norm_q."), (".attn.k_norm.", ".attn.norm_k."), (".attn.out_proj.", ".attn.to_out.0."),
    (".mlp.fc2.", ".ff.net.2."),
)
# The native video VAE config (``video_vae/source/config.json``) -> diffusers' names; `vit_decoder_kwargs` nests.
VIDEO_VAE_NAMES = {
    "in_channels": "in_channels", "out_ch": "out_channels", "z_channels": "latent_channels", "num_res_blocks": "layers_per_block",
    "space_down": "spatial_downsample_factors", "time_down": "temporal_downsample_factors", "norm_num_groups": "norm_num_groups",
    "norm_eps": "norm_eps", "padding_mode": "spatial_padding_mode",
}
VIT_DECODER_NAMES = {
    "num_layers": "decoder_num_layers", "heads": "decoder_num_attention_heads", "dim_head": "decoder_attention_head_dim",
    "rope_theta": "decoder_rope_theta", "rope_dim_ratio": "decoder_rope_dim_ratio", "num_register_tokens": "decoder_num_register_tokens",
    "ffn_mult": "decoder_ffn_mult", "eps": "decoder_norm_eps",
}
# What the release's audio VAE hard-codes (not in its metadata.json); a metadata.json may name them.
AUDIO_VAE_FIXED = {"num_attention_heads": 8, "resblock_kernel_sizes": [3, 7, 11], "resblock_dilation_sizes": [[1, 3, 5]] * 3}


# -- detection -----------------------------------------------------------------------------------------


def native_index(path: str | Path) -> dict[str, Any] | None:
    """A native partition's ``model_index.json``, or None when `path` is not one."""
    file = Path(path) / "model_index.json"
    if not file.is_file():
        return None
    index = json.loads(file.read_text())
    return index if index.get("_class_name") == NATIVE_CLASS and isinstance(index.get("_minimax_h3"), dict) else None


def diffusers_layout(path: str | Path) -> str:
    """`path` itself when it is in diffusers' layout, else the diffusers layout of its native partition
    (written once under ``$OMNI_CACHE/minimax-h3-native/``, reused while the partition is unchanged)."""
    from omni_core.config.modelref import cache_dir

    source = Path(path).resolve()
    if native_index(source) is None:
        return str(path)
    stamp = [LAYOUT_VERSION, str(source)]
    for partition in _partitions(source).values():
        stamp += sorted(f"{f.relative_to(partition)}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in partition.rglob("*") if f.is_file())
    target = cache_dir() / "minimax-h3-native" / hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
    if not (target / "modular_model_index.json").is_file():
        staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        convert(source, staging)
        try:
            staging.rename(target)  # atomic: another process may have finished first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _partitions(source: Path) -> dict[str, Path]:
    """The native partitions to load: `source` and, beside it, its sibling (``FL2VA`` <-> ``Ref2VA``)."""
    found: dict[str, Path] = {}
    for candidate in (source, *(source.parent / name for name in PARTITIONS)):
        index = native_index(candidate)
        if index is None:
            continue
        name = str(index["_minimax_h3"].get("partition") or candidate.name)
        if name not in PARTITIONS:
            raise ConfigError(f"{candidate}/model_index.json names partition {name!r}; MiniMax-H3 has {sorted(PARTITIONS)}")
        found.setdefault(name, candidate)
    return found


# -- native -> diffusers ---------------------------------------------------------------------------------


def convert(source: Path, out: Path) -> None:
    """Write the diffusers modular layout of the native partition `source` (and its sibling) into `out`."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )

    index = native_index(source)
    assert index is not None
    out.mkdir(parents=True)
    for name, partition in _partitions(source).items():
        config = transformer_config(json.loads((partition / "transformer" / "config.json").read_text()))
        _convert_module(MiniMaxH3Transformer3DModel, config, _native_tensors(partition / "transformer"),
                        lambda key, tensor, c=config: transformer_to_diffusers(key, tensor, c), out / PARTITIONS[name])
    vae_root = source / "video_vae"
    wrapper = json.loads((vae_root / "config.json").read_text())
    vae_config = video_vae_config(wrapper, json.loads((vae_root / wrapper["source_path"] / "config.json").read_text()))
    _convert_module(AutoencoderKLMiniMaxH3, vae_config, _native_tensors(vae_root / wrapper["source_path"]),
                    lambda key, tensor: video_vae_to_diffusers(key, tensor, vae_config), out / "vae")
    audio_config = audio_vae_config(source / "audio_vae")
    _convert_module(AutoencoderKLMiniMaxH3Audio, audio_config, _native_tensors(source / "audio_vae"), lambda key, tensor: [(key, tensor)],
                    out / "audio_vae")
    shifts = index["_minimax_h3"]["sigma_shift_scales"]
    MiniMaxH3Scheduler(shift=float(shifts["video"])).save_pretrained(str(out / "scheduler"))
    MiniMaxH3Scheduler(shift=float(shifts["audio"])).save_pretrained(str(out / "audio_scheduler"))
    _link_text_encoder(source / "text_encoder", out / "text_encoder")
    for name in ("tokenizer", "processor"):
        if (source / name).is_dir():
            shutil.copytree(source / name, out / name)
    _write_modular_index(index, out)


def transformer_config(native: dict[str, Any]) -> dict[str, Any]:
    """`MiniMaxH3Transformer3DModel` arguments from a native transformer ``config.json``."""
    return {TRANSFORMER_NAMES.get(k, k): v for k, v in native.items() if not k.startswith("_") and k not in TRANSFORMER_DERIVED}


def transformer_to_diffusers(key: str, tensor: Any, config: dict[str, Any]) -> list[tuple[str, Any]]:
    """One native transformer tensor -> the diffusers tensor(s) it becomes."""
    if key == "rope.inv_freq":
        return []  # a function of rope_theta and rope_freq_dim; diffusers recomputes it
    target = key
    if target.startswith("token_refiner.blocks."):
        target = target.replace("token_refiner.blocks.", "token_refiner.refiner_blocks.", 1)
    elif target.startswith("blocks."):
        target = target.replace("blocks.", "transformer_blocks.", 1)
    for old, new in TRANSFORMER_RENAMES:
        target = target.replace(old, new)
    if target.endswith(".attn.qkv_proj.weight"):
        prefix = target.removesuffix("qkv_proj.weight")
        query, key_, value = split_interleaved_qkv(tensor, config["num_attention_heads"], config["attention_head_dim"])
        return [(f"{prefix}to_q.weight", query), (f"{prefix}to_k.weight", key_), (f"{prefix}to_v.weight", value)]
    if target.endswith(".mlp.fc1.weight"):
        return [(target.replace(".mlp.fc1.weight", ".ff.net.0.proj.weight"), swap_halves(tensor))]
    return [(target, tensor)]


def video_vae_config(wrapper: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """`AutoencoderKLMiniMaxH3` arguments from ``video_vae/config.json`` and its ``source/config.json``."""
    config = {VIDEO_VAE_NAMES[k]: v for k, v in source.items() if k in VIDEO_VAE_NAMES}
    config["block_out_channels"] = [source["ch"] * mult for mult in source["ch_mult"]]
    config.update({VIT_DECODER_NAMES[k]: v for k, v in (source.get("vit_decoder_kwargs") or {}).items() if k in VIT_DECODER_NAMES})
    config.update(clip_length=wrapper["vae_clip_length"], token_drop=wrapper["vae_token_drop"],
                  latents_mean=wrapper["latents_mean"], latents_std=wrapper["latents_std"])
    return config


def video_vae_to_diffusers(key: str, tensor: Any, config: dict[str, Any]) -> list[tuple[str, Any]]:
    if key == "decoder.mask_token":
        return []  # a training-only buffer the decoder never reads
    heads, head_dim = config["decoder_num_attention_heads"], config["decoder_attention_head_dim"]
    if ".attn.to_qkv." in key:
        prefix, suffix = key.split(".attn.to_qkv.")
        parts = split_interleaved_qkv(tensor, heads, head_dim)
        return [(f"{prefix}.attn.to_{name}.{suffix}", part) for name, part in zip("qkv", parts)]
    target = key
    if target.startswith("encoder.down."):
        level, rest = target.removeprefix("encoder.down.").split(".", 1)
        rest = rest.replace("block.", "resnets.", 1).replace("nin_shortcut.", "conv_shortcut.", 1).replace("downsample.", "downsamplers.0.", 1)
        target = f"encoder.down_blocks.{level}.{rest}"
    target = target.replace("decoder.x_embedder.", "decoder.proj_in.").replace(".attn.to_out.", ".attn.to_out.0.")
    target = target.replace(".ff.w1.", ".ff.net.0.proj.").replace(".ff.w2.", ".ff.net.2.")
    return [(target, swap_halves(tensor) if ".ff.w1." in key else tensor)]


def audio_vae_config(root: Path) -> dict[str, Any]:
    """`AutoencoderKLMiniMaxH3Audio` arguments from ``audio_vae/metadata.json`` and ``config.json``."""
    kwargs = json.loads((root / "metadata.json").read_text())["metadata"]["kwargs"]
    wrapper = json.loads((root / "config.json").read_text())
    if kwargs.get("decoder_type", "bigvgan") != "bigvgan":
        raise ConfigError(f"{root}: only the BigVGAN audio decoder is supported, not {kwargs['decoder_type']!r}")
    return {
        "encoder_dim": kwargs["encoder_dim"], "encoder_rates": kwargs["encoder_rates"], "latent_dim": kwargs["latent_dim"],
        "latent_channels": kwargs["vae_latent_channels"], "decoder_dim": kwargs["decoder_dim"], "decoder_rates": kwargs["decoder_rates"],
        "decoder_kernel_sizes": kwargs.get("decoder_kernel_sizes") or [2 * r - (r % 2) for r in kwargs["decoder_rates"]],
        **{name: kwargs.get(name, value) for name, value in AUDIO_VAE_FIXED.items()},
        "sampling_rate": kwargs["sample_rate"], "latents_mean": wrapper["latents_mean"], "latents_std": wrapper["latents_std"],
    }


def split_interleaved_qkv(weight: Any, heads: int, head_dim: int) -> tuple[Any, Any, Any]:
    """``[h0: q k v, h1: q k v, ...]`` rows -> contiguous ``q``, ``k``, ``v`` (weights or biases)."""
    grouped = weight.reshape(heads, 3, head_dim, *weight.shape[1:])
    return tuple(grouped[:, i].reshape(heads * head_dim, *weight.shape[1:]).contiguous() for i in range(3))  # type: ignore[return-value]


def interleave_qkv(query: Any, key: Any, value: Any, heads: int) -> Any:
    """The inverse of `split_interleaved_qkv`."""
    import torch

    stacked = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (query, key, value)], dim=1)
    return stacked.reshape(-1, *query.shape[1:]).contiguous()


def swap_halves(tensor: Any) -> Any:
    """``[a; b]`` -> ``[b; a]`` along the rows: the native ``[gate; value]`` is diffusers' ``[value; gate]`` (an involution)."""
    import torch

    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0).contiguous()


def _native_tensors(folder: Path) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} has no *.safetensors files: is this a MiniMax-H3 native partition?")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def _convert_module(cls: type, config: dict[str, Any], tensors: Iterator[tuple[str, Any]],
                    rename: Callable[[str, Any], list[tuple[str, Any]]], out: Path) -> None:
    """Load the renamed tensors into `cls(**config)` (strict: every key accounted for) and save it with the
    library's ``save_pretrained``, which writes its config and keeps each tensor's dtype."""
    import torch

    with torch.device("meta"):
        module = cls(**config)
    state = {new: tensor for key, tensor in tensors for new, tensor in rename(key, tensor)}
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConfigError(f"{cls.__name__} from the native layout: missing {missing[:5]}, unexpected {unexpected[:5]}")
    module.load_state_dict(state, assign=True, strict=True)
    module.save_pretrained(str(out))


def _link_text_encoder(source: Path, target: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    architectures = config.get("architectures") or []
    if "Qwen3VLForConditionalGeneration" not in architectures:
        raise ConfigError(
            f"{source} holds {architectures or 'an unknown class'}; omni-minimax-h3 reads a transformers "
            "Qwen3VLForConditionalGeneration text encoder (the release's remote-code MiniMaxH3Qwen3VLHFEncoder is not "
            "supported: load the diffusers layout at the repository's top level instead)"
        )
    target.symlink_to(source, target_is_directory=True)


COMPONENTS = {  # diffusers component -> (library, class), as diffusers' conversion script writes them
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"), "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "processor": ("transformers", "Qwen3VLProcessor"), "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"), "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"), "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
}
PIPELINE_CONFIG = ("canvas_short_edge", "canvas_max_pixels", "reference_image_short_edge")  # optional; the release has none


def _write_modular_index(native: dict[str, Any], out: Path) -> None:
    """``modular_model_index.json`` for the converted components, each loading from `out` (the
    conversion script's shape); pipeline settings a native index carries are kept."""
    import diffusers

    index: dict[str, Any] = {"_blocks_class_name": "MiniMaxH3Blocks", "_class_name": "MiniMaxH3ModularPipeline",
                             "_diffusers_version": diffusers.__version__}
    for name, (library, class_name) in COMPONENTS.items():
        if name in ("tokenizer", "processor") and isinstance(native.get(name), list) and len(native[name]) == 2:
            library, class_name = native[name]
        if (out / name).is_dir():
            index[name] = [library, class_name, {"pretrained_model_name_or_path": str(out), "revision": None, "subfolder": name,
                                                 "type_hint": [library, class_name], "variant": None}]
    index.update({key: native[key] for key in PIPELINE_CONFIG if key in native})
    (out / "modular_model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# -- diffusers -> native (the inverse, for tests) ---------------------------------------------------------


def write_native(diffusers_dir: str | Path, out: str | Path) -> None:
    """Write the native partitions ``FL2VA/`` (from ``transformer/``) and ``Ref2VA/`` (from
    ``transformer_ref/``) of a diffusers-layout MiniMax-H3 checkpoint: the inverse of `convert`."""
    from diffusers import MiniMaxH3Transformer3DModel
    from safetensors.torch import save_file

    src, out = Path(diffusers_dir), Path(out)
    modular = json.loads((src / "modular_model_index.json").read_text())
    shifts = {kind: json.loads((src / folder / "scheduler_config.json").read_text())["shift"]
              for kind, folder in (("video", "scheduler"), ("audio", "audio_scheduler"))}
    inverse_names = {v: k for k, v in TRANSFORMER_NAMES.items()}
    for partition, component in PARTITIONS.items():
        if not (src / component).is_dir():
            continue
        root = out / partition
        (root / "transformer").mkdir(parents=True)
        transformer = MiniMaxH3Transformer3DModel.from_pretrained(str(src / component))
        config = dict(transformer.config)
        native_config = {inverse_names.get(k, k): v for k, v in config.items() if not k.startswith("_")}
        (root / "transformer" / "config.json").write_text(json.dumps(native_config, indent=2, default=list) + "\n")
        save_file(transformer_to_native(transformer.state_dict(), config), str(root / "transformer" / "model.safetensors"))
        _write_native_vaes(src, root)
        shutil.copytree(src / "text_encoder", root / "text_encoder")
        for name in ("tokenizer", "processor"):
            shutil.copytree(src / name, root / name)
        index = {
            "_class_name": NATIVE_CLASS,
            "_minimax_h3": {"partition": partition, "tasks": ["t2va", "fl2va"] if partition == "FL2VA" else ["ref2va"],
                            "sigma_shift_scales": shifts},
            "scheduler": None,
            "tokenizer": modular["tokenizer"][:2], "processor": modular["processor"][:2],
            **{key: modular[key] for key in PIPELINE_CONFIG if key in modular},
        }
        (root / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        del transformer


def transformer_to_native(state: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A diffusers transformer state dict in the native key names and tensor layouts."""
    inverse = [(new, old) for old, new in reversed(TRANSFORMER_RENAMES)]
    out: dict[str, Any] = {}
    for key, tensor in state.items():
        if ".attn.to_k." in key or ".attn.to_v." in key:
            continue
        target = key
        if target.startswith("token_refiner.refiner_blocks."):
            target = target.replace("token_refiner.refiner_blocks.", "token_refiner.blocks.", 1)
        elif target.startswith("transformer_blocks."):
            target = target.replace("transformer_blocks.", "blocks.", 1)
        if ".attn.to_q." in key:
            prefix = key.removesuffix("to_q.weight")
            tensor = interleave_qkv(state[key], state[prefix + "to_k.weight"], state[prefix + "to_v.weight"], config["num_attention_heads"])
            out[target.replace(".attn.to_q.", ".attn.qkv_proj.")] = tensor
            continue
        if ".ff.net.0.proj." in key:
            out[target.replace(".ff.net.0.proj.", ".mlp.fc1.")] = swap_halves(tensor)
            continue
        for new, old in inverse:
            target = target.replace(new, old)
        out[target] = tensor.contiguous()
    return out


def _write_native_vaes(src: Path, root: Path) -> None:
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
    from safetensors.torch import save_file

    vae = AutoencoderKLMiniMaxH3.from_pretrained(str(src / "vae"))
    c = dict(vae.config)
    heads = c["decoder_num_attention_heads"]
    ch = c["block_out_channels"][0]
    source = {old: c[new] for old, new in VIDEO_VAE_NAMES.items()}
    source.update(ch=ch, ch_mult=[w // ch for w in c["block_out_channels"]],
                  vit_decoder_kwargs={old: c[new] for old, new in VIT_DECODER_NAMES.items()})
    state = vae.state_dict()
    native: dict[str, Any] = {}
    for key, tensor in state.items():
        if ".attn.to_k." in key or ".attn.to_v." in key:
            continue
        if ".attn.to_q." in key and key.startswith("decoder."):
            prefix, suffix = key.split(".attn.to_q.")
            parts = [state[f"{prefix}.attn.to_{n}.{suffix}"] for n in "qkv"]
            native[f"{prefix}.attn.to_qkv.{suffix}"] = interleave_qkv(*parts, heads)
            continue
        target = key
        if target.startswith("encoder.down_blocks."):
            level, rest = target.removeprefix("encoder.down_blocks.").split(".", 1)
            rest = rest.replace("resnets.", "block.", 1).replace("conv_shortcut.", "nin_shortcut.", 1).replace("downsamplers.0.", "downsample.", 1)
            target = f"encoder.down.{level}.{rest}"
        target = target.replace("decoder.proj_in.", "decoder.x_embedder.").replace(".attn.to_out.0.", ".attn.to_out.")
        if ".ff.net.0.proj." in target:
            native[target.replace(".ff.net.0.proj.", ".ff.w1.")] = swap_halves(tensor)
            continue
        native[target.replace(".ff.net.2.", ".ff.w2.")] = tensor.contiguous()
    (root / "video_vae" / "source").mkdir(parents=True)
    save_file(native, str(root / "video_vae" / "source" / "model.safetensors"))
    (root / "video_vae" / "source" / "config.json").write_text(json.dumps(source, indent=2, default=list) + "\n")
    wrapper = {"source_path": "source", "source_safetensors_path": "model.safetensors", "vae_clip_length": c["clip_length"],
               "vae_token_drop": c["token_drop"], "latents_mean": list(c["latents_mean"]), "latents_std": list(c["latents_std"])}
    (root / "video_vae" / "config.json").write_text(json.dumps(wrapper, indent=2) + "\n")

    audio = AutoencoderKLMiniMaxH3Audio.from_pretrained(str(src / "audio_vae"))
    a = dict(audio.config)
    (root / "audio_vae").mkdir()
    save_file({k: v.contiguous() for k, v in audio.state_dict().items()}, str(root / "audio_vae" / "model.safetensors"))
    kwargs = {"encoder_dim": a["encoder_dim"], "encoder_rates": list(a["encoder_rates"]), "latent_dim": a["latent_dim"],
              "vae_latent_channels": a["latent_channels"], "decoder_dim": a["decoder_dim"], "decoder_rates": list(a["decoder_rates"]),
              "sample_rate": a["sampling_rate"], "decoder_type": "bigvgan", "attn_proj": True,
              # not in the release's metadata (it hard-codes them); a tiny checkpoint changes them
              "decoder_kernel_sizes": list(a["decoder_kernel_sizes"]), "num_attention_heads": a["num_attention_heads"],
              "resblock_kernel_sizes": list(a["resblock_kernel_sizes"]), "resblock_dilation_sizes": [list(d) for d in a["resblock_dilation_sizes"]]}
    (root / "audio_vae" / "metadata.json").write_text(json.dumps({"metadata": {"kwargs": kwargs}}, indent=2) + "\n")
    wrapper_audio = {"latent_channels": a["latent_channels"], "sample_rate": a["sampling_rate"],
                     "latents_mean": list(a["latents_mean"]), "latents_std": list(a["latents_std"])}
    (root / "audio_vae" / "config.json").write_text(json.dumps(wrapper_audio, indent=2) + "\n")
