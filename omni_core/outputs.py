"""Data that flows through a pipeline: stage chunks, stage inputs and user-facing outputs.

A stage emits `Chunk`s for a request; a full (non-streamed) payload is simply one final chunk, so
streaming and non-streaming share one code path. Payload `data` is a dict of tensors (torch or
numpy), plain scalars, strings and lists; connectors move it between processes.
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.errors import InvalidRequestError

Payload = dict[str, Any]


@attrs.define
class Chunk:
    """A piece of one request's output from one stage.

    `index` counts the chunks of (request, stage) from 0; `final` marks the last one. A chunk with
    `error` set fails the request (only that request): with `invalid` the request's own input was
    at fault (the caller gets `InvalidRequestError` naming `param`, HTTP 400), else the stage
    (`StageError`, HTTP 500). `Chunk.failed` builds one from the exception.
    """

    request_id: str
    stage: str
    index: int
    data: Payload = attrs.field(factory=dict)
    final: bool = False
    error: str | None = None
    invalid: bool = False
    param: str | None = None

    @classmethod
    def failed(cls, request_id: str, stage: str, index: int, error: BaseException | str) -> Chunk:
        """The final error chunk of a request that failed alone; an `InvalidRequestError` stays a
        client error."""
        invalid = isinstance(error, InvalidRequestError)
        param = error.param if isinstance(error, InvalidRequestError) else None
        return cls(request_id, stage, index, final=True, error=str(error), invalid=invalid, param=param)


@attrs.define
class StageInput:
    """Input for one request of a stage.

    The first `StageInput` of a request starts it (`params` are the merged per-stage parameters);
    when `final` is false more input follows (a streamed upstream), delivered through
    `StageRuntime.extend_request`.
    """

    data: Payload = attrs.field(factory=dict)
    final: bool = True
    params: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class OutputDelta:
    """What one stage contributes to a user-facing output, per chunk.

    The core understands these keys of `data` (plugins' output adapters produce them):
    `text` (str delta), `token_ids` (list[int] delta), `logprobs` (per token, when asked for),
    `prompt_token_ids` (list[int], once: what the request's usage counts; a text stage's win over
    another's), `audio` (float32 samples: 1-D, or ``[N, 2]`` stereo),
    `sample_rate` (int), `image` (HxWxC uint8 array or a list of them), `video` (TxHxWxC uint8), `fps`
    (float), `actions` (array), `progress` (a diffusion stage's step: `step_progress`). Other keys are
    passed through.
    """

    request_id: str
    stage: str
    modality: str
    index: int
    data: Payload = attrs.field(factory=dict)
    final: bool = False

    @property
    def step_progress(self) -> tuple[int, int] | None:
        """``(step, total)`` of a diffusion stage's progress chunk (`omni_core.stages.diffusion`), else None."""
        progress = self.data.get("progress") if isinstance(self.data, dict) else None
        if not isinstance(progress, dict):
            return None
        step, total = progress.get("step"), progress.get("total")
        return (step, total) if isinstance(step, int) and isinstance(total, int) and total > 0 else None


@attrs.define
class RequestOutput:
    """One streamed output of a request as `AsyncOmni` yields it, or the accumulated result.

    `deltas` holds the new pieces since the previous yield; `finished` is true on the last one.
    """

    request_id: str
    deltas: list[OutputDelta] = attrs.field(factory=list)
    finished: bool = False
    error: str | None = None
