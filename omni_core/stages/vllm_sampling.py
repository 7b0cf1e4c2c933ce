"""Request parameters -> vLLM's `SamplingParams` for an ``ar`` stage, on vLLM's public API.

Unknown keys, the keys the runtime sets itself (`RESERVED_SAMPLING_KEYS`) and values vLLM rejects
are an `InvalidRequestError` naming the parameter. vLLM is imported on first use.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import TYPE_CHECKING, Any

from omni_core.errors import InvalidRequestError

if TYPE_CHECKING:
    from vllm import SamplingParams

# SamplingParams arguments that the runtime owns (output kind, per-request bookkeeping) or that
# would break the one-stream-per-request contract of a stage (n > 1 fans out into several).
RESERVED_SAMPLING_KEYS = frozenset({"output_kind", "extra_args", "skip_clone", "n", "detokenize"})


@functools.cache
def sampling_param_names() -> frozenset[str]:
    """Request parameter names accepted by `build_sampling_params` (vLLM's, minus reserved ones)."""
    from vllm import SamplingParams

    names = set(inspect.signature(SamplingParams.from_optional).parameters) - {"self", "cls"}
    return frozenset(names - RESERVED_SAMPLING_KEYS)


def build_sampling_params(params: dict[str, Any], *, delta: bool) -> SamplingParams:
    """Turn merged per-request parameters into `SamplingParams`.

    `delta` picks streamed output (new tokens each step) or one final output. Unknown keys and
    values vLLM rejects raise `InvalidRequestError` naming the parameter.
    """
    from vllm import SamplingParams
    from vllm.exceptions import VLLMError
    from vllm.sampling_params import RequestOutputKind

    allowed = sampling_param_names()
    for key in params:
        if key in RESERVED_SAMPLING_KEYS:
            raise InvalidRequestError(
                f"sampling parameter {key!r} is set by the 'ar' stage itself (one output stream per "
                "request; streaming from the deploy config): remove it from the request",
                param=key,
            )
        if key not in allowed:
            raise InvalidRequestError(
                f"unknown sampling parameter {key!r} for an 'ar' stage; use one of {sorted(allowed)}",
                param=key,
            )
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    try:
        params = _check_types(params)
        # A fresh object per request: vLLM need not deep-copy it on add_request (with a talker's
        # allowed_token_ids list that copy costs most of adding the request).
        return SamplingParams.from_optional(**params, output_kind=kind, skip_clone=True)
    except (ValueError, TypeError, VLLMError) as exc:
        raise InvalidRequestError(f"invalid sampling parameters: {exc}", param=_param_of(exc)) from exc


@functools.cache
def _sampling_types() -> type:
    """A msgspec struct with `SamplingParams`' fields, each optional, and none of its checks: the
    types alone (`_check_types`; the values are `SamplingParams`' to check, once)."""
    import typing

    import msgspec
    from vllm import SamplingParams

    fields = [(f.name, typing.Optional[f.type], None) for f in msgspec.structs.fields(SamplingParams)]
    return msgspec.defstruct("SamplingParamTypes", fields)


def _check_types(params: dict[str, Any]) -> dict[str, Any]:
    """Each value against the type `SamplingParams` declares for it (``max_tokens: 2.5`` or
    ``temperature: "hot"`` would otherwise be truncated or fail deep inside vLLM). `SamplingParams`
    is a msgspec struct, so msgspec checks them (JSON's string keys of ``logit_bias`` read as token
    ids, an int where a float is declared). Returns `params` with ``structured_outputs`` as vLLM's
    `StructuredOutputsParams` where a request gave it as an object (JSON has no other way)."""
    import msgspec

    try:
        checked = msgspec.convert(params, _sampling_types(), str_keys=True)
    except msgspec.ValidationError as exc:
        where = re.search(r"`\$\.(\w+)", str(exc))
        raise InvalidRequestError(f"invalid sampling parameters: {exc}", param=where.group(1) if where else None) from exc
    if isinstance(params.get("structured_outputs"), dict):
        params = {**params, "structured_outputs": checked.structured_outputs}
    return params


def _param_of(exc: BaseException) -> str | None:
    param = getattr(exc, "parameter", None)
    return param if isinstance(param, str) else None
