"""Paths per request: a pipeline's tasks choose which of its stages a request runs.

The pipeline here has HunyuanImage-3.0's shape on pass-through stages: ``ar`` (text) feeds ``dit``
(image); ``t2t`` runs ``ar`` alone, ``t2i`` runs ``dit`` alone (fed by the request, not by ``ar``)
and ``think_t2i`` runs both. The real family runs them in plugins/omni-hunyuan/tests.
"""

from __future__ import annotations

import attrs
import pytest
import pytest_asyncio

from omni_core.config.pipeline import EdgeSpec, PipelineConfig, StageSpec, TaskSpec
from omni_core.config.tasks import check_tasks
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.errors import ConfigError, InvalidRequestError
from omni_core.testing.fakes import passthrough_pipeline

pytestmark = pytest.mark.timeout(120)
on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the engine fixture's loop

TASKS = (
    TaskSpec("t2t", ("ar",), ("text",)),
    TaskSpec("t2i", ("dit",), ("image",)),
    TaskSpec("think_t2i", ("ar", "dit"), ("text", "image")),
)


def two_stage_pipeline(placement: str):
    pipeline = passthrough_pipeline(stages=2, placement=placement)
    s0, s1 = pipeline.stages
    ar = attrs.evolve(s0, name="ar", output="text", final=False)
    dit = attrs.evolve(s1, name="dit", output="image", inputs=(attrs.evolve(s1.inputs[0], source="ar", target="dit"),))
    return attrs.evolve(pipeline, stages=(ar, dit), tasks=TASKS, default_modalities=("image",))


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["inline", "process"])
async def engine(request):
    async with AsyncOmniEngine(two_stage_pipeline(request.param)) as eng:
        yield eng


async def run(engine: AsyncOmniEngine, request: OmniRequest) -> dict[str, list[dict]]:
    """Each stage's user-facing chunks' data."""
    out: dict[str, list[dict]] = {}
    async for delta in engine.generate(request):
        out.setdefault(delta.stage, []).append(delta.data)
    return out


@on_module_loop
@pytest.mark.parametrize(
    ("modalities", "task", "ran"),
    [
        (("text",), "t2t", {"ar"}),
        (("image",), "t2i", {"dit"}),
        (None, "t2i", {"dit"}),  # the default modalities pick the task
        (("text", "image"), "think_t2i", {"ar", "dit"}),
        (("image", "text"), "think_t2i", {"ar", "dit"}),
    ],
)
async def test_the_modalities_pick_the_task_and_only_its_stages_run(engine, modalities, task, ran):
    request = OmniRequest(prompt="a cat", modalities=modalities)
    out = await run(engine, request)
    assert request.task == task
    assert set(out) == ran
    health = {h["stage"]: h for h in await engine.health()}
    assert all(h["active_requests"] == 0 for h in health.values())
    dit = out.get("dit", [{}])[-1]
    if "dit" in ran:
        # t2i: the request's input reached dit directly; think_t2i: dit got ar's output.
        assert dit["prompt"] == "a cat"
        assert ("ar" in dit) == ("ar" in ran)


@on_module_loop
async def test_a_task_named_by_the_request_or_a_stage_parameter(engine):
    out = await run(engine, OmniRequest(prompt="p", task="think_t2i"))
    assert set(out) == {"ar", "dit"}
    request = OmniRequest(prompt="p", params={"dit": {"task": "t2t", "echo": 1}})
    out = await run(engine, request)
    assert set(out) == {"ar"} and request.task == "t2t"
    assert request.params == {"dit": {"echo": 1}}  # not passed on as a stage parameter
    # Named, with modalities the task produces: only those come out.
    out = await run(engine, OmniRequest(prompt="p", task="think_t2i", modalities=("image",)))
    assert set(out) == {"dit"} and "ar" in out["dit"][-1]


@on_module_loop
@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        ({"task": "edit"}, "unknown task 'edit'; this model's tasks are: t2t, t2i, think_t2i"),
        ({"task": "t2t", "modalities": ("image",)}, "task 't2t' does not produce image; it produces text"),
        ({"task": "t2t", "params": {"dit": {"task": "t2i"}}}, "more than one task: t2i, t2t"),
        ({"modalities": ("audio",)}, "no task of this model produces audio together"),
    ],
)
async def test_a_task_the_pipeline_cannot_run_is_a_client_error(engine, request_kwargs, message):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(")):
        await run(engine, OmniRequest(prompt="p", **request_kwargs))
    assert engine.num_active_requests == 0


@on_module_loop
async def test_a_task_for_a_pipeline_without_tasks_is_a_client_error():
    async with AsyncOmniEngine(passthrough_pipeline(stages=2)) as engine:
        with pytest.raises(InvalidRequestError, match="has no tasks to choose from"):
            await run(engine, OmniRequest(prompt="p", task="t2i"))
        assert set(await run(engine, OmniRequest(prompt="p", params={"s1": {"task": "x"}}))) == {"s1"}  # a plain parameter there


def _config(tasks, default=("image",)):
    return PipelineConfig(
        family="f",
        stages=(
            StageSpec("ar", "ar", "m:A", output="text"),
            StageSpec("dit", "diffusion", "m:D", inputs=(EdgeSpec("ar"),), output="image", final=True),
        ),
        tasks=tasks,
        default_modalities=default,
    )


@pytest.mark.parametrize(
    ("tasks", "default", "message"),
    [
        ((TaskSpec("a", ("ar",), ("text",)), TaskSpec("a", ("dit",), ("image",))), ("text",), "duplicate task name 'a'"),
        ((TaskSpec("a", ("vae",), ("image",)),), ("image",), "names stage 'vae'"),
        ((TaskSpec("a", ("ar",), ("image",)),), ("image",), "produces image, which none of its stages"),
        ((TaskSpec("a", (), ("text",)),), ("text",), "runs no stage"),
        ((TaskSpec("a", ("ar",), ("text",)),), ("image",), "no task of family 'f' produces the default modalities image"),
    ],
)
def test_resolve_refuses_malformed_tasks(tasks, default, message):
    with pytest.raises(ConfigError, match=message):
        check_tasks(_config(tasks, default))
    check_tasks(_config(TASKS))
