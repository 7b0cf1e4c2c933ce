"""A tiny random-weight Qwen3-Omni checkpoint in the real architecture and on-disk format.

`make_tiny` writes what ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` ships, shrunk: ``config.json``
(``Qwen3OmniMoeForConditionalGeneration``: thinker with audio encoder, vision encoder and MoE text
model; talker with code predictor; code2wav), ``model.safetensors`` written by ``save_pretrained``,
``generation_config.json``, a byte-level BPE tokenizer trained offline with Qwen3-Omni's special
tokens, the chat template and the processor configs. Loading it goes through the same code as real
weights (transformers and vLLM), so tests of the serving path exercise the real model code.

Heavy libraries are imported inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from omni_core.errors import ConfigError, MissingDependencyError

# Qwen3-Omni's special tokens, in the order (and so with the relative ids) of the real vocabulary,
# which starts them at 151643. Ids are appended after the trained BPE vocabulary.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# Tokens the real tokenizer marks as not special (they survive `skip_special_tokens`).
_NON_SPECIAL = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
    | {"<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
)

# The tokenizer attributes `Qwen3OmniMoeProcessor` reads (`tokenizer.image_token`, ...).
EXTRA_SPECIAL_TOKENS: dict[str, str] = {
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}

# Talker codec specials sit above the codebook at the real checkpoint's offsets (codebook 2048,
# pad 2148, bos 2149, eos 2150, nothink 2155, think_bos 2156, think_eos 2157, speakers 2301..).
_CODEC_OFFSETS = {
    "codec_pad_id": 100,
    "codec_bos_id": 101,
    "codec_eos_token_id": 102,
    "codec_nothink_id": 107,
    "codec_think_bos_id": 108,
    "codec_think_eos_id": 109,
}
SPEAKERS: dict[str, int] = {"chelsie": 253, "ethan": 254, "aiden": 255}
# `generate` suppresses the talker's last 1024 ids (all codec specials but EOS): the talker vocab is
# the codebook plus this block, as in the real checkpoint (2048 + 1024 = 3072).
_TALKER_SPECIAL_BLOCK = 1024

CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Picture ' + image_count.value|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif content['type'] == 'video' or 'video' in content -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Video ' + video_count.value|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in content -%}"
    "{{- content['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


@attrs.frozen
class TinySize:
    """Dimensions of one tiny preset; every attention head is 32 wide (vLLM CPU needs >= 32)."""

    bpe_vocab: int
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    experts: int
    experts_per_tok: int
    moe_intermediate: int
    intermediate: int
    vision_depth: int
    audio_layers: int
    talker_hidden: int
    talker_layers: int
    predictor_layers: int
    code_groups: int
    codebook: int
    code2wav_hidden: int
    code2wav_layers: int
    decoder_dim: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SIZES: dict[str, TinySize] = {
    "tiny": TinySize(
        bpe_vocab=640, hidden=64, heads=2, kv_heads=1, layers=3, experts=4, experts_per_tok=2,
        moe_intermediate=32, intermediate=128, vision_depth=2, audio_layers=1, talker_hidden=64,
        talker_layers=2, predictor_layers=1, code_groups=4, codebook=128, code2wav_hidden=64,
        code2wav_layers=1, decoder_dim=64,
    ),
    "bench": TinySize(
        bpe_vocab=4000, hidden=384, heads=6, kv_heads=2, layers=6, experts=8, experts_per_tok=2,
        moe_intermediate=192, intermediate=768, vision_depth=4, audio_layers=4, talker_hidden=256,
        talker_layers=4, predictor_layers=2, code_groups=8, codebook=1024, code2wav_hidden=256,
        code2wav_layers=2, decoder_dim=256,
    ),
}

# Large enough that greedy decoding of random weights does not collapse to one repeated token.
INIT_STD = 0.4
CODE2WAV_INIT_STD = 0.08
SEED = 0
# The talker ends its speech on its own (codec EOS) about this many codec frames in (12.5 a second;
# measured: after 45-49 frames, 3.6-3.9 s of audio), whatever the prompt and the thinker's text,
# greedy or sampled: see `omni_qwen3.tiny_speech`. Tests that compare codes cap the talker at 40 frames.
SPEECH_FRAMES = 50

_CORPUS_WORDS = (
    "system user assistant the a of and to in is you that it he was for on are as with his they at be this "
    "from have or by one had not but what all were when we there can an your which their said if do will "
    "each about how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find use may water "
    "long little very after words called just where most know hello world audio image video speech sound "
    "picture describe what is in this listen answer question helpful"
).split()


def make_tiny(directory: Path, size: str = "tiny") -> None:
    """Write a tiny random-weight Qwen3-Omni checkpoint to `directory` (created if missing).

    Deterministic: the same `size` always gives the same files. `size` is ``"tiny"`` (about a
    million parameters, loads in well under a second) or ``"bench"`` (tens of millions).
    """
    if size not in SIZES:
        raise ConfigError(f"unknown tiny size {size!r}; use one of {sorted(SIZES)}", key="size")
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - the test environment has both
        raise MissingDependencyError(
            f"writing a tiny Qwen3-Omni checkpoint needs torch and transformers ({exc}); "
            "install them with `pip install torch transformers`"
        ) from exc

    spec = SIZES[size]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    token_ids = _write_tokenizer_and_processor(directory, spec)
    config = build_config(spec, token_ids)

    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(SEED)
    model = Qwen3OmniMoeForConditionalGeneration(config)
    _init_talker_experts(model)
    from omni_qwen3.tiny_speech import shape_speech_end

    shape_speech_end(model)
    model.eval()
    model.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)


def _init_talker_experts(model: Any) -> None:
    """Initialise the talker's MoE experts and routers, which transformers leaves unset.

    Its `_init_weights` covers the thinker's expert classes only, so the talker's experts stay
    `torch.empty` (garbage, different every run) and its routers zero. Real checkpoints load them.
    """
    import torch

    with torch.no_grad():
        for name, module in model.talker.named_modules():
            kind = type(module).__name__
            if kind.endswith("TalkerTextExperts"):
                module.gate_up_proj.normal_(0.0, INIT_STD)
                module.down_proj.normal_(0.0, INIT_STD)
            elif kind.endswith("TalkerTextTopKRouter"):
                module.weight.normal_(0.0, INIT_STD)


def build_config(spec: TinySize, token_ids: dict[str, int]) -> Any:
    """The `Qwen3OmniMoeConfig` for `spec`, with special ids taken from the trained tokenizer."""
    from transformers import Qwen3OmniMoeConfig

    thinker_vocab = _round_up(len(token_ids["_vocab"]), 64)
    head_dim = spec.head_dim
    talker_heads = spec.talker_hidden // 32
    # Real checkpoint: mrope_section [24, 20, 20] for head_dim 128; it must sum to head_dim / 2.
    mrope_section = _mrope_section(head_dim)
    text_rope = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": mrope_section,
        "interleaved": True,
        # vLLM reads this spelling; without it image prompts diverge from transformers.
        "mrope_interleaved": True,
    }
    talker_rope = dict(text_rope, mrope_section=_mrope_section(32))
    patch_size = 16
    grid_per_side = 16
    thinker = {
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": spec.audio_layers,
            "encoder_attention_heads": spec.hidden // 32,
            "encoder_ffn_dim": spec.intermediate,
            "d_model": spec.hidden,
            "output_dim": spec.hidden,
            "downsample_hidden_size": 32,
            "n_window": 50,
            "n_window_infer": 800,
            "conv_chunksize": 500,
            "max_source_positions": 1500,
            "initializer_range": INIT_STD,
        },
        "vision_config": {
            "depth": spec.vision_depth,
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "num_heads": spec.hidden // 32,
            "in_channels": 3,
            "patch_size": patch_size,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": spec.hidden,
            "num_position_embeddings": grid_per_side**2,
            "deepstack_visual_indexes": list(range(spec.vision_depth)),
            "initializer_range": INIT_STD,
            # Read by vLLM only: its grid is image_size // patch_size per side.
            "image_size": patch_size * grid_per_side,
            "apply_vit_abs_pos_embed": True,
        },
        "text_config": {
            "vocab_size": thinker_vocab,
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "head_dim": head_dim,
            "moe_intermediate_size": spec.moe_intermediate,
            "num_experts": spec.experts,
            "num_experts_per_tok": spec.experts_per_tok,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 32768,
            "rope_parameters": text_rope,
            "rms_norm_eps": 1e-6,
            "initializer_range": INIT_STD,
            "tie_word_embeddings": False,
        },
        "audio_token_id": token_ids["<|audio_pad|>"],
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "audio_start_token_id": token_ids["<|audio_start|>"],
        "audio_end_token_id": token_ids["<|audio_end|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "user_token_id": token_ids["user"],
        "position_id_per_seconds": 13,
        "initializer_range": INIT_STD,
    }
    codebook = spec.codebook
    talker = {
        "text_config": {
            "vocab_size": codebook + _TALKER_SPECIAL_BLOCK,
            "hidden_size": spec.talker_hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.talker_layers,
            "num_attention_heads": talker_heads,
            "num_key_value_heads": max(1, talker_heads // 2),
            "head_dim": 32,
            "moe_intermediate_size": spec.moe_intermediate,
            "shared_expert_intermediate_size": spec.intermediate,
            "num_experts": spec.experts,
            "num_experts_per_tok": spec.experts_per_tok,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_parameters": talker_rope,
            "rms_norm_eps": 1e-6,
            "initializer_range": INIT_STD,
        },
        "code_predictor_config": {
            "vocab_size": codebook,
            "hidden_size": spec.talker_hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.predictor_layers,
            "num_attention_heads": talker_heads,
            "num_key_value_heads": max(1, talker_heads // 2),
            "head_dim": 32,
            "num_code_groups": spec.code_groups,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rms_norm_eps": 1e-6,
            "initializer_range": INIT_STD,
        },
        "num_code_groups": spec.code_groups,
        "thinker_hidden_size": spec.hidden,
        # The layer of the thinker's hidden states the talker reads (hidden_states[k]); real: 24 of 48.
        "accept_hidden_layer": max(1, spec.layers // 2),
        **{name: codebook + offset for name, offset in _CODEC_OFFSETS.items()},
        "speaker_id": {name: codebook + offset for name, offset in SPEAKERS.items()},
        "audio_token_id": token_ids["<|audio_pad|>"],
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "audio_start_token_id": token_ids["<|audio_start|>"],
        "position_id_per_seconds": 13,
        # Not declared by the config class, but the talker reads it for 3-D positions.
        "spatial_merge_size": 2,
        "initializer_range": INIT_STD,
    }
    code2wav = {
        "codebook_size": codebook,
        "hidden_size": spec.code2wav_hidden,
        "num_attention_heads": spec.code2wav_hidden // 32,
        "num_key_value_heads": spec.code2wav_hidden // 32,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.code2wav_layers,
        "num_quantizers": spec.code_groups,
        "sliding_window": 72,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": spec.decoder_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        # No greedy choice happens in code2wav; a large init would only clip the waveform to +-1.
        "initializer_range": CODE2WAV_INIT_STD,
    }
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=token_ids["<|im_start|>"],
        im_end_token_id=token_ids["<|im_end|>"],
        tts_pad_token_id=token_ids["<tts_pad>"],
        tts_bos_token_id=token_ids["<tts_text_bos>"],
        tts_eos_token_id=token_ids["<tts_text_eod>"],
        system_token_id=token_ids["system"],
        user_token_id=token_ids["user"],
        assistant_token_id=token_ids["assistant"],
        initializer_range=INIT_STD,
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    config.dtype = "float32"
    return config


def _mrope_section(head_dim: int) -> list[int]:
    """Split head_dim / 2 rotary pairs over (t, h, w) like the real [24, 20, 20] of 64."""
    half = head_dim // 2
    h = w = (half * 5) // 16
    return [half - h - w, h, w]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _corpus() -> list[str]:
    """A deterministic training corpus; role names repeat so each becomes a single token."""
    import random

    rng = random.Random(SEED)
    lines = []
    for _ in range(3000):
        words = rng.choices(_CORPUS_WORDS, k=rng.randint(4, 14))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    for role in ("system", "user", "assistant"):
        lines.extend([role] * 200)
    lines.extend(str(i) for i in range(1000))
    return lines


def _train_tokenizer(spec: TinySize) -> Any:
    """Train a Qwen2-style byte-level BPE (same pre-tokenizer regex) and append the specials."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    qwen_split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(qwen_split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.bpe_vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=t not in _NON_SPECIAL, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tokenizer


