"""`SharedModels`: how an inline stage hands its loaded model to a stage deployed with
``share_model_with`` (the end-to-end use: omni-hunyuan's family contract, dit on ar's vLLM model)."""

from __future__ import annotations

import threading
import time

import pytest

from omni_core.errors import StageError
from omni_core.runtime.shared_models import SharedModels


def test_a_waiting_stage_gets_the_model_once_published_and_a_reload_replaces_it():
    models = SharedModels()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(models.wait("ar", 0, timeout=10)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive() and not got  # nothing published yet: it waits
    first = object()
    models.publish("ar", 0, first)
    waiter.join(5)
    assert got == [first]
    assert models.wait("ar", 0) is first  # published: no wait
    models.withdraw("ar", 0)  # the host reloads: later loads wait for its new model
    with pytest.raises(StageError, match="within 0.05 s"):
        models.wait("ar", 0, timeout=0.05)
    second = object()
    models.publish("ar", 0, second)
    assert models.wait("ar", 0) is second
    with pytest.raises(StageError, match="replica 1"):
        models.wait("ar", 1, timeout=0.05)  # replicas pair by index


def test_a_failed_host_load_ends_the_wait_with_its_reason():
    models = SharedModels()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            models.wait("ar", 0)
        except StageError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    models.publish("ar", 0, error="OSError: no weights")
    waiter.join(5)
    assert not waiter.is_alive() and len(errors) == 1 and "no weights" in str(errors[0])


async def test_after_its_host_reloads_a_sharing_stage_runs_on_the_new_model():
    """A host stage that fails a step reloads in place and publishes a new model; the stage sharing
    it loads again on that one before its next request (it does not keep the old one alive)."""
    import asyncio

    import attrs

    from omni_core.engine.async_engine import AsyncOmniEngine
    from omni_core.engine.request import OmniRequest
    from omni_core.testing.fakes import passthrough_pipeline

    pipeline = passthrough_pipeline(stages=2)
    host, guest = (attrs.evolve(s, runtime_ref="omni_core.testing.fakes:SharingRuntime") for s in pipeline.stages)
    pipeline = attrs.evolve(pipeline, stages=(host, attrs.evolve(guest, share_model_with="s0")))

    async def run(engine: AsyncOmniEngine, request: OmniRequest) -> dict:
        deltas = [d async for d in engine.generate(request)]
        return deltas[-1].data

    async with AsyncOmniEngine(pipeline) as engine:
        first = await asyncio.wait_for(run(engine, OmniRequest(prompt="a")), 30)
        assert first["s1_model"] == first["s0_model"]
        with pytest.raises(StageError, match="stage failure on purpose"):
            await asyncio.wait_for(run(engine, OmniRequest(prompt="b", params={"s0": {"fail": "stage"}})), 30)
        after = await asyncio.wait_for(run(engine, OmniRequest(prompt="c")), 30)
        assert after["s0_model"] != first["s0_model"]  # the host reloaded: a new model
        assert after["s1_model"] == after["s0_model"]  # and its guest runs on it
