"""What a model family declares: its stages and how they connect (`PipelineConfig`)."""

from __future__ import annotations

from typing import Any

import attrs

MODALITIES = ("text", "audio", "image", "video", "action")


@attrs.frozen
class EdgeSpec:
    """An input of a stage: chunks of `source` turned into stage input by `adapter`.

    `adapter` is a lazy ``"module:attr"`` reference to a factory ``(pipeline, edge) -> EdgeAdapter``
    (see `omni_core.stages.base.EdgeAdapter`); ``None`` passes each chunk's data through unchanged.
    """

    source: str
    adapter: str | None = None


@attrs.frozen
class StageSpec:
    """One stage of a pipeline as the model family declares it.

    - `kind`: the stage runtime kind (``ar``, ``generation``, ``diffusion`` or a plugin's kind).
    - `model`: lazy ``"module:attr"`` reference to the stage's model part; what it must provide is
      defined by the runtime kind.
    - `inputs`: upstream edges; a stage with none takes the request's processed input.
    - `output`: the user-facing modality this stage produces (``None``: internal stage).
    - `extra_outputs`: more modalities the same stage can produce (e.g. a diffusion stage that
      makes images, videos and their audio); a request wanting any of them runs the stage.
    - `output_adapter`: lazy reference to ``(chunk) -> dict`` mapping a chunk to the `OutputDelta`
      keys (see `omni_core.outputs.OutputDelta`); ``None`` passes the chunk data through.
    - `final`: completing this stage completes the request (a sink of the stage graph).
    - `params`: default per-request parameters (a request overrides them key by key).
    - `options`: runtime option defaults the family needs (the deploy config may override them).
    """

    name: str
    kind: str
    model: str
    inputs: tuple[EdgeSpec, ...] = ()
    output: str | None = None
    extra_outputs: tuple[str, ...] = ()
    output_adapter: str | None = None
    final: bool = False
    params: dict[str, Any] = attrs.field(factory=dict)
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class PipelineConfig:
    """A model family's pipeline for one checkpoint.

    `input_processor` is a lazy reference to a factory ``(pipeline) -> processor``; the processor is
    called as ``processor(request) -> dict[str, StageInput]`` (in a worker thread) giving the input of
    each entry stage (``None``: the core's text-prompt processor); its optional ``load()`` runs (in a
    worker thread) while the engine starts the stages, for what it would otherwise load on the first
    request (a tokenizer, processor settings). `default_deploy` is a
    package resource ``"package:path/to/deploy.yaml"``. `default_modalities` are produced when a
    request names none.
    """

    family: str
    stages: tuple[StageSpec, ...]
    input_processor: str | None = None
    default_deploy: str | None = None
    default_modalities: tuple[str, ...] = ("text",)
