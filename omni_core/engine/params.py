"""Per-stage parameter merging: pipeline defaults kept unless the request overrides that key."""

from __future__ import annotations

from typing import Any, Mapping

from omni_core.errors import InvalidRequestError

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


def int_param(value: Any, name: str) -> int:
    """`value` as a request's integer parameter `name` (a bool is not one): else a 400 naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    return value


def number_param(value: Any, name: str) -> float:
    """`value` as a request's number parameter `name` (int or float, not bool): else a 400 naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    return float(value)
