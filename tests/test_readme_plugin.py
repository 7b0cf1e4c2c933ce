"""The README's plugin example is a complete, working plugin: install exactly its files, run its commands.

The files are the README's fenced blocks under "## Writing a plugin" whose info string names a
path (```python omni_tone/parts.py). They are installed with pip into a directory of their own
(put on PYTHONPATH for the commands only: the test environment is left as it was), then
`omni plugins`, `omni make-tiny`, `omni generate` and `omni serve` run as a user would run them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest

from omni_core.testing.live_server import LiveServer, launch_env, omni_command

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w+) (\S+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
RATE, BEEP = 16000, 0.1  # what the example's Beeps model says: 0.1 s at 16 kHz per token

pytestmark = pytest.mark.vllm


def readme_files() -> dict[str, str]:
    section = README.read_text(encoding="utf-8").split("## Writing a plugin", 1)[1].split("\n## ", 1)[0]
    return {path: body for _language, path, body in FENCE.findall(section)}


def test_readme_states_the_example_size() -> None:
    files = readme_files()
    python = [body for path, body in files.items() if path.endswith(".py")]
    lines = sum(len(body.splitlines()) for body in python)
    assert f"({lines} lines of Python)" in README.read_text(encoding="utf-8")
    assert lines < 80


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The example installed into a directory of its own; the environment the commands run in."""
    source = tmp_path_factory.mktemp("omni-tone")
    for path, body in readme_files().items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(body, encoding="utf-8")
    (source / "omni_tone" / "__init__.py").touch()
    target = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(source)]
    subprocess.run(pip, check=True, capture_output=True)
    return launch_env({"PYTHONPATH": str(target)})


def omni(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([*omni_command(), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def checkpoint(installed: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tone-ckpt")
    omni(installed, "make-tiny", "tone", str(directory))
    return directory


def test_the_plugin_registers_its_family_and_route(installed: dict[str, str]) -> None:
    plugins = {entry["name"]: entry for entry in json.loads(omni(installed, "plugins"))}
    assert plugins["omni-tone"]["error"] is None
    assert plugins["omni-tone"]["registered"]["families"] == ["tone"]
    assert plugins["omni-tone"]["registered"]["routes"] == ["omni_tone.routes:stages"]


def test_generate_writes_text_and_one_beep_per_token(installed: dict[str, str], checkpoint: Path, tmp_path: Path) -> None:
    out = json.loads(omni(installed, "generate", str(checkpoint), "--prompt", "hi", "--modalities", "text,audio", "--out", str(tmp_path), "--json"))
    tokens = out["token_ids"]
    assert out["text"] and len(tokens) == 8  # the pipeline's max_tokens, greedy
    with wave.open(out["audio"]["path"]) as wav:
        assert wav.getframerate() == RATE
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16) / 32767.0
    t = np.arange(int(RATE * BEEP)) / RATE
    expected = np.concatenate([np.sin(2 * np.pi * (200.0 + 4.0 * token) * t) for token in tokens])
    np.testing.assert_allclose(samples, expected, atol=2e-4)  # 16-bit PCM


def test_serve_answers_its_route_and_chat(installed: dict[str, str], checkpoint: Path) -> None:
    server = LiveServer.start(str(checkpoint), env={"PYTHONPATH": installed["PYTHONPATH"]})
    try:
        assert httpx.get(f"{server.url}/v1/tone/stages").json() == {"stages": ["lm", "tone"]}
        body = {"model": str(checkpoint), "modalities": ["text", "audio"], "messages": [{"role": "user", "content": "hi"}]}
        message = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        assert message["content"] and message["audio"]["data"]
    finally:
        server.close()
