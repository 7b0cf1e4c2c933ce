"""Random-weight Cosmos3 checkpoints in diffusers' on-disk format (what ``omni make-tiny cosmos3 DIR`` writes).

The layout is the real one (`Cosmos3OmniPipeline.save_pretrained`): ``model_index.json``,
``transformer/`` (`Cosmos3OmniTransformer`: the reasoner and generator towers), ``vae/``
(`AutoencoderKLWan`), ``sound_tokenizer/`` (`Cosmos3AVAEAudioTokenizer`, decoder only),
``scheduler/`` (`UniPCMultistepScheduler`, flow matching) and ``text_tokenizer/`` (a byte-level BPE
trained offline here, with Qwen's chat tokens and ``<|vision_start|>``). Sizes:

- ``tiny``: a few hundred thousand parameters; tests run it in well under a second per request.
- ``bench``: tens of millions of transformer parameters, for CPU benchmarks.
- ``1.2b`` and ``8.5b``: GPU benchmark sizes (1.20 and 8.52 billion transformer parameters, both
  towers; the ``8.5b`` one is the released Cosmos3 transformer's layer shape with 22 instead of 36
  layers) with a full-size Wan 2.1 VAE (8x spatial compression, 16 latent channels: 16 pixels per
  transformer token). Build them on the GPU: ``make_tiny(dir, "8.5b", device="cuda",
  dtype="bfloat16")`` initialises the weights there and writes them in that dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, VISION_START)
TOKENIZER_VOCAB_SIZE = 512

# Qwen's template, enough of it for the pipeline: system/user turns and the generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
You are a helpful assistant who will generate images from a give prompt.
You are a helpful assistant who will generate videos from a give prompt.
This image is of 64x64 resolution. This video is of 480x640 resolution. This image is not of 32x32 resolution.
The video is 2.0 seconds long and is of 24 FPS. The video is not 1.0 seconds long and is not of 16 FPS.
A red apple on a wooden table next to a cup of tea, in warm morning light.
A robot arm picks up a blue cube and places it in a box. The camera pans slowly to the left.
A cat sleeps on a sofa; rain falls outside the window; the city lights glow at night.
Waves crash on the rocks at sunset while seagulls fly over the sea and a dog runs on the beach.
0 1 2 3 4 5 6 7 8 9 10 100 1000 , . ; : ! ? ( ) " ' - x
"""


