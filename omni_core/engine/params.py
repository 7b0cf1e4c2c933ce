"""Per-stage parameter merging: pipeline defaults kept unless the request overrides that key."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Mapping

from omni_core.errors import InvalidRequestError

if TYPE_CHECKING:
    from omni_core.config.resolved import ResolvedPipeline

logger = logging.getLogger(__name__)

# Keys whose values are sets of stop conditions: a request adds to the pipeline's, never drops them
# (a user's own stop list must not silently remove a family's end-of-turn tokens).
UNION_KEYS = frozenset({"stop", "stop_token_ids"})


def merge_params(defaults: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge one stage's request parameters over its defaults."""
    merged = dict(defaults)
    for key, value in (overrides or {}).items():
        if key in UNION_KEYS and key in merged and value is not None:
            base = merged[key] if isinstance(merged[key], list) else [merged[key]]
            extra = value if isinstance(value, list) else [value]
            merged[key] = base + [v for v in extra if v not in base]
        else:
            merged[key] = value
    return merged


def check_stage_names(params: Mapping[str, Any], stages: list[str]) -> None:
    """Reject per-stage parameters naming a stage the pipeline does not have."""
    for name, value in params.items():
        if name not in stages:
            raise InvalidRequestError(f"unknown stage {name!r} in per-stage parameters; this pipeline's stages are {', '.join(stages)}", param=f"stage_params.{name}")
        if not isinstance(value, Mapping):
            raise InvalidRequestError(f"parameters of stage {name!r} must be an object, got {type(value).__name__}", param=f"stage_params.{name}")


def _declared(pipeline: ResolvedPipeline, attribute: str) -> dict[str, Any]:
    """Stage name -> `attribute` of its model part, for each stage whose model part can be imported
    here and declares it (not None). Imports the model parts' modules: call it off the event loop.
    A model part that cannot be imported here is left to check its parameters in its stage."""
    from omni_core.refs import load_ref

    declared: dict[str, Any] = {}
    for stage in pipeline.stages:
        try:
            value = getattr(load_ref(stage.model), attribute, None)
        except Exception as exc:  # its stage reports it, with the stage's context
            logger.debug("stage %r: cannot read the model part's %s: %s", stage.name, attribute, exc)
            continue
        if value is not None:
            declared[stage.name] = value
    return declared


def stage_param_names(pipeline: ResolvedPipeline) -> dict[str, frozenset[str]]:
    """Stage name -> the per-request parameter names the stage takes, for each stage whose model
    part declares them (``request_params``: `ARModel`, `GenerationModel`, `DiffusionModel`).

    An ``ar`` stage takes vLLM's sampling parameters (minus those its runtime sets) besides its
    model's own; a ``diffusion`` stage its runtime's ``cache`` besides its model's. Call it off the
    event loop (`_declared`).
    """
    from omni_core.engine.sampling_params_list import VLLM_SAMPLING_KEYS
    from omni_core.stages.vllm_sampling import RESERVED_SAMPLING_KEYS

    kinds = {stage.name: stage.kind for stage in pipeline.stages}
    names: dict[str, frozenset[str]] = {}
    for name, declared in _declared(pipeline, "request_params").items():
        if kinds[name] == "ar":
            declared = (VLLM_SAMPLING_KEYS - RESERVED_SAMPLING_KEYS) | declared
        elif kinds[name] == "diffusion":
            declared = declared | {"cache"}
        names[name] = frozenset(declared)
    return names


def stage_media_params(pipeline: ResolvedPipeline) -> dict[str, frozenset[str]]:
    """Stage name -> its per-request parameters that carry a medium as a URL (``media_params`` of
    its model part), for the stages that have any. Call it off the event loop (`_declared`)."""
    return {name: frozenset(media) for name, media in _declared(pipeline, "media_params").items() if media}


def check_stage_params(params: Mapping[str, Mapping[str, Any]], names: Mapping[str, frozenset[str]], kinds: Mapping[str, str]) -> None:
    """Reject a per-stage parameter that its stage does not take (`stage_param_names`), naming it:
    before the request starts, so that a streamed response never starts for a request that a
    later stage would refuse."""
    for stage, values in params.items():
        known = names.get(stage)
        if known is None:
            continue
        unknown = sorted(set(values) - known)
        if unknown:
            takes = ", ".join(sorted(known)) or "no parameters"
            raise InvalidRequestError(
                f"unknown parameter {unknown[0]!r} for stage {stage!r} (kind {kinds.get(stage, '?')}); it takes: {takes}",
                param=f"stage_params.{stage}.{unknown[0]}",
            )


def int_param(value: Any, name: str) -> int:
    """`value` as a request's integer parameter `name` (a bool is not one): else a 400 naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    return value


def number_param(value: Any, name: str) -> float:
    """`value` as a request's number parameter `name` (a finite int or float, not a bool): else a
    400 naming it."""
    try:
        number = math.nan if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)
    except OverflowError:  # (an int beyond a float's range)
        number = math.inf
    if not math.isfinite(number):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
    return number
