"""Random-weight MiniMax-H3 checkpoints in diffusers' modular layout (``omni make-tiny minimax-h3 DIR``).

Written by the library's own `save_pretrained`: ``MiniMaxH3Blocks().init_pipeline()``, its components
replaced by freshly built library classes, then ``save_pretrained``. That gives the released
diffusers layout: ``modular_model_index.json`` plus ``transformer/``, ``transformer_ref/``,
``text_encoder/`` (a `Qwen3VLForConditionalGeneration`), ``tokenizer/``, ``processor/``, ``vae/``
(`AutoencoderKLMiniMaxH3`), ``audio_vae/`` (`AutoencoderKLMiniMaxH3Audio`), ``scheduler/`` and
``audio_scheduler/`` (`MiniMaxH3Scheduler`, shifts 12 and 3).

Sizes follow from one `TinySpec`: the transformer's ``text_dim`` is the text encoder's hidden size,
its ``in_channels``/``audio_in_channels`` the VAEs' latent channels. The text encoder has two layers
more than the layer the pipeline conditions on (``MiniMaxH3ModularPipeline.text_encoder_layer``), read
from the pipeline, not written here. The audio VAE keeps MiniMax-H3's 40 latents a second (its
hop times 40 is its sampling rate), which the pipeline's arithmetic assumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
TOKENIZER_VOCAB_SIZE = 512
AUDIO_LATENTS_PER_SECOND = 40  # MiniMax-H3's audio latent rate, which diffusers' arithmetic hard-codes

_CORPUS = """\
A red apple on a wooden table next to a cup of tea, in warm morning light.
A robot arm picks up a blue cube and places it in a box. The camera pans slowly to the left.
A cat sleeps on a sofa; rain falls outside the window; the city lights glow at night.
Waves crash on the rocks at sunset while seagulls fly over the sea and a dog runs on the beach.
A drummer plays a fast beat on a stage; the crowd claps along. Birds sing in the forest.
<Picture 1>: <Picture 2>: <Image 1>: <Audio 1>: <Video 1>: 0 1 2 3 4 5 6 7 8 9 , . ; : ! ? ( ) " ' - x
"""


@attrs.frozen
class TinySpec:
    """The sizes of one random checkpoint."""

    text_hidden: int  # Qwen3-VL text hidden size = the transformer's text_dim
    text_heads: int
    text_head_dim: int
    mrope_section: tuple[int, int, int]  # sums to text_head_dim / 2
    vision_hidden: int
    hidden_size: int  # the DiT's residual stream
    num_heads: int
    head_dim: int  # num_heads * head_dim may differ from hidden_size, as in the release
    num_layers: int
    ffn_dim: int
    rope_freq_dim: int  # 2 * 3 * rope_freq_dim <= head_dim
    latent_channels: int
    vae_width: int
    audio_latent_channels: int
    audio_rates: tuple[int, ...]  # product = hop; sampling rate = 40 * hop (8 kHz for tiny: AAC needs >= 7.35 kHz)
    canvas_short_edge: int = 32
    # (an area cap: with the 32-pixel short edge the default canvas stays 64x32; requests may go up to
    # 480p-class sizes, `omni_minimax_h3.requests.check_volume`)
    canvas_max_pixels: int = 832 * 480
    reference_image_short_edge: int = 32  # image references are encoded at this short edge (2048 released)
    audio_gain: float = 0.8  # weight-norm gain of the audio VAE's layers (see `_init_weights`)
    init_std: float = 0.2


SPECS = {
    "tiny": TinySpec(
        text_hidden=32, text_heads=2, text_head_dim=16, mrope_section=(4, 2, 2), vision_hidden=16,
        hidden_size=24, num_heads=2, head_dim=16, num_layers=2, ffn_dim=48, rope_freq_dim=2,
        latent_channels=4, vae_width=8, audio_latent_channels=4, audio_rates=(2, 4, 5, 5),
    ),
}


def make_tiny(directory: Path, size: str = "tiny") -> None:
    """Write a random-weight MiniMax-H3 checkpoint of `size` (one of `SPECS`) into `directory`."""
    if size not in SPECS:
        raise ValueError(f"unknown size {size!r} for minimax-h3; choose one of: {', '.join(SPECS)}")
    import torch
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines import MiniMaxH3Blocks
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    spec = SPECS[size]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    pipe = MiniMaxH3Blocks().init_pipeline()
    # hidden_states[layer] needs more than `layer` decoder layers; one more than that, so the encoder's
    # load of only the layers it needs (`encoder.py`) is exercised against the library's full stack.
    layers = int(pipe.text_encoder_layer) + 2
    with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG state
        torch.manual_seed(0)
        text_encoder = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(**text_encoder_config(spec, layers, len(tokenizer), tokenizer))
        )
        transformer = MiniMaxH3Transformer3DModel(**transformer_config(spec))
        transformer_ref = MiniMaxH3Transformer3DModel(**transformer_config(spec))
        vae = AutoencoderKLMiniMaxH3(**vae_config(spec))
        audio_vae = AutoencoderKLMiniMaxH3Audio(**audio_vae_config(spec))
        for index, module in enumerate((text_encoder, transformer, transformer_ref, vae, audio_vae)):
            _init_weights(module, spec.init_std, seed=index, weight_norm_gain=spec.audio_gain if module is audio_vae else None)
    pipe.update_components(
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        transformer=transformer.eval(),
        transformer_ref=transformer_ref.eval(),
        vae=vae.eval(),
        audio_vae=audio_vae.eval(),
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    # The canvas a request without a size gets and the size image references are encoded at, from the
    # pipeline's own configs: small for tiny checkpoints.
    pipe.register_to_config(
        canvas_short_edge=spec.canvas_short_edge,
        canvas_max_pixels=spec.canvas_max_pixels,
        reference_image_short_edge=spec.reference_image_short_edge,
    )
    pipe.save_pretrained(str(directory), overwrite_modular_index=True)
    write_processor(directory / "processor", tokenizer)


def text_encoder_config(spec: TinySpec, layers: int, vocab: int, tokenizer: Any) -> dict[str, Any]:
    vocab_size = -(-vocab // 64) * 64
    return {
        "text_config": {
            "hidden_size": spec.text_hidden,
            "intermediate_size": 2 * spec.text_hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": spec.text_heads,
            "num_key_value_heads": 1,
            "head_dim": spec.text_head_dim,
            "vocab_size": vocab_size,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(spec.mrope_section)},
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": spec.vision_hidden,
            "intermediate_size": 2 * spec.vision_hidden,
            "num_heads": 2,
            "out_hidden_size": spec.text_hidden,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        "image_token_id": tokenizer.convert_tokens_to_ids(IMAGE_PAD),
        "video_token_id": tokenizer.convert_tokens_to_ids(VIDEO_PAD),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids(VISION_START),
        "vision_end_token_id": tokenizer.convert_tokens_to_ids(VISION_END),
        "tie_word_embeddings": False,
    }


def transformer_config(spec: TinySpec) -> dict[str, Any]:
    return {
        "num_attention_heads": spec.num_heads,
        "attention_head_dim": spec.head_dim,
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        "num_refiner_layers": 1,
        "ffn_dim": spec.ffn_dim,
        "in_channels": spec.latent_channels,
        "audio_in_channels": spec.audio_latent_channels,
        "patch_size": (1, 2, 2),
        "text_dim": spec.text_hidden,
        "freq_dim": 32,
        "time_embed_hidden_dim": 32,
        "time_embed_dim": 16,
        "rope_freq_dim": spec.rope_freq_dim,
    }


def vae_config(spec: TinySpec) -> dict[str, Any]:
    return {
        "latent_channels": spec.latent_channels,
        "block_out_channels": (spec.vae_width,) * 6,
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "decoder_num_layers": 1,
        "decoder_num_attention_heads": 2,
        "decoder_attention_head_dim": 8,
        "decoder_num_register_tokens": 1,
        "decoder_ffn_mult": 2,
        "latents_mean": tuple(0.1 * i for i in range(spec.latent_channels)),
        "latents_std": tuple(1.0 + 0.1 * i for i in range(spec.latent_channels)),
    }


def audio_vae_config(spec: TinySpec) -> dict[str, Any]:
    hop = 1
    for rate in spec.audio_rates:
        hop *= rate
    return {
        "encoder_dim": 4,
        "encoder_rates": spec.audio_rates,
        "latent_dim": 16,
        "latent_channels": spec.audio_latent_channels,
        "num_attention_heads": 2,
        "decoder_dim": 16,
        "decoder_rates": spec.audio_rates,
        "decoder_kernel_sizes": tuple(2 * rate for rate in spec.audio_rates),
        "resblock_kernel_sizes": (3,),
        "resblock_dilation_sizes": ((1, 3),),
        "sampling_rate": AUDIO_LATENTS_PER_SECOND * hop,
        "latents_mean": [0.05 * i for i in range(spec.audio_latent_channels)],
        "latents_std": [1.0 + 0.05 * i for i in range(spec.audio_latent_channels)],
    }


def _init_weights(module: Any, std: float, seed: int, weight_norm_gain: float | None = None) -> None:
    """Larger-than-default random weights, so outputs vary with the prompt, seed and step.

    `weight_norm_gain`: the gain of every weight-normed layer (``weight_g``). The audio VAE's
    decoder stacks them; random gains make it near silent (|x| ~ 1e-5), one gain of 0.8 gives
    audible, unclipped audio (|x| ~ 0.3), so the audio comparisons compare something.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if weight_norm_gain is not None and name.endswith("weight_g"):
                param.fill_(weight_norm_gain)
            elif "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, std if param.ndim > 1 else 0.02, generator=generator)


