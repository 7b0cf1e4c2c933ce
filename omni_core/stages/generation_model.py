"""The model part of a ``generation`` stage: a non-AR decoder (e.g. codec frames -> waveform).

A model family supplies one as the stage's ``model`` reference: a factory
``(PartContext) -> GenerationModel`` (`omni_core.parts`; the subclass itself is the usual factory,
its context in ``self.context``). The `GenerationStageRuntime` buffers each request's input frames, cuts them into
chunks with left context and hands the model one `DecodeBatch` per step; the model runs *one*
forward for the whole batch (`DecodeBatch.padded` gives the padded tensor and the lengths).

torch is imported lazily: this module is imported by the core at discovery time.
"""

from __future__ import annotations

import abc
import types
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import attrs

from omni_core.errors import InvalidRequestError
from omni_core.parts import Part

if TYPE_CHECKING:
    import torch


@attrs.define
class DecodeItem:
    """One request's piece of a decode batch.

    `frames` holds ``context + new`` frames along dim 0 (on the CPU): the first `context` frames
    were already decoded and are re-fed so the new frames see their full receptive field; their
    output is dropped by the runtime. `start` is the index of ``frames[0]`` in the request's frame
    stream; `final` marks the request's last piece.
    """

    request_id: str
    frames: torch.Tensor
    context: int
    start: int
    final: bool
    params: dict[str, Any] = attrs.field(factory=dict)

    @property
    def new_frames(self) -> int:
        return int(self.frames.shape[0]) - self.context


@attrs.define
class DecodeBatch:
    """The items decoded together in one step (at most the stage's ``max_batch_size``)."""

    items: list[DecodeItem]

    def __len__(self) -> int:
        return len(self.items)

    def lengths(self) -> list[int]:
        return [int(item.frames.shape[0]) for item in self.items]

    def padded(self, pad_value: float = 0, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad every item to the longest: ``([B, T_max, ...], lengths [B])``.

        Right padding is harmless for causal models (a frame never sees later ones); a model with
        look-ahead must mask with `lengths` instead.
        """
        import torch

        lengths = torch.tensor(self.lengths(), dtype=torch.long)
        first = self.items[0].frames
        out = first.new_full((len(self.items), int(lengths.max()), *first.shape[1:]), pad_value)
        for row, item in enumerate(self.items):  # copies only; the forward runs once on `out`
            out[row, : item.frames.shape[0]] = item.frames
        if device is not None:
            out = out.to(device, non_blocking=True)
            lengths = lengths.to(device)
        return out, lengths


class GenerationModel(Part, abc.ABC):
    """What a ``generation`` stage's model part declares and does.

    Declarations (class or instance attributes):

    - `input_key`: the key of `StageInput.data` holding frames (a tensor ``[T, ...]``, or what
      `to_frames` turns into one, appended along dim 0 as streamed input arrives). An empty list
      adds nothing, so ``input_key = "token_ids"`` takes an ``ar`` stage's chunks as they come
      (each step's new token ids are frames ``[T]``): that edge needs no adapter.
    - `chunk_size`: frames decoded per request per step in streaming mode.
    - `left_context`: frames of already-decoded input re-fed before each chunk; chunked output is
      seamless when it is at least the model's receptive field minus one.
    - `samples_per_frame`: output samples (dim 0 of the output) per input frame.
    - `output_key`: the key of the emitted chunks' data holding the samples.
    - `extra_outputs`: constant keys added to every emitted chunk (e.g. ``{"sample_rate": 24000}``).
    - `trimmed_samples`: samples a decode yields fewer than ``frames * samples_per_frame`` (e.g.
      causal transposed convolutions trimming their tail). Only the request's end (and each
      segment's end) loses them: a chunk after another re-decodes the previous chunk's tail from its
      left context (which must then cover them), so chunked output equals one whole decode.
    - `segment_size` / `segment_context`: for a model whose reference decodes in fixed segments
      (e.g. transformers' ``chunked_decode(300, 25)``): every `segment_size` frames the decode
      restarts with exactly `segment_context` frames of context and the previous segment's trimmed
      tail is lost, as in the reference. Chunks never cross a segment boundary and their context
      never reaches before the segment's own, so any chunking equals the reference. None: one
      segment (the whole request).
    - `request_params`: the names of the per-request parameters the model takes (`check_params`
      sees them); the engine refuses any other before the request starts, even where the stage
      runs after others. ``None``: not declared, `check_params` alone checks them.
    - `media_params`: those of `request_params` that carry a medium as a URL (as
      `DiffusionModel.media_params`).
    - `load_options`: the stage options the model part applies (``compile``: it reads its stage's
      ``compile`` option and compiles something); `resolve()` refuses ``compile: true`` for one that
      does not list it (it would be ignored).
    """

    input_key: str = "codes"
    request_params: frozenset[str] | None = None
    media_params: frozenset[str] = frozenset()
    output_key: str = "audio"
    chunk_size: int = 25
    left_context: int = 0
    samples_per_frame: int = 1
    extra_outputs: Mapping[str, Any] = types.MappingProxyType({})
    trimmed_samples: int = 0
    segment_size: int | None = None
    segment_context: int = 0
    load_options: frozenset[str] = frozenset()

    @abc.abstractmethod
    def load(self, device: str, dtype: str) -> None:
        """Load weights onto `device` in `dtype` (``"float32"``, ``"bfloat16"``, ``"float16"``)."""

    @abc.abstractmethod
    def decode(self, batch: DecodeBatch) -> Sequence[torch.Tensor] | torch.Tensor:
        """Decode every item with one forward.

        Return, per item in order, at least ``len(item.frames) * samples_per_frame - trimmed_samples`` samples along
        dim 0 (a padded ``[B, T_max * samples_per_frame, ...]`` tensor is fine: extra samples are
        cut). The runtime drops the first ``item.context * samples_per_frame`` samples.
        """

    def to_frames(self, value: Any) -> torch.Tensor:
        """Turn one piece of `data[input_key]` into a CPU frame tensor ``[T, ...]``.

        Raise `InvalidRequestError` for input this model cannot take; the default accepts anything
        `torch.as_tensor` does with at least one dimension.
        """
        import torch

        try:
            frames = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidRequestError(
                f"{self.input_key!r} must be a tensor of frames [T, ...]: {exc}", param=self.input_key
            ) from None
        if frames.ndim == 0:
            raise InvalidRequestError(
                f"{self.input_key!r} must have a frame dimension (shape [T, ...]), got a scalar",
                param=self.input_key,
            )
        return frames.detach().to("cpu")

    def check_params(self, params: dict[str, Any]) -> None:
        """Called when a request starts: raise `InvalidRequestError` to reject its parameters."""

    def check(self, item: DecodeItem) -> None:
        """Called for every item before the batched forward: raise `InvalidRequestError` to fail
        only this request (its chunk becomes an error chunk)."""

    def forget(self, request_id: str) -> None:
        """The request ended early (aborted or failed): drop any per-request state the model keeps
        between chunks (a request that ends normally has its last item marked `final`)."""

    def held_requests(self) -> int:
        """How many requests' state the model keeps between chunks now (shown on ``/health``: it
        must fall back to the stage's active requests, else state leaks)."""
        return 0

    def close(self) -> None:
        """Release weights and device memory."""
