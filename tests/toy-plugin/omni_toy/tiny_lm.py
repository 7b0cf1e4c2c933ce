"""A tiny random-weight Qwen3 causal LM with an offline-trained tokenizer, for tests.

`write_tiny_lm(directory, seed)` writes a real transformers checkpoint (safetensors, config,
generation config, tokenizer) that both transformers and vLLM load. Weights are drawn with a
larger-than-usual std: with the default init, greedy decoding of random weights collapses to one
repeated token, and tests that compare token sequences need outputs that vary.
"""

from __future__ import annotations

from pathlib import Path

# Special tokens of the toy tokenizer; eos doubles as pad (as in Qwen checkpoints).
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

_CORPUS = """\
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


def _train_tokenizer(seed: int):  # -> transformers.PreTrainedTokenizerFast
    """Train a byte-level BPE tokenizer on the built-in corpus (deterministic, offline)."""
    from transformers import PreTrainedTokenizerFast

    from omni_core.testing.tokenizer import train_byte_level_bpe

    tokenizer = train_byte_level_bpe(_CORPUS.splitlines(), TOKENIZER_VOCAB_SIZE, SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def write_tiny_lm(directory: Path, seed: int = 0) -> None:
    """Write a tiny random Qwen3ForCausalLM checkpoint with tokenizer into `directory`.

    fp32, 2 layers, hidden 64, head_dim 32; identical files for the same `seed`.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(seed)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    # Round the vocabulary up so the embedding is a friendly shape; ids past the tokenizer are
    # simply never produced by it (the model may still sample them, they decode to "").
    vocab_size = -(-len(tokenizer) // 64) * 64

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config).to(torch.float32)

    # Our own generator: deterministic per seed without touching torch's global RNG state.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD, generator=generator)

    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    ).save_pretrained(directory)
