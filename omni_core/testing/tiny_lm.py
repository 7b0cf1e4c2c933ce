"""`tiny_lm`: a tiny random-weight causal LM with an offline-trained tokenizer, for plugins' tests.

``tiny_lm(directory, arch="Qwen3ForCausalLM")`` writes a real transformers checkpoint
(``config.json``, ``model.safetensors``, ``generation_config.json`` and a tokenizer with a chat
template) that transformers and vLLM (also on CPU) both load. A family whose pipeline has a plain
LM stage builds its ``make_tiny`` on it; the same arguments and seed give identical files.

Weights are drawn with a larger-than-usual std (`INIT_STD`): with the default init, greedy decoding
of random weights collapses to one repeated token, and tests that compare token sequences need
outputs that vary. Needs torch, transformers and tokenizers (``pip install 'omni-core[testing]'``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

# Special tokens of the tokenizer; eos doubles as pad (as in Qwen checkpoints).
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

TOKENIZER_VOCAB_SIZE = 512
HIDDEN_SIZE = 64
HEAD_DIM = 32  # vLLM's CPU attention accepts 32, 64, 80, ...; 16 fails
NUM_LAYERS = 2
INIT_STD = 0.4

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model reads a small book.
Omni serves models that listen, look, speak and draw. Every stage runs in a batch.
Once upon a time there was a little robot who liked to count the stars at night.
She counted one, two, three, four, five, six, seven, eight, nine and ten stars.
The weather today is sunny with a gentle breeze from the west, and the sea is calm.
Hello world! How are you today? I am fine, thank you. What is your name?
My name is Tiny. I am a language model with two layers and very few weights.
Please describe the picture: a red apple on a wooden table next to a cup of tea.
Music, speech and sound travel as waves; images and video are grids of pixels.
The engine schedules requests, runs the model, samples tokens and streams text.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) " ' -
"""
"""What the tokenizer is trained on (English text, digits, punctuation)."""


@attrs.frozen
class _Architecture:
    model_type: str
    # False where vLLM ignores ``config.head_dim`` and takes hidden_size / num_attention_heads.
    explicit_head_dim: bool = True


ARCHITECTURES: Mapping[str, _Architecture] = {
    "Qwen3ForCausalLM": _Architecture("qwen3"),
    "LlamaForCausalLM": _Architecture("llama"),
    "Qwen2ForCausalLM": _Architecture("qwen2", explicit_head_dim=False),
}
"""The architectures `tiny_lm` writes: each loads in transformers and in vLLM."""


@attrs.frozen
class TinyLM:
    """What `tiny_lm` wrote: the directory and its ``config.json`` (to size other parts to the LM)."""

    path: Path
    config: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def eos_token_id(self) -> int:
        return int(self.config["eos_token_id"])


def tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE, corpus: str = CORPUS) -> Any:
    """The tiny LM's tokenizer: a `transformers.PreTrainedTokenizerFast`, trained offline on `corpus`.

    Byte-level BPE (every byte stays encodable) with `SPECIAL_TOKENS` and `CHAT_TEMPLATE`;
    deterministic for the same arguments.
    """
    from transformers import PreTrainedTokenizerFast

    from omni_core.testing.tokenizer import train_byte_level_bpe

    tokenizer = train_byte_level_bpe(corpus.splitlines(), vocab_size, SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def tiny_lm(
    directory: str | Path,
    arch: str = "Qwen3ForCausalLM",
    *,
    seed: int = 0,
    hidden_size: int = HIDDEN_SIZE,
    num_layers: int = NUM_LAYERS,
    head_dim: int = HEAD_DIM,
    num_attention_heads: int | None = None,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    tokenizer_vocab_size: int = TOKENIZER_VOCAB_SIZE,
    max_position_embeddings: int = 512,
    init_std: float = INIT_STD,
    tie_word_embeddings: bool = False,
    config: Mapping[str, Any] | None = None,
) -> TinyLM:
    """Write a tiny random-weight causal LM of architecture `arch` (see `ARCHITECTURES`) into `directory`.

    float32 weights drawn from ``N(0, init_std)`` by a generator seeded with `seed` (norm weights 1),
    so the same arguments give identical files. `num_attention_heads` defaults to 4 (or
    ``hidden_size // head_dim`` where vLLM derives the head dim); `intermediate_size` to twice the
    hidden size; the vocabulary is the tokenizer's, rounded up to a multiple of 64 (ids past the
    tokenizer decode to ""). `config` adds or replaces ``config.json`` fields.
    """
    import torch
    import transformers

    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise ValueError(f"tiny_lm cannot write {arch!r}; it writes: {', '.join(ARCHITECTURES)}")
    heads = _attention_heads(spec, arch, hidden_size, head_dim, num_attention_heads)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(tokenizer_vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    vocab_size = -(-len(tokenizer) // 64) * 64

    hf_config = transformers.AutoConfig.for_model(
        spec.model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=min(num_key_value_heads, heads),
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
        **dict(config or {}),
    )
    hf_config.architectures = [arch]
    model = getattr(transformers, arch)(hf_config).to(torch.float32)

    # Our own generator: deterministic per seed without touching torch's global RNG state.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, init_std, generator=generator)

    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    transformers.GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    ).save_pretrained(directory)
    return TinyLM(directory, json.loads((directory / "config.json").read_text()))


def _attention_heads(spec: _Architecture, arch: str, hidden_size: int, head_dim: int, requested: int | None) -> int:
    if spec.explicit_head_dim:
        return requested or 4
    derived = hidden_size // head_dim
    if requested not in (None, derived) or derived * head_dim != hidden_size:
        raise ValueError(
            f"{arch}: vLLM derives the head dim as hidden_size / num_attention_heads, so hidden_size "
            f"({hidden_size}) must equal num_attention_heads x head_dim ({requested} x {head_dim}); "
            f"leave num_attention_heads unset for {derived or 1}"
        )
    return derived
