"""The ``ray`` placement on a simulated two-node Ray cluster (one machine, two raylets).

The toy family's LM runs on node a and its vocoder on node b, with the edges over Mooncake (the
default once omni-connectors-mooncake is installed: the ends sit on different nodes). Ray, vLLM
and the Mooncake plugin are real; nothing is skipped when one is missing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Iterator

import attrs
import numpy as np
import pytest
import pytest_asyncio
import ray  # noqa: F401  (the test needs it: fail here when it is missing)

from omni_core.config.resolve import resolve
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.engine.result import OmniResult
from omni_core.errors import StageError
from omni_core.server.errors import to_api_error
from omni_core.testing.ray_cluster import SimulatedCluster, simulated_cluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]


def request(prompt: str = "hello", tokens: int = 10) -> OmniRequest:
    return OmniRequest(prompt=prompt, modalities=("text", "audio"), params={"lm": {"max_tokens": tokens, "ignore_eos": True}})


async def run(engine: AsyncOmniEngine, omni_request: OmniRequest) -> OmniResult:
    result = OmniResult(omni_request.request_id)
    async for delta in engine.generate(omni_request):
        result.add(delta)
    return result


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimulatedCluster]:
    with simulated_cluster(("a", "b")) as running:
        yield running


def two_nodes(cluster: SimulatedCluster) -> dict:
    return {
        "ray": {"address": cluster.address},
        "stages": {"lm": {"placement": "ray", "ray": cluster.deploy_pin("a")}, "vocoder": {"placement": "ray", "ray": cluster.deploy_pin("b")}},
    }


@pytest.fixture(scope="module")
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(previous)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, host, cluster, records):
    pipeline = resolve(str(model_dir), deploy=two_nodes(cluster), plugins=host)
    async with AsyncOmniEngine(pipeline) as eng:
        yield eng


async def test_the_edges_between_nodes_get_mooncake(model_dir, host, cluster):
    pipeline = resolve(str(model_dir), deploy=two_nodes(cluster), plugins=host)
    assert pipeline.stage("vocoder").inputs[0].connector == "mooncake-store"
    assert pipeline.output_connector == "mooncake-store"
    assert pipeline.stage("vocoder").placement_options["resources"] == {"node_b": 0.01}


async def test_outputs_equal_the_single_host_run(engine, model_dir, host):
    prompts = ["Once upon a time", "hello", "a b c d e f g"]
    on_ray = [await run(engine, request(p)) for p in prompts]
    async with AsyncOmniEngine(resolve(str(model_dir), plugins=host)) as local:
        alone = [await run(local, request(p)) for p in prompts]
    for ours, reference in zip(on_ray, alone):
        assert ours.token_ids == reference.token_ids and len(ours.token_ids) == 10
        np.testing.assert_array_equal(ours.audio, reference.audio)


async def test_each_actor_runs_on_its_node(engine, cluster):
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    for stage, node in (("lm", "node_a"), ("vocoder", "node_b")):
        actor = engine.groups[stage].replicas[0]._actor
        assert node in nodes[await asyncio.wrap_future(actor.node.remote().future())]


async def test_worker_logs_reach_the_engine_log_with_the_stage_name(engine, records):
    for stage in ("lm", "vocoder"):
        assert any(line.startswith(f"[{stage}:0] on node ") for line in records.lines), records.lines[-20:]


async def test_a_dead_actor_fails_its_requests_in_time_and_is_restarted(engine):
    stream = engine.generate(request("long", tokens=200))

    async def first_audio() -> None:
        async for delta in stream:
            if delta.modality == "audio":
                return

    async def rest() -> None:
        async for _ in stream:
            pass

    # Killed once the vocoder has sent this request's first audio: in flight there, most of its
    # tokens still to come (a fixed sleep let a fast run finish all 200 first).
    await asyncio.wait_for(first_audio(), 60)
    in_flight = asyncio.create_task(rest())
    killed = time.monotonic()
    ray.kill(engine.groups["vocoder"].replicas[0]._actor)
    # The crash is the error, even when the read of an output the dead actor held fails first.
    with pytest.raises(StageError, match="vocoder.*crashed") as info:
        await asyncio.wait_for(in_flight, 10)
    assert time.monotonic() - killed < 5
    assert to_api_error(info.value).status == 500  # what the server answers
    result = await asyncio.wait_for(run(engine, request()), 120)  # waits for the new actor
    assert len(result.token_ids) == 10 and len(result.audio) > 0
    health = {entry["stage"]: entry for entry in await engine.health()}
    assert health["vocoder"]["restarts"] == 1 and health["vocoder"]["healthy"] and health["vocoder"]["placement"] == "ray"


async def test_a_hung_actor_is_killed_by_the_watchdog_and_restarted(model_dir, host, cluster):
    """`watchdog_s` on the ``ray`` placement: an actor that answers nothing (stopped with SIGSTOP)
    is killed through Ray, its request fails saying why, and a new actor serves the next one."""
    deploy = two_nodes(cluster)
    deploy["stages"]["vocoder"]["watchdog_s"] = 2
    async with AsyncOmniEngine(resolve(str(model_dir), deploy=deploy, plugins=host)) as engine:
        await asyncio.wait_for(run(engine, request()), 120)
        pid = {entry["stage"]: entry for entry in await engine.health()}["vocoder"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(StageError, match=r"vocoder.*replica 0 answered no ping for 2 s"):
            await asyncio.wait_for(run(engine, request("stuck")), 30)
        assert time.monotonic() - stopped < 2 + 1 + 5  # timeout + probe interval + Ray's kill
        result = await asyncio.wait_for(run(engine, request()), 120)
        assert len(result.token_ids) == 10 and len(result.audio) > 0
        assert engine.groups["vocoder"].restarts == [1]


async def test_a_checkpoint_missing_on_a_node_is_named(model_dir, host, cluster, tmp_path):
    pipeline = resolve(str(model_dir), deploy=two_nodes(cluster), plugins=host)
    elsewhere = attrs.evolve(pipeline, model_path=str(tmp_path / "not-on-this-node"))
    with pytest.raises(StageError) as info:
        async with AsyncOmniEngine(elsewhere):
            pass
    assert f"the checkpoint {tmp_path / 'not-on-this-node'} does not exist on the node" in str(info.value)
