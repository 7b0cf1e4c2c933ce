"""The engine on a real two-stage pipeline: a tiny LM on real vLLM -> a vocoder stage, each in its own
process with shared-memory connectors (the toy family's default deploy). Routing, ordering,
batching, cancellation and failures, against transformers on the same weights."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import soundfile

from omni_core.config.resolve import resolve
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.engine.result import OmniResult
from omni_core.errors import InvalidRequestError, RequestCancelledError, StageError
from omni_core.testing.live_server import launch_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
# The async tests share the module-scoped engine, so they run on its (module-scoped) event loop.
ON_ENGINE_LOOP = pytest.mark.asyncio(loop_scope="module")

PROMPTS = ["Once upon a time", "hello", "The quick brown fox jumps", "a b c d e f g", "Omni", "what is this?", "numbers 1 2 3", "zz"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, host):
    """The family's default deploy: both stages in worker processes, shm connectors, streaming."""
    pipeline = resolve(str(model_dir), plugins=host)
    assert [s.placement for s in pipeline.stages] == ["process", "process"]
    async with AsyncOmniEngine(pipeline) as eng:
        yield eng


async def run(engine: AsyncOmniEngine, request: OmniRequest) -> tuple[OmniResult, list]:
    result = OmniResult(request.request_id)
    deltas = []
    async for delta in engine.generate(request):
        result.add(delta)
        deltas.append(delta)
    return result, deltas


def transformers_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir / "lm", dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


@ON_ENGINE_LOOP
async def test_text_and_audio_route_through_both_stages_in_order(engine, model_dir):
    request = OmniRequest(prompt=PROMPTS[0], modalities=("text", "audio"), params={"lm": {"max_tokens": 12, "ignore_eos": True}})
    result, deltas = await run(engine, request)
    assert result.token_ids == transformers_greedy(model_dir, result.prompt_token_ids, 12)
    text_deltas = [d for d in deltas if d.modality == "text"]
    audio_deltas = [d for d in deltas if d.modality == "audio"]
    assert len(text_deltas) == 12 and len(audio_deltas) > 1  # both streamed
    for group in (text_deltas, audio_deltas):
        assert [d.index for d in group] == list(range(len(group)))
        assert [d.final for d in group] == [False] * (len(group) - 1) + [True]
    assert result.sample_rate == 16000 and len(result.audio) == 8 * 12  # 8 samples per token frame


@ON_ENGINE_LOOP
async def test_text_only_request_skips_the_vocoder(engine):
    result, deltas = await run(engine, OmniRequest(prompt="hello", modalities=("text",), params={"lm": {"max_tokens": 4, "ignore_eos": True}}))
    assert {d.stage for d in deltas} == {"lm"} and result.audio is None and len(result.token_ids) == 4


@ON_ENGINE_LOOP
async def test_concurrent_requests_each_get_their_own_result(engine):
    def request(prompt: str) -> OmniRequest:
        return OmniRequest(prompt=prompt, modalities=("text", "audio"), params={"lm": {"max_tokens": 10}})

    alone = [await run(engine, request(p)) for p in PROMPTS[:3]]
    together = await asyncio.gather(*(run(engine, request(p)) for p in PROMPTS))
    for (a, _), (t, _) in zip(alone, together):
        assert a.token_ids == t.token_ids and a.text == t.text
        np.testing.assert_allclose(a.audio, t.audio, atol=1e-6)
    assert len({tuple(t.prompt_token_ids) for t, _ in together}) == len(PROMPTS)


@ON_ENGINE_LOOP
async def test_streaming_off_gives_the_same_result(engine, model_dir, host):
    request = lambda: OmniRequest(prompt=PROMPTS[2], modalities=("text", "audio"), params={"lm": {"max_tokens": 10, "ignore_eos": True}})  # noqa: E731
    streamed, _ = await run(engine, request())
    pipeline = resolve(str(model_dir), overrides=["streaming=false", "lm.placement=inline", "vocoder.placement=inline"], plugins=host)
    async with AsyncOmniEngine(pipeline) as whole:
        result, deltas = await run(whole, request())
    assert [d.final for d in deltas] == [True, True]  # one final chunk per stage
    assert result.token_ids == streamed.token_ids
    np.testing.assert_allclose(result.audio, streamed.audio, atol=1e-6)


