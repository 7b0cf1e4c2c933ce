"""`make_tiny`: a random HunyuanImage-3.0 checkpoint in the release layout, written offline.

What the release has, at toy sizes (FAMILIES.md 2.4/2.5): ``config.json`` in the release schema with its
``vae`` / ``vit`` / ``vit_processor`` / ``vit_aligner`` sections; ``generation_config.json`` with the
sampler and template defaults; safetensors shards plus ``model.safetensors.index.json`` under the release
key names (fused qkv interleaved per KV head, experts ``[up; gate]``, fp32 ``mlp.gate.wg``, ``vae.*`` in
the release's VAE names, ``vision_model.*`` / ``vision_aligner.*``); and a byte-level BPE tokenizer
trained offline that carries every special token as an added token (ids are whatever training gives;
nothing reads them as constants).

The transformer's weights are drawn with a large std (greedy decoding of small random weights repeats
one token, and the text test compares sequences); the VAE keeps PyTorch's default init (a large std would
saturate every pixel and the decode test would compare nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_hunyuan.tokens import (
    NAMED_TOKENS,
    NUM_INSTRUCT_RATIOS,
    ratio_token,
    size_token,
)

_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_head_dim": 32,  # vLLM's CPU attention takes 32, 64, 80, ...
    "num_experts": 4,
    "moe_topk": 2,
    "moe_intermediate_size": 32,
    "patch_embed_hidden_dim": 32,  # GroupNorm32 needs a multiple of 32
    "image_base_size": 64,  # 64x64 images = 4x4 latent tokens
    "tokenizer_vocab": 512,
    "vae_blocks": [32, 32, 64, 64, 64],
    "vae_layers_per_block": 2,
    "vit_width": 32,
}
SIZES: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    # 256x256 images (16x16 latent tokens): the smallest base size the Instruct release's code takes (its
    # resolution table aligns sizes to 16 pixels with a step of base / 16, and asserts step >= 16).
    "small": {**_TINY, "image_base_size": 256},
}
BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
PAD = "<pad>"
LM_STD = 0.4
IMAGE_STD = 0.1
# The velocity's last conv: a velocity of O(0.3) keeps the fp32 rounding of the large-std LM (about 1e-6
# of the velocity, in our code and in the reference alike) below the 1e-5 the latents are compared at,
# through CFG 5, which multiplies it by ~10.
VELOCITY_STD = 0.02
VELOCITY_CONV = "final_layer.model.1.2."

CORPUS = """\
A photo of a red apple on a wooden table. A cat sleeps on a sofa in the afternoon sun.
Draw a lighthouse at night with waves crashing against the rocks. A watercolor of mountains.
The quick brown fox jumps over the lazy dog. Hello world! How are you today? I am fine.
Think about the picture first: what is in it, where, and in which colors; then draw it.
A small robot counts the stars: one, two, three, four, five, six, seven, eight, nine, ten.
Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) " ' - make text.
"""


def special_tokens(image_base_size: int, distil: bool = False) -> list[str]:
    """Every added token of the tokenizer, in the order they are added (`distil`: ``<timestep_r>`` too)."""
    return [
        BOS,
        EOS,
        *NAMED_TOKENS,
        *(["<timestep_r>"] if distil else []),
        size_token(image_base_size),
        *(ratio_token(i) for i in range(NUM_INSTRUCT_RATIOS)),
    ]


def tiny_tokenizer(vocab_size: int, image_base_size: int, distil: bool = False) -> Any:
    """A `PreTrainedTokenizerFast` with the family's special tokens listed in its tokenizer_config."""
    from transformers import PreTrainedTokenizerFast

    from omni_core.testing.tokenizer import train_byte_level_bpe

    specials = special_tokens(image_base_size, distil)
    tokenizer = train_byte_level_bpe(CORPUS.splitlines(), vocab_size, specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[t for t in specials if t not in (BOS, EOS, PAD)],
        model_max_length=1024,
    )


