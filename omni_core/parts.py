"""The parts a model family supplies, and the one way every part is built.

A family's `PipelineConfig` names its parts by lazy ``"module:attr"`` reference:

- each stage's model part (`StageSpec.model`): an `ARModel`, `GenerationModel` or `DiffusionModel`
  (or the base class a plugin's own stage kind declares);
- each edge's adapter (`EdgeSpec.adapter`): an `EdgeAdapter`;
- a stage's output adapter (`StageSpec.output_adapter`): an `OutputAdapter`;
- the pipeline's input processor (`PipelineConfig.input_processor`): an `InputProcessor`.

One rule for all of them: the reference names a *factory* called with one argument, a
`PartContext`, that returns an instance of the part's base class. The class itself is the usual
factory: every base class takes the context in its constructor and keeps it as `self.context`, so
a subclass needs no ``__init__`` of its own (one that has one calls ``super().__init__(context)``).
A part is built where it is used (in the stage's worker, once per replica; the input processor in
the engine), never shared between replicas.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import attrs

from omni_core.config.resolved import ResolvedEdge, ResolvedPipeline, ResolvedStage
from omni_core.errors import PluginError
from omni_core.outputs import Chunk, StageInput
from omni_core.refs import load_ref

if TYPE_CHECKING:
    from omni_core.engine.request import OmniRequest

__all__ = ["EdgeAdapter", "InputProcessor", "OutputAdapter", "Part", "PartContext", "PassThroughAdapter", "build_part"]

P = TypeVar("P", bound="Part")


@attrs.frozen
class PartContext:
    """What every part's factory receives.

    - `pipeline`: the resolved pipeline (``model_path``, every stage, deploy settings).
    - `stage`: the stage the part serves (``None`` for the input processor); for an edge adapter,
      the receiving stage. Its `options` are the validated runtime options, `params` the default
      per-request parameters.
    - `edge`: the edge an edge adapter serves (``None`` for other parts).
    - `replica`: the index of the stage replica building the part.
    """

    pipeline: ResolvedPipeline
    stage: ResolvedStage | None = None
    edge: ResolvedEdge | None = None
    replica: int = 0

    @property
    def model_path(self) -> str:
        """The checkpoint directory the pipeline serves."""
        return self.pipeline.model_path


class Part:
    """Base of every part: keeps the `PartContext` it was built with as `self.context`."""

    def __init__(self, context: PartContext) -> None:
        self.context = context


class EdgeAdapter(Part, abc.ABC):
    """Turns upstream chunks into input of the downstream stage, per request.

    `on_chunk` gets `state`, a dict private to (request, edge) kept by the worker of the receiving
    stage and dropped when the request ends, and one upstream chunk; it returns the downstream
    stage's input, or ``None`` to wait for more chunks.
    """

    @abc.abstractmethod
    def on_chunk(self, state: dict[str, Any], chunk: Chunk) -> StageInput | None:
        """The downstream input this chunk makes (``None``: nothing yet)."""


class PassThroughAdapter(EdgeAdapter):
    """The default edge adapter: each chunk's data becomes stage input as it is."""

    def on_chunk(self, state: dict[str, Any], chunk: Chunk) -> StageInput | None:
        return StageInput(data=chunk.data, final=chunk.final)


class OutputAdapter(Part, abc.ABC):
    """Maps a final-output stage's chunks to `omni_core.outputs.OutputDelta` keys (``text``,
    ``token_ids``, ``audio``, ``sample_rate``, ``image``, ``video``, ``fps``, ``actions``...)."""

    @abc.abstractmethod
    def to_output(self, chunk: Chunk) -> dict[str, Any]:
        """The user-facing payload of one chunk."""


class InternalKeysOutput(OutputAdapter):
    """A stage's chunks as the user sees them: as they are, less the keys of `internal` (what the
    stage sends on to a later stage only: hidden states, keys/values). Subclass and set `internal`."""

    internal: ClassVar[frozenset[str]] = frozenset()

    def to_output(self, chunk: Chunk) -> dict[str, Any]:
        return {key: value for key, value in chunk.data.items() if key not in self.internal}


class InputProcessor(Part, abc.ABC):
    """Turns a request into the input of each entry stage.

    `process` runs in a worker thread, once per request; it may also give parameters to later
    stages (a `StageInput` with only `params`). Raise `omni_core.errors.InvalidRequestError`, naming
    the parameter, for input the family cannot take. `load` runs (in a worker thread) while the
    engine starts the stages: load there what the first request would otherwise wait for (a
    tokenizer, processor settings).
    """

    def load(self) -> None:
        """Load what `process` needs (default: nothing)."""

    @abc.abstractmethod
    def process(self, request: OmniRequest) -> dict[str, StageInput]:
        """Stage name -> that stage's input for `request`."""


def build_part(ref: str, context: PartContext, base: type[P], what: str) -> P:
    """Build the part `ref` names: ``factory(context)``, checked to be a `base`.

    `what` says which part it is in errors (e.g. ``"stage 'talker' model"``). An instance in place
    of a factory is refused: replicas built from one would share it, and each needs its own.
    """
    factory = load_ref(ref)
    if isinstance(factory, Part):
        raise PluginError(
            f"{what} {ref!r} is an instance of {type(factory).__name__}; refer to a factory "
            f"(context) -> {base.__name__} instead: usually the class itself"
        )
    if not callable(factory):
        raise PluginError(f"{what} {ref!r} is a {type(factory).__name__}, not a factory (context) -> {base.__name__}")
    part = factory(context)
    if not isinstance(part, base):
        raise PluginError(
            f"{what} {ref!r} returned a {type(part).__name__}; it must return a "
            f"{base.__module__}.{base.__qualname__} (subclass it)"
        )
    return part