@attrs.frozen
class TinySpec:
    """The sizes of one random checkpoint."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_axes_dim: tuple[int, int, int]  # sums to head_dim / 2
    latent_channels: int
    vae_base_dim: int
    vae_dim_mult: tuple[int, ...]
    vae_temporal_downsample: tuple[bool, ...]
    sound_dim: int
    sound_dec_dim: int
    init_std: float
    vae_res_blocks: int = 1


SPECS = {
    "tiny": TinySpec(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128,
        rope_axes_dim=(6, 5, 5), latent_channels=4, vae_base_dim=8, vae_dim_mult=(1, 2, 2),
        vae_temporal_downsample=(False, True), sound_dim=8, sound_dec_dim=8, init_std=0.05,
    ),
    "bench": TinySpec(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=1536,
        rope_axes_dim=(12, 10, 10), latent_channels=16, vae_base_dim=16, vae_dim_mult=(1, 2, 4, 4),
        vae_temporal_downsample=(False, True, True), sound_dim=16, sound_dec_dim=16, init_std=0.02,
    ),
    "1.2b": TinySpec(
        hidden_size=2048, num_layers=12, num_heads=16, num_kv_heads=4, head_dim=128, intermediate_size=6400,
        rope_axes_dim=(24, 20, 20), latent_channels=16, vae_base_dim=96, vae_dim_mult=(1, 2, 4, 4),
        vae_temporal_downsample=(False, True, True), sound_dim=16, sound_dec_dim=16, init_std=0.02, vae_res_blocks=2,
    ),
    "8.5b": TinySpec(
        hidden_size=4096, num_layers=22, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
        rope_axes_dim=(24, 20, 20), latent_channels=16, vae_base_dim=96, vae_dim_mult=(1, 2, 4, 4),
        vae_temporal_downsample=(False, True, True), sound_dim=16, sound_dec_dim=16, init_std=0.02, vae_res_blocks=2,
    ),
}


def make_tiny(directory: Path, size: str = "tiny", device: str = "cpu", dtype: str = "float32") -> None:
    """Write a random-weight Cosmos3 checkpoint of `size` (one of `SPECS`) into `directory`.

    `device`/`dtype`: where the random weights are made and the dtype they are written in. On CPU in
    float32 the weights are reproducible (seeded); elsewhere the modules are built without memory
    (meta device) and filled on `device`, so an 8.5B transformer takes seconds, not minutes.
    """
    if size not in SPECS:
        raise ValueError(f"unknown size {size!r} for cosmos3; choose one of: {', '.join(SPECS)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    import torch
    from diffusers import AutoencoderKLWan, Cosmos3AVAEAudioTokenizer, Cosmos3OmniPipeline, Cosmos3OmniTransformer
    from diffusers import UniPCMultistepScheduler

    spec = SPECS[size]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    vocab_size = -(-len(tokenizer) // 64) * 64
    target, torch_dtype = torch.device(device), getattr(torch, dtype)
    if target.type == "cpu" and torch_dtype == torch.float32:
        with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG state
            torch.manual_seed(0)
            transformer = Cosmos3OmniTransformer(**transformer_config(spec, vocab_size))
            _init_weights(transformer, spec.init_std)
            vae = AutoencoderKLWan(**vae_config(spec))
            sound = Cosmos3AVAEAudioTokenizer(**sound_config(spec))
    else:
        transformer = _on_device(lambda: Cosmos3OmniTransformer(**transformer_config(spec, vocab_size)), target, torch_dtype)
        _init_weights(transformer, spec.init_std)
        # The VAEs are small (~130M parameters): PyTorch's default init on the CPU, then moved.
        vae = AutoencoderKLWan(**vae_config(spec)).to(device=target, dtype=torch_dtype)
        sound = Cosmos3AVAEAudioTokenizer(**sound_config(spec)).to(device=target, dtype=torch_dtype)
    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    pipe = Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=scheduler,
        sound_tokenizer=sound,
        enable_safety_checker=False,
    )
    pipe.save_pretrained(directory, safe_serialization=True)


def transformer_config(spec: TinySpec, vocab_size: int) -> dict[str, Any]:
    return {
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "rope_axes_dim": list(spec.rope_axes_dim),
        "latent_channel": spec.latent_channels,
        "latent_patch_size": 2,
        "patch_latent_dim": 4 * spec.latent_channels,
        "vocab_size": vocab_size,
        "sound_gen": True,
        "sound_dim": spec.sound_dim,
        "sound_latent_fps": 25.0,
        "action_gen": True,
        "action_dim": 10,
        "num_embodiment_domains": 32,
        "dtype": "float32",
    }


def vae_config(spec: TinySpec) -> dict[str, Any]:
    downsamples = len(spec.vae_dim_mult) - 1
    return {
        "base_dim": spec.vae_base_dim,
        "z_dim": spec.latent_channels,
        "dim_mult": list(spec.vae_dim_mult),
        "num_res_blocks": spec.vae_res_blocks,
        "temperal_downsample": list(spec.vae_temporal_downsample),
        "latents_mean": [0.1 * i for i in range(spec.latent_channels)],
        "latents_std": [1.0 + 0.1 * i for i in range(spec.latent_channels)],
        "scale_factor_spatial": 2**downsamples,
        "scale_factor_temporal": 2 ** sum(spec.vae_temporal_downsample),
    }


def sound_config(spec: TinySpec) -> dict[str, Any]:
    # 8 kHz with a hop of 320 samples: 25 latents a second, the transformer's sound_latent_fps.
    return {
        "sampling_rate": 8000,
        "vocoder_input_dim": spec.sound_dim,
        "dec_dim": spec.sound_dec_dim,
        "dec_c_mults": (1, 2, 2),
        "dec_strides": (4, 8, 10),
        "dec_out_channels": 2,
        "enc_latent_dim": 2 * spec.sound_dim,
        "encoder_enabled": False,
    }


def _on_device(build: Any, device: Any, dtype: Any) -> Any:
    """Build a module without allocating (meta device), then allocate it on `device` in `dtype`.

    The parameters hold garbage until `_init_weights`; non-persistent buffers (rotary frequencies)
    are not written to the checkpoint, so loading recomputes them.
    """
    import torch

    with torch.device("meta"):
        module = build()
    return module.to(dtype=dtype).to_empty(device=device)


def _init_weights(module: Any, std: float) -> None:
    """Larger-than-default random weights, so outputs vary with the prompt, seed and step.

    Every parameter is written, so this also fills a module allocated with `_on_device`.
    """
    import torch

    generator = torch.Generator(device=next(module.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, std if param.ndim > 1 else 0.02, generator=generator)


def train_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """A byte-level BPE with Qwen's chat tokens and ``<|vision_start|>``, trained offline."""
    from transformers import PreTrainedTokenizerFast

    from omni_core.testing.tokenizer import train_byte_level_bpe

    tokenizer = train_byte_level_bpe(_CORPUS.splitlines(), TOKENIZER_VOCAB_SIZE, SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, VISION_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
