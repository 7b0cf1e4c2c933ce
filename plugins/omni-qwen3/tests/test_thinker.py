"""The Qwen3-Omni thinker on vLLM (CPU) against transformers' reference, on the tiny checkpoint.

Token ids (prompt and generated) must equal transformers' greedy ``generate`` for text, audio and
image prompts sent as OpenAI chat messages through the engine; the captured ``thinker_embeds`` /
``thinker_hidden`` rows must equal transformers' ``hidden_states[0]`` /
``hidden_states[accept_hidden_layer]``. The thinker runs alone here (the talker and code2wav
stages are tested by their own files).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import attrs
import pytest

import vllm  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)
import transformers  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)

from omni_qwen3.reference import load_model, prepare_inputs, reference_generate, paired_requests, sine_wave, synthetic_image  # noqa: E402

from omni_core.config import resolve  # noqa: E402
from omni_core.config.resolved import ResolvedPipeline  # noqa: E402
from omni_core.engine.offline import Omni  # noqa: E402
from omni_core.engine.request import OmniRequest  # noqa: E402
from omni_core.errors import InvalidRequestError  # noqa: E402
from omni_core.outputs import Chunk, StageInput  # noqa: E402
from omni_core.parts import PartContext  # noqa: E402
from omni_core.stages.ar import ARStageRuntime  # noqa: E402
from omni_core.testing.live_server import launch_env  # noqa: E402

MAX_TOKENS = 12
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0}


AUDIO = sine_wave(1.0)
IMAGE = synthetic_image(64, 96)
# The same requests in OpenAI format (what the engine takes) and in the reference's format.
OPENAI, REFERENCE = paired_requests(AUDIO, IMAGE)


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> Any:
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def references(tiny_dir: Path, hf_model: Any) -> dict[str, Any]:
    return {
        name: reference_generate(tiny_dir, messages, model=hf_model, return_audio=False, max_new_tokens=MAX_TOKENS)
        for name, messages in REFERENCE.items()
    }


def thinker_only(tiny_dir: Path, *overrides: str) -> ResolvedPipeline:
    """The resolved pipeline cut to its thinker stage (final), run inline."""
    pipeline = resolve(str(tiny_dir), overrides=("thinker.placement=inline", *overrides))
    thinker = attrs.evolve(pipeline.stage("thinker"), final=True)
    return attrs.evolve(pipeline, stages=(thinker,), default_modalities=("text",))


@pytest.fixture(scope="module")
def omni(tiny_dir: Path) -> Iterator[Omni]:
    with Omni(thinker_only(tiny_dir)) as engine:
        yield engine


def test_tokens_equal_transformers_for_text_audio_and_image(omni: Omni, references: dict[str, Any]) -> None:
    requests = [OmniRequest(messages=OPENAI[name], params={"thinker": GREEDY}) for name in OPENAI]
    results = omni.generate(requests)
    for name, result in zip(OPENAI, results):
        expected = references[name]
        assert len(set(expected.thinker_ids)) >= 3, "the tiny model's greedy output should vary"
        assert result.prompt_token_ids == expected.prompt_ids, name
        assert result.token_ids == expected.thinker_ids, name
        assert result.finish_reason in ("stop", "length")


def test_eight_concurrent_requests_equal_alone(omni: Omni) -> None:
    prompts = [f"hello world {' '.join(['the'] * i)} what is this picture" for i in range(8)]
    params = {"thinker": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    alone = [omni.generate(OmniRequest(prompt=p, params=params))[0].token_ids for p in prompts]
    together = [r.token_ids for r in omni.generate([OmniRequest(prompt=p, params=params) for p in prompts])]
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ([{"type": "input_audio", "input_audio": {"data": "not base64!!", "format": "wav"}}], "base64"),
        ([{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"junk" * 64).decode(), "format": "wav"}}], "decode the audio"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}}], "decode the image"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "data: URL"),
        ([{"type": "file", "file": {}}], "unsupported content part"),
        ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], "video"),
    ],
)
def test_bad_inputs_are_invalid_requests(omni: Omni, content: list[dict[str, Any]], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        omni.generate(OmniRequest(messages=[{"role": "user", "content": content}]))


def test_prompt_longer_than_the_context_is_invalid(omni: Omni) -> None:
    limit = omni.pipeline.stage("thinker").options["max_model_len"]
    with pytest.raises(InvalidRequestError, match="context"):
        omni.generate(OmniRequest(prompt="hello world " * limit))


# -- hidden states through the stage runtime ------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(tiny_dir: Path) -> Iterator[ARStageRuntime]:
    # 16 tokens a step: prompts are prefilled in chunks, mixed with other requests' decodes.
    pipeline = thinker_only(tiny_dir, "thinker.max_num_batched_tokens=16")
    stage_runtime = ARStageRuntime(pipeline, pipeline.stage("thinker"))
    stage_runtime.load()
    yield stage_runtime
    stage_runtime.close()


def _run(runtime: ARStageRuntime) -> dict[str, list[Chunk]]:
    chunks: dict[str, list[Chunk]] = {}
    for _ in range(500):
        if not runtime.has_unfinished():
            return chunks
        for chunk in runtime.step():
            chunks.setdefault(chunk.request_id, []).append(chunk)
    raise AssertionError("the thinker did not finish")


def test_hidden_states_equal_transformers(runtime: ARStageRuntime, tiny_dir: Path, hf_model: Any) -> None:
    import torch

    from omni_qwen3.inputs import Qwen3OmniInputProcessor

    processor = Qwen3OmniInputProcessor(PartContext(runtime.pipeline))
    for name in OPENAI:
        stage_input = processor.process(OmniRequest(messages=OPENAI[name], modalities=("text",)))["thinker"]
        stage_input.data["capture_hidden"] = True  # as for a request that wants audio
        runtime.add_request(name, StageInput(data=stage_input.data, params=GREEDY))
    runtime.add_request("no-audio", StageInput(data={"prompt_token_ids": [1, 2, 3], "capture_hidden": False}, params=GREEDY))
    chunks = _run(runtime)
    assert all("thinker_hidden" not in c.data and "thinker_embeds" not in c.data for c in chunks["no-audio"])
    layer = hf_model.config.talker_config.accept_hidden_layer
    for name in OPENAI:
        generated = [t for c in chunks[name] for t in c.data["token_ids"]]
        embeds = torch.cat([c.data["thinker_embeds"] for c in chunks[name] if "thinker_embeds" in c.data])
        hidden = torch.cat([c.data["thinker_hidden"] for c in chunks[name] if "thinker_hidden" in c.data])
        assert "hidden_states" not in chunks[name][0].data
        # Rows: every prompt token, in the first chunk only (the talker reads generated tokens'
        # rows from the token table), even where the prompt is prefilled over several steps (16
        # tokens a step here: the media prompts take several).
        assert len(generated) > 1 and all("thinker_embeds" not in c.data for c in chunks[name][1:])
        inputs = prepare_inputs(tiny_dir, REFERENCE[name])
        with torch.inference_mode():
            states = hf_model.thinker(**inputs, output_hidden_states=True).hidden_states
        assert embeds.shape == hidden.shape == (inputs["input_ids"].shape[1], hf_model.config.thinker_config.text_config.hidden_size)
        torch.testing.assert_close(embeds, states[0][0], atol=1e-4, rtol=1e-4, msg=f"{name}: embeddings")
        # Float32 noise grows with the values (up to ~80 here): the tolerance scales with them. The
        # image rows (vLLM's vision tower, summing in another order than transformers') differed
        # by up to 2.2e-4 on one machine (AMX) and less on others. A wrong row or layer differs by
        # the values' own size.
        expected = states[layer][0]
        atol = 2e-5 * float(expected.abs().max())
        torch.testing.assert_close(hidden, expected, atol=atol, rtol=1e-4, msg=f"{name}: layer {layer} (atol {atol:.1e})")


# -- the command line ------------------------------------------------------------------------------


def test_cli_generate_prints_token_ids(tmp_path: Path) -> None:
    env = launch_env({"OMNI_CACHE": str(tmp_path / "cache")})
    command = [str(Path(sys.executable).with_name("omni")), "generate", "omni-tiny/qwen3-omni", "--prompt", "hello",
               "--modalities", "text", "--stage-params", json.dumps({"thinker": {"max_tokens": 6}}), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout[done.stdout.index("{"):])
    assert out["prompt_token_ids"][:2] == [
        json.loads(next((tmp_path / "cache" / "tiny").glob("qwen3-omni*/config.json")).read_text())[k]
        for k in ("im_start_token_id", "user_token_id")
    ]
    assert 0 < len(out["token_ids"]) <= 6
