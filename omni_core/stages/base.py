"""The stage runtime contract: what an `ar`, `generation` or `diffusion` runtime implements.

A stage runtime owns one stage replica's compute. A worker (a thread for ``inline`` placement, a
spawned process for ``process``) drives it: it feeds requests in, and calls `step()` while
`has_unfinished()`; each `step()` advances *every* active request by one batched step (an engine
step for AR, a chunk decode for generation, a denoising step for diffusion) and returns the chunks
it produced. Nothing here is per-request Python work inside a step.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Literal, TypeVar

import attrs

from omni_core.config.modelref import CHECKPOINT_DTYPE
from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.errors import ConfigError, StageError
from omni_core.outputs import Chunk, StageInput
from omni_core.parts import Part, PartContext, build_part

ModelPart = TypeVar("ModelPart", bound=Part)

Dtype = Literal["float32", "bfloat16", "float16", "checkpoint"]
"""A model part's weight dtype; ``checkpoint``: the dtype the checkpoint stores them in."""

ProgressCallback = Callable[[str, float], None]
"""``progress(description, fraction)`` reported while loading (0.0 .. 1.0)."""


def dtype_option(default: str = "float32") -> Any:
    """The ``dtype`` option of a runtime whose model part loads in torch (`Dtype`)."""
    return attrs.field(
        default=default,
        validator=attrs.validators.in_(("float32", "bfloat16", "float16", CHECKPOINT_DTYPE)),
        metadata={"doc": "The weights' dtype (``checkpoint``: the dtype the checkpoint stores them in)."},
    )


def device_option() -> Any:
    """The ``device`` option that `StageRuntime.device` reads."""
    return attrs.field(
        default=None,
        metadata={"doc": "The torch device (``None``: the stage's first device, else CUDA when available, else CPU)."},
    )


def refuse_unapplied_options(stage: ResolvedStage, used: list[str]) -> None:
    """Refuse (`ConfigError` naming ``stages.<stage>.options.<option>``) each of the stage's options in
    `used` that its model part does not list in its ``load_options`` (`ARModel`, `GenerationModel`,
    `DiffusionModel`): an option it would silently ignore. The model part is imported only when some
    option is used."""
    if not used:
        return
    from omni_core.refs import load_ref

    declared = getattr(load_ref(stage.model), "load_options", frozenset())
    for name in used:
        if name not in declared:
            raise ConfigError(
                f"stage {stage.name!r}: its model part ({stage.model}) does not implement {name} (it applies "
                f"{', '.join(sorted(declared)) or 'none of these options'}): the option would be ignored",
                key=f"stages.{stage.name}.options.{name}",
            )


@attrs.frozen
class NoOptions:
    """Options class of a runtime that has none."""


class StageRuntime(abc.ABC):
    """One replica of one stage: batched compute over many requests.

    Subclasses set `Options` to an attrs class, one ``attrs.field(..., metadata={"doc": ...})`` per
    option (``omni stages`` prints them); `resolve()` validates the deploy options against it and
    the runtime receives an instance as `self.options`. `streaming` tells whether to emit
    chunks as they are ready (true) or one final chunk per request (false): both must give the same
    result.
    """

    Options: ClassVar[type] = NoOptions
    max_inline_replicas: ClassVar[int | None] = None
    """How many replicas of this kind may run inline in the engine's process (None: any number);
    `resolve()` refuses more, for runtimes whose engine keeps process-wide state."""

    @classmethod
    def check_resolved(cls, stage: ResolvedStage, options: Any, model_path: str) -> None:
        """Refuse, with a `omni_core.errors.ConfigError` naming the key, a resolved stage (its
        `options` an `Options` instance; `model_path` the local checkpoint) that this runtime
        cannot run: `resolve()` calls this after resolving every stage, before anything starts."""

    def __init__(self, pipeline: ResolvedPipeline, stage: ResolvedStage, replica: int = 0) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.replica = replica
        from omni_core.config import structure_config

        self.options = structure_config(stage.options, self.Options)
        self.streaming = pipeline.streaming
        # What the stage named by ``share_model_with`` offers (its runtime's `shared_model`): set by
        # the worker before `load`, None when this stage loads its own model.
        self.shared: Any = None

    @abc.abstractmethod
    def load(self, progress: ProgressCallback | None = None) -> None:
        """Load weights and start the stage's engine; heavy imports happen here, not at import."""

    @abc.abstractmethod
    def add_request(self, request_id: str, stage_input: StageInput) -> None:
        """Start a request. Raise `InvalidRequestError` for input this stage cannot take."""

    def extend_request(self, request_id: str, stage_input: StageInput) -> None:
        """Add streamed input to a running request (more upstream chunks)."""
        raise NotImplementedError(f"stage kind {self.stage.kind!r} does not take streamed input")

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its resources; unknown ids are ignored."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """Whether `step()` has work to do."""

    @abc.abstractmethod
    def step(self) -> list[Chunk]:
        """Advance every active request by one batched step; return the chunks produced.

        A chunk with `error` set fails only its request. An exception fails the stage: every
        request in it gets an error and the runtime is reloaded, or, when the exception has
        ``restart_worker = True``, the worker process ends and the stage group restarts it.
        """

    def close(self) -> None:
        """Release the engine and its memory."""

    def shared_model(self) -> Any:
        """What this replica's loaded model offers a stage that shares it (``share_model_with``),
        e.g. the modules holding its weights; the sharing stage's model part receives it (the
        diffusion runtime's `LoadSpec.shared_model`). None: this kind shares nothing."""
        return None

    def health_stats(self) -> dict[str, Any]:
        """What this replica adds to its ``/health`` entry (plain JSON values)."""
        return {}

    def device(self) -> str:
        """The torch device of this replica: the `device` option, the stage's first device, else
        CUDA when there is one. (A process replica sees its stage's GPUs renumbered from 0.)"""
        explicit = getattr(self.options, "device", None)
        if explicit is not None:
            return str(explicit)
        if self.stage.devices:
            return self.stage.devices[0]
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def quantization(self) -> dict[str, Any] | None:
        """What the registered resolver of the stage's ``quantization`` option returned for this
        kind (resolved by `resolve()`), or None when the stage is not quantized."""
        name = getattr(self.options, "quantization", None)
        if name is not None and self.stage.quantization is None:
            raise StageError(self.stage.name, f"quantization {name!r} is not resolved: resolve the pipeline with resolve()")
        return self.stage.quantization

    def build_model_part(self, base: type[ModelPart]) -> ModelPart:
        """Build this replica's model part: the stage's `model` reference called with this
        replica's `PartContext` (see `omni_core.parts`), checked to be a `base`."""
        return build_part(
            self.stage.model,
            PartContext(self.pipeline, self.stage, replica=self.replica),
            base,
            f"stage {self.stage.name!r} model part",
        )
