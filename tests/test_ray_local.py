"""``--set STAGE.placement=ray`` with nothing else: Omni starts a local Ray for the engine and stops
it at shutdown; the family's shared-memory edges yield to Mooncake around the Ray stage."""

from __future__ import annotations


import pytest
import ray

from omni_core.config.resolve import resolve
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.engine.result import OmniResult
from omni_core.plugins import load_plugins

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


async def test_set_placement_ray_starts_and_stops_a_local_ray(model_dir, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    host = load_plugins()
    pipeline = resolve(str(model_dir), overrides=["vocoder.placement=ray"], plugins=host)
    assert pipeline.stage("vocoder").inputs[0].connector == "mooncake-store"  # the family default named shm
    assert not ray.is_initialized()
    reference = resolve(str(model_dir), plugins=host)
    results = []
    for each in (pipeline, reference):
        async with AsyncOmniEngine(each) as engine:
            request = OmniRequest(prompt="hello", modalities=("text", "audio"), params={"lm": {"max_tokens": 6, "ignore_eos": True}})
            result = OmniResult(request.request_id)
            async for delta in engine.generate(request):
                result.add(delta)
            results.append(result)
            placements = {entry["stage"]: entry["placement"] for entry in await engine.health()}
            assert placements == ({"lm": "process", "vocoder": "ray"} if each is pipeline else {"lm": "process", "vocoder": "process"})
        assert not ray.is_initialized()  # the engine's own Ray is gone with it
    assert results[0].token_ids == results[1].token_ids and list(results[0].audio) == list(results[1].audio)