def train_tokenizer() -> Any:
    """A byte-level BPE with Qwen's vision tokens, trained offline (a `Qwen2TokenizerFast`)."""
    from transformers import Qwen2TokenizerFast

    from omni_core.testing.tokenizer import train_byte_level_bpe

    tokenizer = train_byte_level_bpe(_CORPUS.splitlines(), TOKENIZER_VOCAB_SIZE, SPECIAL_TOKENS)
    return Qwen2TokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        extra_special_tokens={
            "image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
            "vision_bos_token": VISION_START, "vision_eos_token": VISION_END,
        },
        model_max_length=4096,
    )


def write_processor(directory: Path, tokenizer: Any) -> None:
    """The ``processor/`` folder of a `Qwen3VLProcessor` (image processor, tokenizer, processor config),
    each part written by its own `save_pretrained`, and the pipeline index pointed at it.

    A `Qwen3VLProcessor` cannot be built where torchvision is missing (its video processor needs
    it; vLLM's CPU build removes it), so its parts are saved one by one: the files are the same.
    """
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2)
    image_processor.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2) + "\n")
    index_path = directory.parent / "modular_model_index.json"
    index = json.loads(index_path.read_text())
    spec = index["processor"][2]
    spec.update(pretrained_model_name_or_path=str(directory.parent), subfolder="processor")
    index["processor"] = ["transformers", "Qwen3VLProcessor", spec]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
