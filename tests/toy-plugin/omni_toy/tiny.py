"""Tiny random-weight checkpoints of the toy families (what ``omni make-tiny toy DIR`` writes)."""

from __future__ import annotations

import json
from pathlib import Path

TOY_ARCHITECTURE = "OmniToyPipeline"
TOY_MODEL_TYPE = "omni-toy"
PASSTHROUGH_ARCHITECTURE = "OmniToyPassThrough"
PASSTHROUGH_MODEL_TYPE = "omni-toy-passthrough"
LM_ARCHITECTURE = "Qwen3ForCausalLM"  # the `lm/` folder, written by omni_core.testing.tiny_lm
SIZES = ("tiny",)


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for the toy families; choose one of: {', '.join(SIZES)}")


def make_tiny(directory: Path, size: str = "tiny") -> None:
    """Write the ``toy`` checkpoint: root ``config.json``, ``lm/`` (Qwen3 + tokenizer), ``vocoder/``."""
    from omni_core.testing.tiny_lm import tiny_lm
    from omni_toy.vocoder import write_vocoder

    _check_size(size)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lm = tiny_lm(directory / "lm", LM_ARCHITECTURE, seed=0)
    # The vocoder takes the LM's token ids (or hidden states) as frames: size it to the LM.
    write_vocoder(directory / "vocoder", vocab_size=lm.vocab_size, input_hidden_size=lm.hidden_size, seed=0)
    _write_root_config(directory, TOY_ARCHITECTURE, TOY_MODEL_TYPE)


def make_tiny_passthrough(directory: Path, size: str = "tiny") -> None:
    """Write the ``toy-passthrough`` checkpoint: only a root ``config.json`` (the stage has no weights)."""
    _check_size(size)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_root_config(directory, PASSTHROUGH_ARCHITECTURE, PASSTHROUGH_MODEL_TYPE)


def _write_root_config(directory: Path, architecture: str, model_type: str) -> None:
    config = {"architectures": [architecture], "model_type": model_type}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
