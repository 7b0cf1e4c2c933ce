"""The ``generation`` stage runtime: batched, chunked non-AR decode (codec frames -> waveform).

Each request's input frames are buffered as they stream in. A step takes every request with a full
chunk of new frames (or its remaining frames once its input is final), re-feeds up to
`left_context` already-decoded frames before each chunk so chunk boundaries are seamless (also
re-decoding the previous chunk's trimmed tail), runs one batched decode for all of them, cuts the
context's samples off and emits one chunk per request. A model part with `segment_size` is decoded
in the same segments as its reference. Without streaming, a request is decoded once its input is
final (one decode per segment) and sent as one chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from omni_core.config.modelref import resolve_dtype
from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.errors import InvalidRequestError, StageError
from omni_core.outputs import Chunk, StageInput
from omni_core.stages.base import Dtype, ProgressCallback, StageRuntime, device_option, dtype_option, refuse_unapplied_options
from omni_core.stages.generation_model import DecodeBatch, DecodeItem, GenerationModel

if TYPE_CHECKING:
    import torch



def _positive_or_none(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class GenerationOptions:
    """Deploy options of a ``generation`` stage.

    Each field's ``metadata["doc"]`` documents it (`omni stages generation`, ``docs/stage-options.md``).
    """

    max_batch_size: int = attrs.field(
        default=16, validator=_positive_or_none, metadata={"doc": "Most requests decoded in one step."}
    )
    max_batch_frames: int | None = attrs.field(
        default=None,
        validator=_positive_or_none,
        metadata={
            "doc": "Most frames in one step's padded batch (rows x the longest row, left context included): what the "
            "decode computes and holds in memory; requests past it wait for the next step (one always runs). "
            "Convolutional decoders on CPU slow down per frame once a batch outgrows the caches, and the process "
            "keeps its largest batch's memory; ``None``: no limit."
        },
    )
    first_chunk_size: int | None = attrs.field(
        default=None,
        validator=_positive_or_none,
        metadata={
            "doc": "Frames of a request's first chunk when streaming (``None``: `chunk_size`); a small first chunk "
            "starts the audio early, later chunks keep the decode efficient."
        },
    )
    max_chunk_size: int | None = attrs.field(
        default=None,
        validator=_positive_or_none,
        metadata={
            "doc": "A request that has more new frames than its chunk (the stage fell behind) decodes up to this "
            "many at once: fewer, larger chunks, so less left context is re-decoded and a busy stage catches up "
            "(``None``: never more than `chunk_size`)."
        },
    )
    dtype: Dtype = dtype_option()
    device: str | None = device_option()
    chunk_size: int | None = attrs.field(
        default=None,
        validator=_positive_or_none,
        metadata={
            "doc": "Frames per chunk, over the model part's value (e.g. smaller chunks for a lower time to first "
            "audio); ``None`` keeps the model part's."
        },
    )
    left_context: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.ge(0)),
        metadata={
            "doc": "Already-decoded frames re-fed before each chunk so chunk boundaries are seamless, over the model "
            "part's value; ``None`` keeps the model part's."
        },
    )
    compile: bool = attrs.field(
        default=False,
        metadata={
            "doc": "Let the model part compile its hot element-wise code with ``torch.compile`` (the model part says "
            "what, and falls back to eager where compiling fails); it reads the option from its stage's options. "
            "A model part that does not list ``compile`` in its ``load_options`` refuses it at resolve."
        },
    )


@attrs.define
class _Request:
    """A request's frame buffer. Frame indexes are absolute in the request's frame stream."""

    params: dict[str, Any]
    frames: torch.Tensor | None = None  # frames [base, received), consolidated
    pieces: list[torch.Tensor] = attrs.field(factory=list)  # received, not yet consolidated
    base: int = 0
    received: int = 0
    emitted: int = 0  # frames decoded and sent
    input_final: bool = False
    chunks: int = 0  # chunks sent (the next chunk's index)
    held: list[torch.Tensor] = attrs.field(factory=list)  # decoded, not sent (non-streaming)

    def consolidate(self) -> torch.Tensor:
        if self.pieces:
            import torch

            parts = ([self.frames] if self.frames is not None else []) + self.pieces
            self.frames = parts[0] if len(parts) == 1 else torch.cat(parts)
            self.pieces = []
        assert self.frames is not None
        return self.frames

    def keep_from(self, index: int) -> None:
        """Drop buffered frames before `index` (no longer needed as left context)."""
        if self.frames is not None and index > self.base:
            # clone: a view would keep the whole old buffer alive
            self.frames = self.frames[index - self.base :].clone()
            self.base = index


class GenerationStageRuntime(StageRuntime):
    """Runs a `GenerationModel` over the chunks of many requests at once (kind ``generation``)."""

    Options = GenerationOptions
    options: GenerationOptions

    @classmethod
    def check_resolved(cls, stage: ResolvedStage, options: GenerationOptions, model_path: str) -> None:
        refuse_unapplied_options(stage, ["compile"] if options.compile else [])

    def __init__(self, pipeline: ResolvedPipeline, stage: ResolvedStage, replica: int = 0) -> None:
        super().__init__(pipeline, stage, replica)
        self.model: GenerationModel | None = None
        self.chunk_size = 0
        self.left_context = 0
        # insertion order is the service order; served requests move to the end (fairness when
        # more requests are ready than fit in a batch)
        self._requests: dict[str, _Request] = {}

    # -- lifecycle -------------------------------------------------------------------------------

    def load(self, progress: ProgressCallback | None = None) -> None:
        model = self.build_model_part(GenerationModel)
        if progress is not None:
            progress(f"loading {self.stage.name}", 0.0)
        model.load(self.device(), resolve_dtype(self.options.dtype, self.pipeline.model_path))
        self.chunk_size = self.options.chunk_size or model.chunk_size
        self.left_context = model.left_context if self.options.left_context is None else self.options.left_context
        if self.chunk_size < 1 or self.left_context < 0 or model.samples_per_frame < 1:
            raise StageError(
                self.stage.name,
                f"invalid model part {self.stage.model!r}: chunk_size={self.chunk_size}, "
                f"left_context={self.left_context}, samples_per_frame={model.samples_per_frame}",
            )
        self.model = model
        if progress is not None:
            progress(f"loaded {self.stage.name}", 1.0)

    def close(self) -> None:
        self._requests.clear()
        if self.model is not None:
            self.model.close()
            self.model = None

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, stage_input: StageInput) -> None:
        model = self._loaded()
        if request_id in self._requests:
            raise InvalidRequestError(f"request {request_id!r} is already running in stage {self.stage.name!r}")
        if model.input_key not in stage_input.data:
            raise InvalidRequestError(
                f"stage {self.stage.name!r} needs input {model.input_key!r} (frames [T, ...]); "
                f"got keys {sorted(stage_input.data)}",
                param=model.input_key,
            )
        model.check_params(stage_input.params)
        request = _Request(params=dict(stage_input.params))
        self._append(request, stage_input)  # validates before the request is registered
        self._requests[request_id] = request

    def extend_request(self, request_id: str, stage_input: StageInput) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return  # aborted or failed already: late upstream chunks are expected, not an error
        if request.input_final:
            raise InvalidRequestError(f"request {request_id!r} got input after its final input")
        try:
            self._append(request, stage_input)
        except InvalidRequestError:
            del self._requests[request_id]
            raise

    def _append(self, request: _Request, stage_input: StageInput) -> None:
        model = self._loaded()
        value = stage_input.data.get(model.input_key)
        # An empty list is a chunk with nothing new (an AR stage's step that wrote no token): no
        # frames, and no dtype to check against the others (`torch.as_tensor([])` is float32).
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0):
            frames = model.to_frames(value)
            reference = request.frames if request.frames is not None else next(iter(request.pieces), None)
            if frames.shape[0] and reference is not None and (frames.shape[1:] != reference.shape[1:] or frames.dtype != reference.dtype):
                raise InvalidRequestError(
                    f"{model.input_key!r} frames changed shape or dtype mid-request: "
                    f"{tuple(reference.shape[1:])}/{reference.dtype} then {tuple(frames.shape[1:])}/{frames.dtype}",
                    param=model.input_key,
                )
            if frames.shape[0]:
                request.pieces.append(frames)
                request.received += int(frames.shape[0])
        request.input_final = stage_input.final

    def abort_request(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None and self.model is not None:
            self.model.forget(request_id)

    # -- stepping --------------------------------------------------------------------------------

    def _ready(self, request: _Request) -> bool:
        # A request waiting for more input is idle: reporting it as work would make the worker spin.
        if not self.streaming:
            return request.input_final
        return request.input_final or request.received - request.emitted >= self._chunk_size(request)

    def _chunk_size(self, request: _Request) -> int:
        if request.emitted == 0 and self.options.first_chunk_size is not None:
            return self.options.first_chunk_size
        return self.chunk_size

    def health_stats(self) -> dict[str, Any]:
        model = self.model
        return {"requests": len(self._requests), "model_held_requests": model.held_requests() if model is not None else 0}

    def has_unfinished(self) -> bool:
        return any(self._ready(request) for request in self._requests.values())

    def step(self) -> list[Chunk]:
        model = self._loaded()
        chosen = [rid for rid, request in self._requests.items() if self._ready(request)]
        # First chunks first (the time to first audio), then in service order.
        chosen.sort(key=lambda rid: self._requests[rid].emitted > 0)
        chosen = chosen[: self.options.max_batch_size]
        budget = self.options.max_batch_frames
        chunks: list[Chunk] = []
        items: list[DecodeItem] = []
        longest = 0  # frames of the batch's longest row: every row is padded to it
        for request_id in chosen:
            request = self._requests[request_id]
            item = self._next_item(request_id, request)
            if item is not None and items and budget is not None:
                if (len(items) + 1) * max(longest, int(item.frames.shape[0])) > budget:
                    break  # it keeps its place in the service order for the next step
            del self._requests[request_id]
            self._requests[request_id] = request  # to the back of the service order
            if item is None:  # final input with nothing left to decode: close the stream
                chunks.append(self._emit(request_id, request, self._empty_output(), 0, final=True))
                continue
            try:
                model.check(item)
            except InvalidRequestError as exc:
                chunks.append(self._fail(request_id, request, exc))
                continue
            items.append(item)
            longest = max(longest, int(item.frames.shape[0]))
        if items:
            outputs = model.decode(DecodeBatch(items))
            if len(outputs) != len(items):
                raise StageError(self.stage.name, f"decode returned {len(outputs)} outputs for {len(items)} items")
            spf = model.samples_per_frame
            for item, output in zip(items, outputs):
                expected = item.frames.shape[0] * spf - model.trimmed_samples
                if output.shape[0] < expected:
                    raise StageError(
                        self.stage.name,
                        f"decode returned {output.shape[0]} samples for {item.frames.shape[0]} frames; "
                        f"expected {expected} (samples_per_frame={spf})",
                    )
                samples = output[self._dropped_samples(item) : expected]
                request = self._requests[item.request_id]
                if not self.streaming and not item.final:
                    # One chunk per request without streaming: keep the segments decoded so far.
                    request.held.append(samples)
                    self._advance(request, item.new_frames)
                    continue
                if request.held:
                    import torch

                    samples = torch.cat([*request.held, samples])
                    request.held = []
                chunks.append(self._emit(item.request_id, request, samples, item.new_frames, item.final))
        return chunks

    def _segment_start(self, index: int) -> int:
        """First frame of the segment holding frame `index` (0 when the model has no segments)."""
        size = self._loaded().segment_size
        return (index // size) * size if size else 0

    def _context_start(self, start: int) -> int:
        """First frame to decode for new frames from `start`: `left_context` frames back, but never
        before the segment's own context; exactly that context at a segment's first frame."""
        model = self._loaded()
        segment = self._segment_start(start)
        floor = max(0, segment - model.segment_context) if segment else 0
        if start == segment:
            return floor
        return max(floor, start - self.left_context)

    def _dropped_samples(self, item: DecodeItem) -> int:
        """Samples of the context to cut from an item's output.

        Inside a segment the previous chunk stopped `trimmed_samples` short of its last frame; the
        context re-decodes them, so this chunk starts where that one stopped (seamless). At a
        segment's first frame the reference loses them, and so does this.
        """
        model = self._loaded()
        spf = model.samples_per_frame
        first_new = item.start + item.context
        if first_new == self._segment_start(first_new):
            return item.context * spf
        return max(0, item.context * spf - model.trimmed_samples)

    def _next_item(self, request_id: str, request: _Request) -> DecodeItem | None:
        new = request.received - request.emitted
        if new == 0:
            return None
        count = new
        if self.streaming:
            count = min(new, max(self._chunk_size(request), self.options.max_chunk_size or 0))
        size = self._loaded().segment_size
        if size:  # a chunk never crosses a segment boundary
            count = min(count, self._segment_start(request.emitted) + size - request.emitted)
        frames = request.consolidate()
        start = self._context_start(request.emitted)
        return DecodeItem(
            request_id=request_id,
            frames=frames[start - request.base : request.emitted + count - request.base],
            context=request.emitted - start,
            start=start,
            final=request.input_final and request.emitted + count == request.received,
            params=request.params,
        )

    def _emit(self, request_id: str, request: _Request, samples: Any, frames: int, final: bool) -> Chunk:
        model = self._loaded()
        chunk = Chunk(
            request_id=request_id,
            stage=self.stage.name,
            index=request.chunks,
            data={model.output_key: self._to_output(samples), **model.extra_outputs},
            final=final,
        )
        request.chunks += 1
        if final:
            del self._requests[request_id]
            # The model's per-request state (e.g. a streaming decoder's caches) ends with it too: a
            # final chunk with no new frames never reaches the model's decode, which would drop it.
            self._loaded().forget(request_id)
        else:
            self._advance(request, frames)
        return chunk

    def _advance(self, request: _Request, frames: int) -> None:
        request.emitted += frames
        request.keep_from(self._still_needed(request.emitted))

    def _still_needed(self, emitted: int) -> int:
        """First buffered frame a later chunk may re-read: the next chunk's left context, or the
        next segment's own context where that reaches further back (a short `left_context`)."""
        model = self._loaded()
        first = self._context_start(emitted)
        if model.segment_size:
            next_segment = self._segment_start(emitted) + model.segment_size
            first = min(first, max(0, next_segment - model.segment_context))
        return first

    def _fail(self, request_id: str, request: _Request, error: InvalidRequestError) -> Chunk:
        del self._requests[request_id]
        self._loaded().forget(request_id)
        return Chunk.failed(request_id, self.stage.name, request.chunks, error)

    @staticmethod
    def _to_output(samples: torch.Tensor) -> Any:
        """CPU float32 numpy samples: what audio consumers (soundfile, encoders, JSON) take."""
        import torch

        samples = samples.detach()
        if samples.is_floating_point() and samples.dtype != torch.float32:
            samples = samples.to(torch.float32)
        return samples.to("cpu").contiguous().numpy()

    @staticmethod
    def _empty_output() -> torch.Tensor:
        import torch

        return torch.zeros(0, dtype=torch.float32)

    def _loaded(self) -> GenerationModel:
        if self.model is None:
            raise StageError(self.stage.name, "the stage runtime is not loaded: call load() first")
        return self.model