def release_config(size: dict[str, Any], vocab_size: int, tokenizer: Any) -> dict[str, Any]:
    """``config.json`` in the release schema (per-layer MoE fields as lists, as the release writes them)."""
    layers = size["num_hidden_layers"]
    vit_width = size["vit_width"]
    return {
        "architectures": ["HunyuanImage3ForCausalMM"],
        "model_type": "hunyuan_image_3_moe",
        "vocab_size": vocab_size,
        "hidden_size": size["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": size["num_attention_heads"],
        "num_key_value_heads": size["num_key_value_heads"],
        "attention_head_dim": size["attention_head_dim"],
        "intermediate_size": size["moe_intermediate_size"],
        "moe_intermediate_size": [size["moe_intermediate_size"]] * layers,
        "num_experts": size["num_experts"],
        "moe_topk": [size["moe_topk"]] * layers,
        "num_shared_expert": [1] * layers,
        "use_mixed_mlp_moe": True,
        "norm_topk_prob": True,
        "use_qk_norm": True,
        "use_rotary_pos_emb": True,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "custom", "factor": 1.0, "alpha": 1.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "img_proj_type": "unet",
        "patch_size": 1,
        "patch_embed_hidden_dim": size["patch_embed_hidden_dim"],
        "image_base_size": size["image_base_size"],
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "vae": {
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 32,
            "block_out_channels": size["vae_blocks"],
            "layers_per_block": size["vae_layers_per_block"],
            "ffactor_spatial": 16,
            "ffactor_temporal": 4,
            "sample_size": size["image_base_size"],
            "sample_tsize": 4,
            "downsample_match_channel": True,
            "upsample_match_channel": True,
            "scaling_factor": 0.562679178327931,
            "shift_factor": None,
        },
        "vae_downsample_factor": [16, 16],
        "vit": {
            "model_type": "siglip2_vision_model",
            "hidden_size": vit_width,
            "intermediate_size": 2 * vit_width,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_channels": 3,
            "patch_size": 16,
            "num_patches": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "attention_dropout": 0.0,
            # (the release's own Siglip2 tower reads these three from the section)
            "output_attentions": False,
            "output_hidden_states": False,
            "use_return_dict": True,
        },
        "vit_processor": {
            "max_num_patches": 16,
            "patch_size": 16,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
        "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": vit_width, "n_embed": size["hidden_size"], "depth": 2},
        "vit_type": "siglip2-so400m-patch16-naflex",  # (the Instruct release's code requires it: its only ViT)
        # How an input image's tokens attend (`omni_hunyuan.understanding.COND_TOKEN_ATTN_TYPE`).
        "cond_image_type": "vae_vit",
        "cond_token_attn_type": "joint_full",
    }


def generation_config(tokenizer: Any) -> dict[str, Any]:
    """``generation_config.json``: the sampler's and the prompt template's defaults, as the release keeps them."""
    return {
        "sequence_template": "pretrain",
        "bot_task": "image",
        "use_system_prompt": "None",  # (the release's string for none; its generate_image reads the key)
        "drop_think": False,
        "flow_shift": 3.0,
        "diff_infer_steps": 50,
        "diff_guidance_scale": 5.0,
        "max_length": 1024,
        "do_sample": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _transformer_tensors(config: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.transformer import HunyuanImage3

    model = HunyuanImage3(HunyuanConfig.from_dict(config))
    generator = torch.Generator().manual_seed(seed)
    image_modules = ("patch_embed.", "final_layer.", "timestep_emb.", "time_embed.", "time_embed_2.", "guidance_emb.", "timestep_r_emb.")
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1 and ("norm" in name or name.endswith(("in_layers.0.weight", "out_layers.0.weight", "model.1.0.weight"))):
                param.fill_(1.0)
            else:
                std = VELOCITY_STD if name.startswith(VELOCITY_CONV) else IMAGE_STD if name.startswith(image_modules) else LM_STD
                param.normal_(0.0, std, generator=generator)
    return {name: tensor.contiguous() for name, tensor in model.state_dict().items()}


def _vae_tensors(config: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    from omni_hunyuan.vae import VAE_PREFIX, build_vae

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = build_vae(config["vae"])
    return {f"{VAE_PREFIX}{k}": v.contiguous() for k, v in vae.state_dict().items()}


def _vision_tensors(config: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch
    from transformers import Siglip2VisionModel

    from omni_hunyuan.understanding import vit_config

    aligner = config["vit_aligner"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tower = Siglip2VisionModel(vit_config(config["vit"]))
        # The release's LightProjector ``mlp_gelu`` of depth 2 (Linear, GELU, Linear; its code loads these names).
        projector = torch.nn.Sequential(
            torch.nn.Linear(aligner["input_dim"], aligner["n_embed"]),
            torch.nn.GELU(),
            torch.nn.Linear(aligner["n_embed"], aligner["n_embed"]),
        )
    # The release's tower is a Siglip2 vision transformer under ``vision_model.``.
    tensors = {f"vision_model.{k.removeprefix('vision_model.')}": v.contiguous() for k, v in tower.state_dict().items()}
    tensors.update({f"vision_aligner.layers.{k}": v.contiguous() for k, v in projector.state_dict().items()})
    return tensors


def make_tiny(directory: Path, size: str = "tiny", seed: int = 0, distil: bool = False) -> None:
    """Write the checkpoint into `directory` (same files for the same `size`, `seed` and `distil`).

    `distil`: in the -Instruct-Distil release's schema (``cfg_distilled`` and ``use_meanflow`` in
    config.json, so ``guidance_emb`` and ``timestep_r_emb`` weights; its generation_config: the
    instruct template, think-and-recaption, 8 steps, guidance 2.5)."""
    from safetensors.torch import save_file

    if size not in SIZES:
        raise ValueError(f"hunyuan-image3 make_tiny writes sizes {sorted(SIZES)}, not {size!r}")
    spec = SIZES[size]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(spec["tokenizer_vocab"], spec["image_base_size"], distil)
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = release_config(spec, vocab_size, tokenizer)
    generation = generation_config(tokenizer)
    if distil:
        config.update(cfg_distilled=True, use_meanflow=True)
        generation.update(sequence_template="instruct", bot_task="think_recaption", diff_infer_steps=8, diff_guidance_scale=2.5)

    shards = {
        "model-00001-of-00002.safetensors": _transformer_tensors(config, seed),
        "model-00002-of-00002.safetensors": {**_vae_tensors(config, seed + 1), **_vision_tensors(config, seed + 2)},
    }
    weight_map: dict[str, str] = {}
    total = 0
    for shard, tensors in shards.items():
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
        weight_map.update({key: shard for key in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_pretrained(directory)
