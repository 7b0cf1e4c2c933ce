"""`omni generate` on the tiny HunyuanImage-3.0: think-then-draw writes the text and a PNG; an
``--image`` runs i2t on vLLM (the image's block in the prompt ids)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import vllm  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)
from PIL import Image

MODEL = "omni-tiny/hunyuan-image3"
INLINE = ["--set", "ar.placement=inline", "--set", "dit.placement=inline", "--set", "ar.options.max_model_len=256"]


def _generate(*args: str) -> tuple[dict[str, Any], str]:
    from click.testing import CliRunner

    from omni_cli.main import cli

    result = CliRunner().invoke(cli, ["generate", MODEL, *args, "--json", *INLINE])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :]), result.stderr


def test_text_and_image_write_the_reasoning_and_a_png(tmp_path: Path) -> None:
    params = json.dumps({"ar": {"max_tokens": 6}, "dit": {"num_inference_steps": 2, "seed": 1}})
    body, stderr = _generate("--prompt", "a red apple", "--modalities", "text,image", "--stage-params", params, "--out", str(tmp_path))
    assert isinstance(body["text"], str) and body["text"] and body["token_ids"]
    path = Path(body["images"][0]["path"])
    assert path.suffix == ".png" and path.parent == tmp_path
    image = np.asarray(Image.open(path))
    assert image.ndim == 3 and list(image.shape) == body["images"][0]["shape"]
    assert "[dit] step 1/2" in stderr, stderr


def test_an_image_file_runs_i2t(tmp_path: Path, tokens: Any) -> None:
    picture = tmp_path / "red.png"
    Image.new("RGB", (100, 60), (200, 30, 30)).save(picture)
    params = json.dumps({"ar": {"max_tokens": 6, "ignore_eos": True}})
    body, _ = _generate("--prompt", "What is in the image?", "--image", str(picture), "--modalities", "text", "--stage-params", params)
    ids = body["prompt_token_ids"]
    assert ids.count(tokens.boi) == 1 and ids.count(tokens.joint_img_sep) == 1 and ids.count(tokens.image) > 2
    assert len(body["token_ids"]) == 6 and not body.get("images")


def test_an_unknown_task_is_refused_before_the_pipeline_loads() -> None:
    from click.testing import CliRunner

    from omni_cli.main import cli

    result = CliRunner().invoke(cli, ["generate", MODEL, "--prompt", "a cat", "--task", "bogus", *INLINE])
    assert result.exit_code == 1 and "unknown task 'bogus'" in result.output, result.output
    assert "Loading" not in result.output, result.output  # (refused from the resolved config, nothing loaded)
