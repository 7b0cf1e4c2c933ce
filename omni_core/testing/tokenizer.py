"""Tokenizers for tiny checkpoints, trained offline (no hub access) and deterministic."""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def train_byte_level_bpe(corpus: Iterable[str], vocab_size: int, special_tokens: Sequence[str]) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` (every byte stays encodable).

    Wrap it with ``transformers.PreTrainedTokenizerFast(tokenizer_object=...)`` and the family's
    chat template and special tokens to save it with a checkpoint.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer
