"""A Cosmos3 diffusion stage over two gloo ranks on CPU (the ``parallel`` option): CFG-parallel
and Ulysses give the images one process gives, alone and batched with other requests; a rank
that dies fails its requests and the group restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import psutil
import pytest

from omni_core.config import resolve
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.errors import ConfigError, StageError

from .test_cosmos3 import INLINE, MODEL, REQUESTS, make_runtime, pixels, request, run

pytestmark = pytest.mark.timeout(600)

# One request alone, then four together (two shapes, guidance on and off, a video with sound, a
# token count that does not split evenly over two ranks) joined midway by a fifth (step
# batching), and a cached request.
ALONE = {"apple": REQUESTS["apple"]}
TOGETHER = {**REQUESTS, "odd": request("a lighthouse at night", seed=2, size=(48, 48), steps=4, guidance=3.0)}
LATER = {"late": request("a boat on a lake", seed=8, size=(32, 48), steps=3, guidance=5.0)}
CACHED = {"cached": request("a robot arm picks up a blue cube", seed=11, size=(32, 32), steps=8, cache={"mode": "first_block", "threshold": 0.3})}


@pytest.fixture(scope="module")
def pipeline():
    return resolve(MODEL, overrides=INLINE)


def run_all(runtime) -> dict[str, dict]:
    outputs = run(runtime, ALONE)
    outputs |= run(runtime, TOGETHER, joins={2: LATER})
    outputs |= run(runtime, CACHED)
    return outputs


@pytest.fixture(scope="module")
def single(pipeline):
    runtime = make_runtime(pipeline, admission_window_ms=0.0)
    try:
        return run_all(runtime)
    finally:
        runtime.close()


@pytest.mark.parametrize("parallel", [{"cfg": 2}, {"ulysses": 2}], ids=["cfg2", "ulysses2"])
def test_two_ranks_give_the_images_of_one_process(pipeline, single, parallel):
    runtime = make_runtime(pipeline, admission_window_ms=0.0, parallel=parallel)
    try:
        assert [r["device"] for r in runtime.health_stats()["ranks"]] == ["cpu", "cpu"]
        outputs = run_all(runtime)
        assert max(runtime.batch_sizes) >= 3  # the requests shared forwards
    finally:
        runtime.close()
    assert set(outputs) == set(single)
    for rid, expected in single.items():
        got = outputs[rid]
        assert pixels(got).shape == pixels(expected).shape, rid
        assert np.abs(pixels(got).astype(int) - pixels(expected).astype(int)).max() <= 1, rid
        if "audio" in expected:
            np.testing.assert_allclose(got["audio"], expected["audio"], atol=1e-4)
    assert outputs["cached"]["cache"] == single["cached"]["cache"] and single["cached"]["cache"]["skipped_steps"] > 0


def test_a_rank_that_dies_fails_its_requests_and_the_group_restarts(single):
    pipeline = resolve(MODEL, overrides=["generator.placement=process", "generator.options.parallel.cfg=2"])
    slow = {"num_inference_steps": 200, "guidance_scale": 4.0}

    async def main() -> None:
        async with AsyncOmniEngine(pipeline) as engine:
            (entry,) = await engine.health()
            ranks = entry["ranks"]
            assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] == entry["pid"]
            doomed = asyncio.ensure_future(_collect(engine, OmniRequest(prompt="a slow one", modalities=("image",), params={"generator": slow}, extra={"size": [32, 32]})))
            await _wait_running(engine)
            os.kill(ranks[1]["pid"], signal.SIGKILL)
            with pytest.raises(StageError, match="rank 1 of 2 exited"):
                await asyncio.wait_for(doomed, 60)
            await _wait_restarted(engine)
            item = ALONE["apple"]
            params = {k: v for k, v in item.params.items()}
            deltas = await asyncio.wait_for(
                _collect(engine, OmniRequest(prompt=item.data["prompt"], modalities=("image",), params={"generator": params}, extra={"seed": item.data["seed"], "size": list(item.data["size"])})),
                120,
            )
            image = deltas[-1].data["image"]
            assert np.abs(image.astype(int) - single["apple"]["image"].astype(int)).max() <= 1
            (entry,) = await engine.health()
            assert entry["restarts"] == 1 and entry["healthy"] and entry["ranks"][1]["pid"] != ranks[1]["pid"]
            for old in ranks:
                assert not psutil.pid_exists(old["pid"]) or psutil.Process(old["pid"]).status() == psutil.STATUS_ZOMBIE

    asyncio.run(main())


async def _collect(engine, request):
    return [delta async for delta in engine.generate(request)]


async def _wait_restarted(engine, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (entry,) = await engine.health()
        if entry["restarts"] == 1 and entry["healthy"]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the replica did not restart: {entry}")


async def _wait_running(engine, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (entry,) = await engine.health()
        if entry.get("active_requests"):
            await asyncio.sleep(0.5)  # into its denoising steps
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the request never started")


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (INLINE + ("generator.options.parallel.cfg=2",), "stages.generator.placement", "place it in a process"),
        (("generator.options.parallel.ulysses=2", "generator.options.cuda_graphs=true"), "stages.generator.options.cuda_graphs", "do not combine"),
        (("generator.options.parallel.ulysses=2", "generator.devices=[cpu]"), "stages.generator.devices", "needs 2 devices"),
        (("generator.options.parallel.cfg=3",), "stages.generator.options.parallel", "must be in (1, 2)"),
        (("generator.options.parallel.ulysses=4",), "stages.generator.options.parallel", "ulysses 4 does not divide the 2 attention heads"),
    ],
)
def test_parallel_settings_it_cannot_run_are_config_errors(overrides, key, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        resolve(MODEL, overrides=list(overrides))
    assert info.value.key == key
