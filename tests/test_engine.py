"""Engine and orchestrator logic on pass-through stages: routing, ordering, params, cancellation,
failures, replicas and restarts, inline and in processes. (The real-model pipeline is tested in
test_toy_pipeline.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.errors import InvalidRequestError, RequestCancelledError, StageError
from omni_core.runtime.messages import Ping
from omni_core.runtime.replica import KERNEL_CACHE_ENV, InlineReplica
from omni_core.testing.fakes import passthrough_pipeline
from omni_core.testing.live_server import launch_env

pytestmark = pytest.mark.timeout(120)


async def collect(engine: AsyncOmniEngine, request: OmniRequest) -> list:
    return [delta async for delta in engine.generate(request)]


@pytest.fixture(params=["inline", "process"])
async def engine(request):
    pipeline = passthrough_pipeline(stages=3, placement=request.param)
    async with AsyncOmniEngine(pipeline) as eng:
        yield eng


async def test_routes_through_every_stage(engine):
    deltas = await collect(engine, OmniRequest(prompt="hello"))
    assert len(deltas) == 1
    (delta,) = deltas
    assert delta.final and delta.stage == "s2" and delta.modality == "text"
    assert delta.data == {"prompt": "hello", "s0": 0, "s1": 0, "s2": 0, "s0_replica": 0, "s1_replica": 0, "s2_replica": 0}


async def test_streams_chunks_in_order(engine):
    request = OmniRequest(prompt="x", params={"s0": {"repeat": 5}})
    deltas = await collect(engine, request)
    assert [d.data["s0"] for d in deltas] == [0, 1, 2, 3, 4]
    assert [d.index for d in deltas] == [0, 1, 2, 3, 4]
    assert [d.final for d in deltas] == [False] * 4 + [True]


async def test_many_concurrent_requests_keep_their_data(engine):
    requests = [OmniRequest(prompt=f"p{i}", params={"s1": {"repeat": 1 + i % 3}}) for i in range(24)]
    results = await asyncio.gather(*(collect(engine, r) for r in requests))
    for i, deltas in enumerate(results):
        assert {d.data["prompt"] for d in deltas} == {f"p{i}"}
        assert len(deltas) == 1 + i % 3
        assert deltas[-1].final


async def test_request_failure_fails_only_that_request(engine):
    bad = OmniRequest(prompt="bad", params={"s1": {"fail": "request"}})
    good = [OmniRequest(prompt=f"ok{i}") for i in range(4)]
    results = await asyncio.gather(collect(engine, bad), *(collect(engine, r) for r in good), return_exceptions=True)
    assert isinstance(results[0], StageError) and "on purpose" in str(results[0])
    assert all(isinstance(r, list) and r[-1].data["prompt"] == f"ok{i}" for i, r in enumerate(results[1:]))


async def test_invalid_input_is_a_client_error(engine):
    with pytest.raises(InvalidRequestError, match="invalid on purpose"):
        await collect(engine, OmniRequest(prompt="x", params={"s2": {"fail": "invalid"}}))
    assert (await collect(engine, OmniRequest(prompt="after")))[-1].data["prompt"] == "after"


async def test_stage_failure_errors_then_recovers(engine):
    with pytest.raises(StageError, match="s1.*on purpose"):
        await asyncio.wait_for(collect(engine, OmniRequest(prompt="x", params={"s1": {"fail": "stage"}})), 60)
    assert (await collect(engine, OmniRequest(prompt="after")))[-1].data["prompt"] == "after"


async def test_cancellation_reaches_every_stage(engine):
    request = OmniRequest(prompt="x", params={"s1": {"hold": True}})
    task = asyncio.create_task(collect(engine, request))
    for _ in range(200):  # wait until s1 holds it
        health = {h["stage"]: h for h in await engine.health()}
        if health["s1"]["active_requests"] == 1:
            break
        await asyncio.sleep(0.01)
    assert health["s1"]["active_requests"] == 1
    engine.abort(request.request_id)
    with pytest.raises(RequestCancelledError):
        await task
    health = await engine.health()
    assert all(h["healthy"] and h["active_requests"] == 0 for h in health), health
    assert engine.num_active_requests == 0


async def test_params_merge_with_stage_defaults():
    pipeline = passthrough_pipeline(stages=2)
    stages = list(pipeline.stages)
    stages[0] = attrs.evolve(stages[0], params={"repeat": 2, "stop_token_ids": [7]})
    pipeline = attrs.evolve(pipeline, stages=tuple(stages))
    async with AsyncOmniEngine(pipeline) as engine:
        assert len(await collect(engine, OmniRequest(prompt="a"))) == 2  # default kept
        assert len(await collect(engine, OmniRequest(prompt="a", params={"s0": {"repeat": 3}}))) == 3
        assert len(await collect(engine, OmniRequest(prompt="a", params={"s0": {"other": 1}}))) == 2


async def test_rejects_unknown_modality_and_stage():
    async with AsyncOmniEngine(passthrough_pipeline(stages=2)) as engine:
        with pytest.raises(InvalidRequestError, match="produces text"):
            await collect(engine, OmniRequest(prompt="a", modalities=("audio",)))
        with pytest.raises(InvalidRequestError, match="unknown stage 'nope'"):
            await collect(engine, OmniRequest(prompt="a", params={"nope": {}}))


async def test_crashed_process_fails_its_requests_and_restarts():
    async with AsyncOmniEngine(passthrough_pipeline(stages=2, placement="process")) as engine:
        with pytest.raises(StageError, match="crashed"):
            await asyncio.wait_for(collect(engine, OmniRequest(prompt="x", params={"s1": {"fail": "crash"}})), 60)
        deltas = await asyncio.wait_for(collect(engine, OmniRequest(prompt="after")), 60)
        assert deltas[-1].data["prompt"] == "after"
        health = {h["stage"]: h for h in await engine.health()}
        assert health["s1"]["restarts"] == 1 and health["s1"]["healthy"]


async def test_only_crashes_close_together_stop_the_restarts():
    """Crashes spread out in time (here: further apart than a 0.2 s window) never add up to a crash
    loop; the same crashes within the window do."""
    crash = OmniRequest(prompt="x", params={"s0": {"fail": "crash"}})

    async def crash_and_wait(engine: AsyncOmniEngine) -> None:
        with pytest.raises(StageError, match="crashed"):
            await asyncio.wait_for(collect(engine, crash), 60)
        await asyncio.wait_for(engine.groups["s0"].wait_ready(), 60)

    async with AsyncOmniEngine(passthrough_pipeline(stages=1, placement="process")) as engine:
        group = engine.groups["s0"]
        group.restart_window_s = 0.2
        for _ in range(group.max_restarts + 2):
            await crash_and_wait(engine)
            await asyncio.sleep(0.3)
        [health] = await engine.health()
        assert health["healthy"] and health["restarts"] == group.max_restarts + 2

        group.restart_window_s = 600.0  # the last crash above now counts too
        for _ in range(group.max_restarts - 1):
            await crash_and_wait(engine)
        with pytest.raises(StageError, match="crashed"):
            await asyncio.wait_for(collect(engine, crash), 60)
        [health] = await engine.health()
        assert health["state"] == "failed" and "not being restarted" in health["error"], health
        with pytest.raises(StageError, match="none is being restarted"):
            await asyncio.wait_for(collect(engine, OmniRequest(prompt="after")), 60)


@pytest.mark.parametrize("placement", ["inline", "process"])
async def test_a_stage_that_fails_to_load_says_why(placement):
    """The engine's start error carries the runtime's own reason, not just "see the log"."""
    pipeline = passthrough_pipeline(stages=2, placement=placement)
    broken = attrs.evolve(pipeline.stages[1], options={**pipeline.stages[1].options, "load_error": "no weights at /nowhere"})
    pipeline = attrs.evolve(pipeline, stages=(pipeline.stages[0], broken))
    with pytest.raises(StageError, match="s1.*replica 0 failed to load: RuntimeError: no weights at /nowhere"):
        async with AsyncOmniEngine(pipeline):
            pass


async def test_messages_larger_than_a_pipe_reach_a_worker_process():
    async with AsyncOmniEngine(passthrough_pipeline(stages=2, placement="process")) as engine:
        blob = "x" * (3 << 20)
        deltas = await asyncio.wait_for(collect(engine, OmniRequest(prompt="big", params={"s1": {"echo": blob}})), 60)
        assert deltas[-1].data["s1_echo"] == blob


async def test_the_engine_loop_does_not_wait_for_a_busy_worker():
    async with AsyncOmniEngine(passthrough_pipeline(stages=1, placement="process", step_delay_s=1.0)) as engine:
        busy = asyncio.create_task(collect(engine, OmniRequest(prompt="first")))
        await asyncio.sleep(0.2)  # the worker is inside its 1 s step and does not read its pipe
        blob = "x" * (1 << 20)
        start = time.monotonic()
        streams = [await engine.submit(OmniRequest(prompt=f"p{i}", params={"s0": {"echo": blob}})) for i in range(8)]
        assert time.monotonic() - start < 0.6  # 8 MiB of messages queued without waiting for the step
        results = []
        for stream in streams:  # (one comprehension inside another cannot be async before Python 3.11)
            results.append([delta async for delta in stream])
        assert all(r[-1].data["s0_echo"] == blob for r in results)
        await busy


async def test_a_killed_worker_is_reported_and_messages_sent_to_it_are_dropped():
    async with AsyncOmniEngine(passthrough_pipeline(stages=2, placement="process")) as engine:
        group = engine.groups["s1"]
        dead = group.replicas[0]
        dead.process.kill()
        dead.process.join()
        for token in range(100):
            dead.send(Ping(token))  # nobody reads: dropped, never raised or blocking
        for _ in range(500):  # the loop notices the exit and restarts the replica
            if group.replicas[0] is not dead:
                break
            await asyncio.sleep(0.01)
        assert group.restarts == [1]
        deltas = await asyncio.wait_for(collect(engine, OmniRequest(prompt="after")), 60)
        assert deltas[-1].data["prompt"] == "after"


async def test_a_hung_worker_is_killed_its_requests_fail_and_it_serves_again(caplog):
    """The watchdog (`watchdog_s`): a worker process that answers nothing (stopped here with
    SIGSTOP) is killed within the timeout and a bit; its request fails saying so; it restarts."""
    pipeline = passthrough_pipeline(stages=2, placement="process")
    stages = (pipeline.stages[0], attrs.evolve(pipeline.stages[1], watchdog_s=1.0))
    async with AsyncOmniEngine(attrs.evolve(pipeline, stages=stages)) as engine:
        group = engine.groups["s1"]
        assert (await asyncio.wait_for(collect(engine, OmniRequest(prompt="before")), 60))[-1].data["prompt"] == "before"
        os.kill(group.replicas[0].process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(StageError, match=r"replica 0 answered no ping for 1 s \(hung"):
            await asyncio.wait_for(collect(engine, OmniRequest(prompt="stuck")), 30)
        assert time.monotonic() - stopped < 1.0 + 0.5 + 1.5  # timeout + probe interval + slack
        deltas = await asyncio.wait_for(collect(engine, OmniRequest(prompt="after")), 60)
        assert deltas[-1].data["prompt"] == "after" and group.restarts == [1]
        assert engine.groups["s0"].restarts == [0]  # a healthy stage is left alone
    assert any("stage s1 replica 0 answered no ping for 1 s" in r.getMessage() for r in caplog.records)


async def test_cpu_threads_nice_and_kernel_cache_set_each_worker_process():
    pipeline = passthrough_pipeline(stages=2, placement="process")
    stages = (attrs.evolve(pipeline.stages[0], cpu_threads=1, nice=5, kernel_cache=16), attrs.evolve(pipeline.stages[1], kernel_cache=None))
    async with AsyncOmniEngine(attrs.evolve(pipeline, stages=stages)) as engine:
        health = {h["stage"]: h for h in await engine.health()}
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert health["s0"]["cpu_threads"] == 1 and health["s0"]["nice"] == min(base + 5, 19)
    assert health["s0"]["kernel_cache"] == 16
    # unset: whatever the engine's environment and niceness were
    assert health["s1"]["cpu_threads"] == _env_threads() and health["s1"]["nice"] == base
    assert health["s1"]["kernel_cache"] == _env_int(KERNEL_CACHE_ENV)


async def test_each_worker_process_runs_on_its_allocator():
    """`allocator`: ``auto`` preloads tcmalloc (scripts/install.sh installs it), ``system`` keeps
    the C library's; /health says which, and the process's own memory map agrees."""
    pipeline = passthrough_pipeline(stages=2, placement="process")
    stages = (attrs.evolve(pipeline.stages[0], allocator="auto"), attrs.evolve(pipeline.stages[1], allocator="system"))
    async with AsyncOmniEngine(attrs.evolve(pipeline, stages=stages)) as engine:
        health = {h["stage"]: h for h in await engine.health()}
        maps = {stage: Path(f"/proc/{h['pid']}/maps").read_text() for stage, h in health.items()}
    assert health["s0"]["allocator"] == "tcmalloc" and "/libtcmalloc" in maps["s0"]
    assert health["s1"]["allocator"] == "system" and "/libtcmalloc" not in maps["s1"]
    assert "/libtcmalloc" not in Path("/proc/self/maps").read_text()  # the engine's own process: untouched


# Run in a fresh interpreter with oneDNN's verbose log of kernel creation: the stage's process set-up,
# then three convolution shapes twice. Prints how many creations were cache hits and misses.
_KERNEL_CACHE_PROBE = """
import sys
import attrs
from omni_core.runtime.replica import prepare_worker_process
from omni_core.testing.fakes import passthrough_pipeline