@ON_ENGINE_LOOP
async def test_cancellation_frees_the_request_in_every_stage(engine):
    request = OmniRequest(prompt="long", modalities=("text", "audio"), params={"lm": {"max_tokens": 200, "ignore_eos": True}})
    stream = await engine.submit(request)
    first = await stream.__anext__()
    assert first.request_id == request.request_id
    engine.abort(request.request_id)
    with pytest.raises(RequestCancelledError):
        async for _ in stream:
            pass
    for _ in range(100):
        health = await engine.health()
        if all(h["active_requests"] == 0 for h in health):
            break
        await asyncio.sleep(0.05)
    assert all(h["healthy"] and h["active_requests"] == 0 for h in health), health
    result, _ = await run(engine, OmniRequest(prompt="after", params={"lm": {"max_tokens": 3, "ignore_eos": True}}))
    assert len(result.token_ids) == 3


@ON_ENGINE_LOOP
async def test_bad_input_fails_that_request_only(engine):
    too_long = OmniRequest(prompt="word " * 400, params={"lm": {"max_tokens": 4}})
    fine = OmniRequest(prompt="fine", params={"lm": {"max_tokens": 4, "ignore_eos": True}})
    bad, good = await asyncio.gather(run(engine, too_long), run(engine, fine), return_exceptions=True)
    assert isinstance(bad, InvalidRequestError) and "maximum context length is 256" in str(bad)
    assert len(good[0].token_ids) == 4


@ON_ENGINE_LOOP
async def test_stage_failure_and_crash_give_errors_then_recover(engine):
    failing = OmniRequest(prompt="x", modalities=("text", "audio"), params={"lm": {"max_tokens": 4}, "vocoder": {"fail": "stage"}})
    with pytest.raises(StageError, match="vocoder"):
        await asyncio.wait_for(run(engine, failing), 120)
    crashing = OmniRequest(prompt="x", modalities=("text", "audio"), params={"lm": {"max_tokens": 4}, "vocoder": {"fail": "crash"}})
    with pytest.raises(StageError, match="crashed"):
        await asyncio.wait_for(run(engine, crashing), 120)
    result, _ = await asyncio.wait_for(run(engine, OmniRequest(prompt="after", modalities=("text", "audio"), params={"lm": {"max_tokens": 4, "ignore_eos": True}})), 120)
    assert len(result.audio) == 32
    health = {h["stage"]: h for h in await engine.health()}
    assert health["vocoder"]["restarts"] == 1 and health["lm"]["restarts"] == 0


def omni(*args: str) -> subprocess.CompletedProcess:
    env = launch_env({"VLLM_LOGGING_LEVEL": "WARNING"})
    return subprocess.run([sys.executable, "-m", "omni_cli.main", *args], capture_output=True, text=True, timeout=240, env=env)


def test_cli_generate_json_writes_a_playable_wav(model_dir, tmp_path):
    out = tmp_path / "out"
    proc = omni("generate", str(model_dir), "--prompt", "hello", "--modalities", "text,audio", "--out", str(out), "--json",
                "--stage-params", '{"lm": {"max_tokens": 6, "ignore_eos": true}}')
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert len(result["token_ids"]) == 6 and result["prompt_token_ids"]
    assert result["token_ids"] == transformers_greedy(model_dir, result["prompt_token_ids"], 6)
    samples, rate = soundfile.read(result["audio"]["path"])
    assert rate == result["audio"]["sample_rate"] == 16000 and len(samples) == 48


def test_cli_errors_are_one_line_and_nothing_starts(model_dir):
    proc = omni("generate", str(model_dir), "--prompt", "x", "--set", "lm.max_num_seqz=3")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: stages.lm.options.max_num_seqz") and "did you mean 'max_num_seqs'" in last
    assert "vLLM" not in proc.stderr and "stage lm" not in proc.stderr  # rejected before anything started
    proc = omni("generate", str(model_dir), "--prompt", "x", "--modalities", "video")
    assert proc.returncode == 1 and "produces text, audio" in proc.stderr.strip().splitlines()[-1]
    proc = omni("generate", "no/such-model", "--prompt", "x")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("Error:")


def test_serve_on_a_port_in_use_fails_at_once_before_loading(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = omni("serve", str(model_dir), "--port", str(port))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"Error: cannot serve on 127.0.0.1:{port}: the address is already in use (another server? pick another --port)"
    assert "stage" not in proc.stderr, proc.stderr[-2000:]  # it failed before loading anything


def test_serve_a_stage_that_fails_to_load_ends_with_one_line(model_dir, tmp_path):
    """The load runs before uvicorn's startup: a stage that cannot load ends `omni serve` with the
    engine's one-line reason (exit 1), not uvicorn's "Application startup failed" and a traceback."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "vocoder" / "model.safetensors").write_bytes(b"not a safetensors file")
    proc = omni("serve", str(broken), "--port", "0")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: stage 'vocoder' failed: replica 0 failed to load:"), proc.stderr[-3000:]
    assert "Application startup failed" not in proc.stderr and "ready: serving" not in proc.stderr