def _write_tokenizer_and_processor(directory: Path, spec: TinySize) -> dict[str, Any]:
    """Save tokenizer + processor files; return the ids the config needs (plus ``_vocab``)."""
    from transformers import (
        Qwen2TokenizerFast,
        Qwen2VLImageProcessorPil,
        WhisperFeatureExtractor,
    )

    raw = _train_tokenizer(spec)
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=EXTRA_SPECIAL_TOKENS,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
    )
    ids: dict[str, Any] = {t: raw.token_to_id(t) for t in SPECIAL_TOKENS}
    for role in ("system", "user", "assistant"):
        encoded = raw.encode(role, add_special_tokens=False).ids
        if len(encoded) != 1:  # generate() finds roles by a single token after <|im_start|>
            raise ConfigError(f"role {role!r} is not a single token in the tiny tokenizer: {encoded}")
        ids[role] = encoded[0]
    ids["_vocab"] = raw.get_vocab()

    feature_extractor = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=300,
        n_fft=400,
        padding_value=0.0,
        dither=0.0,
        return_attention_mask=True,
    )
    # The PIL twin of Qwen2VLImageProcessor: torchvision is not installed on CPU machines.
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        min_pixels=32 * 32 * 4,
        max_pixels=256 * 256,
    )
    # Qwen3OmniMoeProcessor itself cannot be built without torchvision (its video processor check
    # needs it), so write what its save_pretrained writes, as the real checkpoint lays it out: the
    # tokenizer files with the chat template, and one preprocessor_config.json holding both the
    # audio feature extractor and the image processor keys.
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    preprocessor = {**feature_extractor.to_dict(), **image_processor.to_dict()}
    preprocessor.pop("processor_class", None)
    preprocessor["feature_extractor_type"] = "WhisperFeatureExtractor"
    preprocessor["image_processor_type"] = "Qwen2VLImageProcessor"
    preprocessor["processor_class"] = "Qwen3OmniMoeProcessor"
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2, sort_keys=True) + "\n")
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen3OmniMoeProcessor",
             "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 256 * 256}}
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2, sort_keys=True) + "\n")
    return ids