stage = passthrough_pipeline(stages=1, placement="process").stages[0]
prepare_worker_process(attrs.evolve(stage, kernel_cache=None if sys.argv[1] == "none" else int(sys.argv[1])))
import torch

conv = torch.nn.Conv2d(64, 64, 3)
with torch.no_grad():
    for side in [30, 31, 32] * 2:
        conv(torch.randn(1, 64, side, side))
"""


@pytest.mark.parametrize("capacity, hits", [("2", 0), ("none", 3)])
def test_kernel_cache_bounds_the_compiled_kernels_a_stage_process_keeps(capacity, hits):
    """`kernel_cache`: with room for 2 kernels, three shapes in turn recompile every time; with
    oneDNN's default (1024) the second round reuses all three."""
    env = {k: v for k, v in launch_env().items() if k != KERNEL_CACHE_ENV} | {"ONEDNN_VERBOSE": "profile_create"}
    out = subprocess.run([sys.executable, "-c", _KERNEL_CACHE_PROBE, capacity], capture_output=True, text=True, env=env, check=True)
    created = [line for line in out.stdout.splitlines() if ",convolution," in line]
    assert len(created) == 6, out.stdout[-2000:]
    assert sum("create:cache_hit" in line for line in created) == hits


# Run in a fresh interpreter: allocates and frees a 16 MiB block, prints whether it was mmapped
# and whether the heap kept it free afterwards (glibc's mallinfo2).
_MALLOC_PROBE = """
import ctypes, sys
from omni_core.runtime.replica import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
block = libc.malloc(16 << 20)
mmapped = libc.mallinfo2().hblkhd >= 16 << 20
libc.free(block)
print(applied, mmapped, libc.mallinfo2().fordblks >= 16 << 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("mode, expected", [("default", "False True False"), ("keep", "True False True")])
def test_keep_freed_memory_reuses_large_blocks(mode, expected):
    """glibc maps a 16 MiB block afresh and unmaps it on free; with the setting it comes from the
    heap and stays there for the next tensor."""
    out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE, mode], capture_output=True, text=True, check=True)
    assert out.stdout.split() == expected.split()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def _env_threads() -> int | None:
    return _env_int("OMP_NUM_THREADS")


async def test_shutdown_stops_worker_processes_cleanly():
    engine = AsyncOmniEngine(passthrough_pipeline(stages=2, placement="process"))
    await engine.start()
    await collect(engine, OmniRequest(prompt="x"))
    processes = [replica.process for group in engine.groups.values() for replica in group.replicas]
    await engine.shutdown()
    assert [p.exitcode for p in processes] == [0, 0]  # they obeyed Shutdown: not terminated


async def test_replicas_share_the_load():
    pipeline = passthrough_pipeline(stages=2, placement="process", replicas=2, step_delay_s=0.02)
    async with AsyncOmniEngine(pipeline) as engine:
        health = await engine.health()
        assert len({h["pid"] for h in health}) == 4
        requests = [OmniRequest(prompt=f"p{i}", params={"s0": {"repeat": 3}}) for i in range(8)]
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
        assert all(len(r) == 3 for r in results)
        for stage in ("s0", "s1"):
            used = [{d.data[f"{stage}_replica"] for d in r} for r in results]
            assert all(len(u) == 1 for u in used)  # a request sticks to its replica
            assert set().union(*used) == {0, 1}
        assert engine.groups["s0"].load == [0, 0]


async def test_input_processor_loads_while_the_stages_start():
    import threading

    pipeline = attrs.evolve(passthrough_pipeline(stages=2), input_processor="omni_core.testing.fakes:LoadingProcessor")
    async with AsyncOmniEngine(pipeline) as engine:
        # Loaded by start(), off the event loop's thread: the first request does not wait for it.
        assert engine._input_processor.loaded_in not in (None, threading.current_thread().name)
        deltas = await collect(engine, OmniRequest(prompt="a"))
        assert deltas[0].data["prompt"] == "a"
    engine = AsyncOmniEngine(attrs.evolve(pipeline, input_processor="omni_core.testing.fakes:FailingLoadProcessor"))
    with pytest.raises(OSError, match="tokenizer.json"):
        await engine.start()
    assert not engine._started and not engine._connectors  # stopped what it had started


async def test_input_processor_sets_params_of_later_stages():
    pipeline = attrs.evolve(passthrough_pipeline(stages=2), input_processor="omni_core.testing.fakes:ParamsForLaterStages")
    async with AsyncOmniEngine(pipeline) as engine:
        deltas = await collect(engine, OmniRequest(prompt="a"))
        assert [d.data["s1"] for d in deltas] == [0, 1]
        assert deltas[0].data["prompt"] == "a"


class CountingReplica(InlineReplica):
    """A plugin's placement: the engine builds it from the stage's placement reference alone."""

    placement = "counting"
    started: list[tuple[str, int]] = []

    def start(self) -> None:
        CountingReplica.started.append((self.context.stage.name, self.index))
        super().start()


async def test_a_registered_placement_runs_a_stage() -> None:
    pipeline = passthrough_pipeline(stages=2, placement="inline")
    counted = attrs.evolve(pipeline.stages[1], placement="counting", placement_ref=f"{__name__}:CountingReplica", replicas=2)
    pipeline = attrs.evolve(pipeline, stages=(pipeline.stages[0], counted))
    CountingReplica.started.clear()
    async with AsyncOmniEngine(pipeline) as engine:
        deltas = [d async for d in engine.generate(OmniRequest(prompt="hi"))]
        assert deltas[-1].data["prompt"] == "hi" and deltas[-1].data["s1"] == 0
        assert {entry["placement"] for entry in await engine.health()} == {"inline", "counting"}
    assert sorted(CountingReplica.started) == [("s1", 0), ("s1", 1)]


async def test_a_placement_that_is_not_a_replica_is_refused() -> None:
    pipeline = passthrough_pipeline(stages=1, placement="inline")
    wrong = attrs.evolve(pipeline.stages[0], placement="wrong", placement_ref="omni_core.parts:PartContext")
    with pytest.raises(Exception, match="PartContext"):
        async with AsyncOmniEngine(attrs.evolve(pipeline, stages=(wrong,))):
            pass


def test_a_worker_killed_by_a_signal_is_named_with_what_to_do() -> None:
    from omni_core.runtime.replica import exit_reason

    assert exit_reason(1) == "exited (code 1)"
    assert exit_reason(-9).startswith("killed by SIGKILL: ") and "out-of-memory" in exit_reason(-9)
    assert exit_reason(-4).startswith("killed by SIGILL: ") and "dtype float32" in exit_reason(-4)
    assert exit_reason(-15) == "killed by SIGTERM"


def test_the_request_helpers_plugins_share() -> None:
    from omni_core.engine.inputs import last_user_text
    from omni_core.engine.params import int_param, number_param
    from omni_core.errors import InvalidRequestError

    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}, {"type": "text", "text": "b"}]},
    ]
    assert last_user_text(messages, reads=("image_url",)) == "a b"
    with pytest.raises(InvalidRequestError, match=r"^messages\[2\]\.content\[1\]: this model takes no image in a chat message \(the part is of type 'image_url'; it reads text\)$"):
        last_user_text(messages)  # a family that reads no images never drops one silently
    assert last_user_text([{"role": "assistant", "content": "x"}]) is None
    assert int_param(3, "n") == 3 and number_param(2, "scale") == 2.0
    for bad, check in ((True, int_param), (2.5, int_param), ("1", number_param), (False, number_param)):
        with pytest.raises(InvalidRequestError) as info:
            check(bad, "steps")
        assert info.value.param == "steps"
