"""`omni make-tiny minimax-h3 DIR`: the diffusers modular layout, written by the library classes' own save_pretrained."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


def test_make_tiny_writes_the_released_layout_with_sizes_from_config(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from diffusers import ModularPipeline

    from omni_cli.main import cli
    from omni_core.config import resolve

    result = CliRunner().invoke(cli, ["make-tiny", "minimax-h3", str(tmp_path / "tiny")])
    assert result.exit_code == 0, result.output
    root = tmp_path / "tiny"
    index = json.loads((root / "modular_model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline" and index["_blocks_class_name"] == "MiniMaxH3Blocks"
    for name in ("transformer", "transformer_ref", "text_encoder", "tokenizer", "processor", "vae", "audio_vae", "scheduler", "audio_scheduler"):
        assert (root / name).is_dir(), name
        assert index[name][0] in ("diffusers", "transformers"), name
    assert resolve(str(root)).family == "minimax-h3"

    pipe = ModularPipeline.from_pretrained(str(root))
    pipe.load_components(names=["transformer", "text_encoder", "vae", "audio_vae", "scheduler", "audio_scheduler"])
    transformer, text, vae, audio = pipe.transformer.config, pipe.text_encoder.config.text_config, pipe.vae.config, pipe.audio_vae.config
    assert text.num_hidden_layers > pipe.text_encoder_layer  # the conditioning layer exists
    assert transformer.text_dim == text.hidden_size
    assert transformer.in_channels == vae.latent_channels and transformer.audio_in_channels == audio.latent_channels
    assert audio.sampling_rate == 40 * math.prod(audio.encoder_rates) >= 7350  # 40 latents/s; AAC needs >= 7.35 kHz
    assert (pipe.scheduler.config.shift, pipe.audio_scheduler.config.shift) == (12.0, 3.0)
    assert len(vae.latents_mean) == len(vae.latents_std) == vae.latent_channels


def test_unknown_size_names_the_sizes() -> None:
    from omni_minimax_h3.tiny import make_tiny

    with pytest.raises(ValueError, match="tiny"):
        make_tiny(Path("/nonexistent"), "huge")
