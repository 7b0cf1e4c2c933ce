"""A diffusers modular pipeline checkpoint (``modular_model_index.json`` only) is read like a classic one."""

from __future__ import annotations

import json
from pathlib import Path

from omni_core.config.modelref import read_hf_config


def test_modular_model_index_is_read(tmp_path: Path) -> None:
    (tmp_path / "modular_model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3ModularPipeline"}))
    assert read_hf_config(tmp_path)["_class_name"] == "MiniMaxH3ModularPipeline"


def test_a_classic_index_wins_over_a_modular_one(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Classic"}))
    (tmp_path / "modular_model_index.json").write_text(json.dumps({"_class_name": "Modular"}))
    assert read_hf_config(tmp_path)["_class_name"] == "Classic"
