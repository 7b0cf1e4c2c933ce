"""Paths per request: checking a pipeline's declared tasks, and choosing one for a request.

A task (`omni_core.config.pipeline.TaskSpec`) names the stages one kind of request runs. The
orchestrator runs only those; an edge from a stage outside the task is not followed, so its target
becomes an entry stage of the task and takes the input processor's input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omni_core.config.pipeline import MODALITIES, PipelineConfig, StageSpec, TaskSpec
from omni_core.errors import ConfigError, InvalidRequestError

# The stage parameter that may name the task (any stage's; the request's own field wins if equal).
TASK_PARAM = "task"


def check_tasks(pipeline: PipelineConfig) -> None:
    """Reject tasks naming unknown stages or modalities their stages do not produce, duplicates,
    and default modalities that pick no task."""
    stages = {spec.name: spec for spec in pipeline.stages}
    seen: set[str] = set()
    for task in pipeline.tasks:
        key = f"tasks.{task.name}"
        if task.name in seen:
            raise ConfigError(f"duplicate task name {task.name!r} in family {pipeline.family!r}", key=key)
        seen.add(task.name)
        if not task.stages:
            raise ConfigError(f"task {task.name!r} runs no stage", key=key)
        for name in task.stages:
            if name not in stages:
                raise ConfigError(f"task {task.name!r} names stage {name!r}, which the pipeline does not have", key=key)
        produced = task_outputs(task, stages)
        for modality in task.modalities:
            if modality not in MODALITIES:
                raise ConfigError(f"{modality!r} is not one of: {', '.join(MODALITIES)}", key=f"{key}.modalities")
            if modality not in produced:
                raise ConfigError(
                    f"task {task.name!r} says it produces {modality}, which none of its stages ({', '.join(task.stages)}) does",
                    key=f"{key}.modalities",
                )
        if not task.modalities:
            raise ConfigError(f"task {task.name!r} produces no modality", key=f"{key}.modalities")
    if pipeline.tasks and _by_modalities(pipeline.tasks, stages, pipeline.default_modalities) is None:
        raise ConfigError(
            f"no task of family {pipeline.family!r} produces the default modalities {', '.join(pipeline.default_modalities)}",
            key="default_modalities",
        )


def task_outputs(task: TaskSpec, stages: Mapping[str, Any]) -> tuple[str, ...]:
    """Every modality the stages of `task` produce (`stages`: name -> `StageSpec`/`ResolvedStage`)."""
    return tuple(dict.fromkeys(m for name in task.stages for m in _outputs(stages[name])))


def choose_task(
    tasks: Sequence[TaskSpec],
    stages: Mapping[str, Any],
    name: str | None,
    modalities: tuple[str, ...] | None,
    default_modalities: tuple[str, ...],
) -> tuple[TaskSpec, tuple[str, ...]]:
    """The task a request runs and the modalities it gets.

    By `name` if given (a 400 for one the pipeline lacks, or for modalities the task cannot
    produce); else by the modalities wanted (the request's, else the pipeline's defaults): the
    task declaring exactly those, else the first whose stages produce them all.
    """
    if name is not None:
        for task in tasks:
            if task.name == name:
                break
        else:
            known = ", ".join(t.name for t in tasks) or "none"
            raise InvalidRequestError(f"unknown task {name!r}; this model's tasks are: {known}", param=TASK_PARAM)
        if modalities:
            produced = task_outputs(task, stages)
            missing = [m for m in modalities if m not in produced]
            if missing:
                raise InvalidRequestError(
                    f"task {task.name!r} does not produce {', '.join(missing)}; it produces {', '.join(produced)}",
                    param="modalities",
                )
            return task, modalities
        return task, task.modalities
    wanted = tuple(modalities or default_modalities)
    task = _by_modalities(tasks, stages, wanted)
    if task is None:
        offered = "; ".join(f"{t.name}: {', '.join(t.modalities)}" for t in tasks)
        raise InvalidRequestError(
            f"no task of this model produces {', '.join(wanted)} together; its tasks are {offered}", param="modalities"
        )
    return task, wanted


def entry_stages(stages: Sequence[Any], active: Sequence[str] | None = None) -> tuple[str, ...]:
    """Of the `active` stages (default: all), those no other active stage feeds: they take the
    input processor's input. `stages`: the pipeline's `StageSpec`s or `ResolvedStage`s, in order."""
    running = {s.name for s in stages} if active is None else set(active)
    return tuple(
        s.name for s in stages if s.name in running and not any(edge.source in running for edge in s.inputs)
    )


def request_entries(pipeline: Any, task: str | None) -> tuple[str, ...]:
    """The entry stages of a request of `task` (``None``: a pipeline without tasks) in `pipeline`
    (a `ResolvedPipeline`): what an input processor gives input to."""
    active = None if task is None else next(t.stages for t in pipeline.tasks if t.name == task)
    return entry_stages(pipeline.stages, active)


def task_name(request_task: str | None, params: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The task a request names: its own field, or a ``task`` stage parameter (any stage's; taken
    out of the stage's parameters, which it is not one of). Two different names are a 400."""
    named = {stage: p[TASK_PARAM] for stage, p in params.items() if isinstance(p, Mapping) and TASK_PARAM in p}
    values = {v for v in named.values()} | ({request_task} if request_task is not None else set())
    if len(values) > 1:
        raise InvalidRequestError(f"the request names more than one task: {', '.join(sorted(map(str, values)))}", param=TASK_PARAM)
    for value in values:
        if not isinstance(value, str):
            raise InvalidRequestError(f"task must be a string, got {value!r}", param=TASK_PARAM)
        return value
    return None


def _by_modalities(tasks: Sequence[TaskSpec], stages: Mapping[str, Any], wanted: Sequence[str]) -> TaskSpec | None:
    for task in tasks:
        if set(task.modalities) == set(wanted):
            return task
    for task in tasks:
        if set(wanted) <= set(task_outputs(task, stages)):
            return task
    return None


def _outputs(stage: StageSpec | Any) -> tuple[str, ...]:
    return ((stage.output,) if stage.output else ()) + tuple(stage.extra_outputs)
