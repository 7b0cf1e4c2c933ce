"""The Qwen3-Omni ``code2wav`` stage's model part: codec frames ``[T, Q]`` -> 24 kHz waveform.

Wraps transformers' ``Qwen3OmniMoeCode2Wav`` loaded from the checkpoint's ``code2wav.*`` tensors.
The reference (``generate``) decodes with ``chunked_decode(300, 25)``: segments of 300 frames, each
restarting with 25 frames of context and losing its causal convolutions' trimmed tail. This model
part declares exactly that (`segment_size` / `segment_context`), and streams in small chunks
(`chunk_size` 25 frames) inside each segment. Each request keeps its decoder's state between
chunks (the pre-transformer's sliding-window keys and values, the convolutions' last inputs:
`omni_qwen3.code2wav_stream`), so every frame is decoded once and the streamed waveform equals the
reference's within float tolerance whatever the chunking.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from omni_core.errors import InvalidRequestError
from omni_core.parts import PartContext
from omni_core.stages.generation_model import DecodeBatch, DecodeItem, GenerationModel

if TYPE_CHECKING:
    import torch


logger = logging.getLogger(__name__)

SAMPLE_RATE = 24000


class Code2WavModel(GenerationModel):
    """Batched code2wav decode: one forward over the right-padded chunks of many requests.

    Right padding is safe: the model is causal (its attention mask and convolutions look back
    only), so each item's samples do not depend on the padding after it.
    """

    load_options = frozenset({"compile"})  # (its activations under torch.compile: `_compiled_stack`)

    input_key = "codes"
    output_key = "audio"
    request_params: frozenset[str] = frozenset()  # a decoder: no per-request parameters
    chunk_size = 25
    # The reference's chunked_decode(300, 25) (omni_qwen3.reference).
    segment_size = 300
    segment_context = 25
    # A continued item needs no context frames (its request's state stands for them): one frame
    # gives the runtime's layout room for the samples the previous chunk held back (`trimmed_samples`).
    left_context = 1

    def __init__(self, context: PartContext) -> None:
        from omni_qwen3.talker import read_config

        super().__init__(context)
        self.model_path = context.model_path
        config = read_config(self.model_path)["code2wav_config"]
        self.num_quantizers = int(config["num_quantizers"])
        self.codebook_size = int(config["codebook_size"])
        total = 1
        for factor in list(config["upsample_rates"]) + list(config["upsampling_ratios"]):
            total *= int(factor)
        self.samples_per_frame = total
        self.extra_outputs = {"sample_rate": SAMPLE_RATE}
        self.model: Any = None
        self.compile = bool(context.stage.options.get("compile")) if context.stage is not None else False
        self.pre: Any = None  # PreTransformer over the loaded model
        self.stack: Any = None  # ConvStack over the loaded model
        self._streams: dict[str, Any] = {}  # request id -> StreamState between chunks
        self.device = "cpu"
        self.trimmed_samples = 0

    def load(self, device: str, dtype: str) -> None:
        import torch
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        from omni_qwen3.talker import read_config, read_tensors

        config = Qwen3OmniMoeCode2WavConfig(**read_config(self.model_path)["code2wav_config"])
        config._attn_implementation = "sdpa"
        model = Qwen3OmniMoeCode2Wav(config)
        names = [f"code2wav.{name}" for name in model.state_dict()]
        tensors = read_tensors(self.model_path, names)
        model.load_state_dict({name[len("code2wav.") :]: tensor for name, tensor in tensors.items()})
        self.model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
        self.device = device
        from omni_qwen3.code2wav_stream import ConvStack, PreTransformer

        self.pre = PreTransformer(self.model)
        self.stack = ConvStack(self.model)
        with torch.inference_mode():
            probe = self.model(torch.zeros((1, self.num_quantizers, 1), dtype=torch.long, device=device))
        # Causal transposed convolutions drop the same number of trailing samples per decode.
        self.trimmed_samples = self.samples_per_frame - int(probe.shape[-1])
        if self.compile:
            self.stack = self._compiled_stack()

    def _compiled_stack(self) -> Any:
        """A `ConvStack` with compiled activations, compiled now (one frame of one row, and more:
        a size of 1 is compiled apart); the eager one where compiling fails (e.g. no C++ compiler)."""
        import torch

        from omni_qwen3.code2wav_stream import ConvStack

        stack = ConvStack(self.model, compiled=True)
        logger.info("compiling code2wav's activations (torch.compile; cached on disk for later starts)")
        hidden = torch.zeros((2, self.model.config.hidden_size, 2), dtype=next(self.model.parameters()).dtype, device=self.device)
        try:
            stack.run(hidden[:1, :, :1], [1], [None])
            stack.run(hidden, [2, 2], [None, None])
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager path gives the same samples
            logger.warning("code2wav runs eagerly: compiling its activations failed: %s", exc)
            return self.stack
        return stack

    def to_frames(self, value: Any) -> torch.Tensor:
        import torch

        frames = super().to_frames(value)
        if frames.ndim != 2 or frames.shape[1] != self.num_quantizers:
            raise InvalidRequestError(
                f"'codes' must be frames [T, {self.num_quantizers}], got shape {tuple(frames.shape)}", param="codes"
            )
        if frames.is_floating_point():
            raise InvalidRequestError("'codes' must be integer codec ids", param="codes")
        if frames.numel() and (int(frames.min()) < 0 or int(frames.max()) >= self.codebook_size):
            raise InvalidRequestError(f"'codes' must be in [0, {self.codebook_size})", param="codes")
        return frames.to(dtype=torch.long)

    def check(self, item: DecodeItem) -> None:
        if self.model is None:
            raise RuntimeError("code2wav is not loaded")

    def decode(self, batch: DecodeBatch) -> Sequence[torch.Tensor]:
        """Each item's new frames through the pre-transformer and the convolution stack, from its
        request's saved state (`PreTransformer`, `ConvStack`): nothing is decoded twice.

        An item that does not continue its request's stream (the first one, or the first of a new
        reference segment, which the reference decodes afresh with its context frames) runs all its
        frames from the start. The output keeps the runtime's layout (context samples first): for
        a continued item the context part is zeros, since the runtime drops it.
        """
        import torch

        from omni_qwen3.code2wav_stream import StreamState

        model = self.model
        states = [self._continued(item) for item in batch.items]
        inputs = [item.frames[item.context :] if state is not None else item.frames for item, state in zip(batch.items, states)]
        sizes = [int(frames.shape[0]) for frames in inputs]
        codes = inputs[0].new_zeros((len(inputs), max(sizes), self.num_quantizers))
        for row, frames in enumerate(inputs):
            codes[row, : frames.shape[0]] = frames
        with torch.inference_mode():
            codes = codes.to(self.device).transpose(1, 2)
            hidden = model.code_embedding(codes + model.code_offset).mean(1)
            hidden, attention = self.pre.run(hidden, sizes, [state.attention if state else None for state in states])
            waves, conv_states = self.stack.run(hidden.permute(0, 2, 1), sizes, states)
        outputs = []
        for item, state, wave, tensors, cache in zip(batch.items, states, waves, conv_states, attention):
            if item.final:
                self._streams.pop(item.request_id, None)
            else:
                self._streams[item.request_id] = StreamState(item.start + int(item.frames.shape[0]), tensors, cache)
            if state is not None:  # only the new frames' samples: zeros stand for the dropped context
                wave = torch.cat([wave.new_zeros(item.context * self.samples_per_frame - self.trimmed_samples), wave])
            outputs.append(wave.float())
        return outputs

    def _continued(self, item: DecodeItem) -> Any:
        """The request's stream state when `item` continues it, else ``None`` (start from zeros)."""
        state = self._streams.get(item.request_id)
        first_new = item.start + item.context
        if state is None or state.next_frame != first_new or (self.segment_size and first_new % self.segment_size == 0):
            return None
        if item.context * self.samples_per_frame < self.trimmed_samples:
            return None  # (no left context: the runtime's layout has no room for the held-back samples)
        return state

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def held_requests(self) -> int:
        return len(self._streams)
