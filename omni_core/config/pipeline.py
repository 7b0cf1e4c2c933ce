"""What a model family declares: its stages and how they connect (`PipelineConfig`)."""

from __future__ import annotations

from typing import Any

import attrs

MODALITIES = ("text", "audio", "image", "video", "action")


@attrs.frozen
class EdgeSpec:
    """An input of a stage: chunks of `source` turned into stage input by `adapter`.

    `adapter` is a lazy ``"module:attr"`` reference to a factory ``(PartContext) -> EdgeAdapter``
    (usually an `omni_core.parts.EdgeAdapter` subclass); ``None`` passes each chunk's data through
    unchanged.
    """

    source: str
    adapter: str | None = None


@attrs.frozen
class StageSpec:
    """One stage of a pipeline as the model family declares it.

    - `kind`: the stage runtime kind (``ar``, ``generation``, ``diffusion`` or a plugin's kind).
    - `model`: lazy ``"module:attr"`` reference to the factory ``(PartContext) -> model part``
      (usually the model part's class): an `ARModel`, `GenerationModel` or `DiffusionModel`
      subclass for the ``ar``, ``generation`` and ``diffusion`` kinds.
    - `inputs`: upstream edges; a stage with none takes the request's processed input.
    - `output`: the user-facing modality this stage produces (``None``: internal stage).
    - `extra_outputs`: more modalities the same stage can produce (e.g. a diffusion stage that
      makes images, videos and their audio); a request wanting any of them runs the stage.
    - `output_adapter`: lazy reference to a factory ``(PartContext) -> OutputAdapter`` mapping a
      chunk to the `OutputDelta` keys (see `omni_core.parts.OutputAdapter`); ``None`` passes the
      chunk data through.
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
class TaskSpec:
    """A named path through a pipeline: the stages one kind of request runs.

    - `stages`: the stages it runs (a sub-graph). Edges between them are followed; an edge from a
      stage outside the task is not, so a stage whose sources all lie outside is an entry stage of
      the task and takes the input processor's input (as a stage without inputs always does).
    - `modalities`: what a request of this task gets when it names none; a request naming
      modalities gets the task whose `modalities` are exactly those, else the first (in declaration
      order) whose stages produce them all.

    E.g. HunyuanImage-3.0: ``t2t`` = [ar] (text), ``t2i`` = [dit] (image), ``think_t2i`` = [ar, dit]
    (text and image). A stage outside the chosen task costs the request nothing.
    """

    name: str
    stages: tuple[str, ...]
    modalities: tuple[str, ...]
    description: str = ""


@attrs.frozen
class PipelineConfig:
    """A model family's pipeline for one checkpoint.

    `input_processor` is a lazy reference to a factory ``(PartContext) -> InputProcessor`` (see
    `omni_core.parts.InputProcessor`: ``process(request)`` gives the input of each entry stage,
    ``load()`` runs while the engine starts the stages); ``None``: the core's text-prompt
    processor. Every part reference of a pipeline follows the one rule of `omni_core.parts`.
    `default_deploy` is a package resource ``"package:path/to/deploy.yaml"``.
    `default_modalities` are produced when a request names none (and pick the default task).
    `tasks`: the named paths a request may take (``()``: a request runs the stages producing the
    modalities it wants and their ancestors); a request picks one by name (`OmniRequest.task`) or
    by the modalities it wants (see `TaskSpec`).
    """

    family: str
    stages: tuple[StageSpec, ...]
    input_processor: str | None = None
    default_deploy: str | None = None
    default_modalities: tuple[str, ...] = ("text",)
    tasks: tuple[TaskSpec, ...] = ()
