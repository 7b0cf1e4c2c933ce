"""The Qwen3-Omni ``code2wav`` stage's model part: codec frames ``[T, Q]`` -> 24 kHz waveform.

Wraps transformers' ``Qwen3OmniMoeCode2Wav`` loaded from the checkpoint's ``code2wav.*`` tensors.
The reference (``generate``) decodes with ``chunked_decode(300, 25)``: segments of 300 frames, each
restarting with 25 frames of context and losing its causal convolutions' trimmed tail. This model
part declares exactly that (`segment_size` / `segment_context`), and streams in small chunks
(`chunk_size` 25 frames) inside each segment with a left context of at least the decoder's
receptive field (the pre-transformer's sliding window per layer plus the convolution stack), so
the streamed waveform equals the reference's within float tolerance whatever the chunking. Only the
pre-transformer re-reads that context: the convolution stack, most of the work, keeps its state per
request between chunks (`omni_qwen3.code2wav_stream`) and decodes each frame once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from omni_core.errors import InvalidRequestError
from omni_core.stages.generation_model import DecodeBatch, DecodeItem, GenerationModel

if TYPE_CHECKING:
    import torch

    from omni_core.config.resolved import ResolvedPipeline, ResolvedStage

SAMPLE_RATE = 24000


class Code2WavModel(GenerationModel):
    """Batched code2wav decode: one forward over the right-padded chunks of many requests.

    Right padding is safe: the model is causal (its attention mask and convolutions look back
    only), so each item's samples do not depend on the padding after it.
    """

    input_key = "codes"
    output_key = "audio"
    chunk_size = 25
    # The reference's chunked_decode(300, 25) (omni_qwen3.reference).
    segment_size = 300
    segment_context = 25

    def __init__(self, pipeline: ResolvedPipeline, stage: ResolvedStage | None = None) -> None:
        from omni_qwen3.talker import read_config

        self.model_path = pipeline.model_path
        config = read_config(self.model_path)["code2wav_config"]
        self.num_quantizers = int(config["num_quantizers"])
        self.codebook_size = int(config["codebook_size"])
        total = 1
        for factor in list(config["upsample_rates"]) + list(config["upsampling_ratios"]):
            total *= int(factor)
        self.samples_per_frame = total
        self.left_context = receptive_field(config)
        self.extra_outputs = {"sample_rate": SAMPLE_RATE}
        self.model: Any = None
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
        from omni_qwen3.code2wav_stream import ConvStack

        self.stack = ConvStack(self.model)
        with torch.inference_mode():
            probe = self.model(torch.zeros((1, self.num_quantizers, 1), dtype=torch.long, device=device))
        # Causal transposed convolutions drop the same number of trailing samples per decode.
        self.trimmed_samples = self.samples_per_frame - int(probe.shape[-1])

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
        """The pre-transformer over each item's frames (left context included), then the
        convolution stack over the new frames only, from the request's saved state (`ConvStack`).

        An item that does not continue its request's stream (the first one, or the first of a new
        reference segment, which the reference decodes afresh) runs all its frames from zeros. The
        output keeps the runtime's layout (context samples first): the context part is zeros,
        since the runtime drops it.
        """
        import torch

        from omni_qwen3.code2wav_stream import StreamState

        padded, lengths = batch.padded(pad_value=0, device=self.device)
        model, spf = self.model, self.samples_per_frame
        with torch.inference_mode():
            codes = padded.transpose(1, 2)
            hidden = model.code_embedding(codes + model.code_offset).mean(1)
            hidden = model.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)  # [B, H, T]
            states = [self._continued(item) for item in batch.items]
            skip = [item.context if state is not None else 0 for item, state in zip(batch.items, states)]
            sizes = [int(length) - first for length, first in zip(lengths.tolist(), skip)]
            conv_in = hidden.new_zeros(hidden.shape[0], hidden.shape[1], max(sizes))
            for row, (first, size) in enumerate(zip(skip, sizes)):
                conv_in[row, :, :size] = hidden[row, :, first : first + size]
            waves, new_states = self.stack.run(conv_in, sizes, states)
        outputs = []
        for item, state, wave, tensors in zip(batch.items, states, waves, new_states):
            if item.final:
                self._streams.pop(item.request_id, None)
            else:
                self._streams[item.request_id] = StreamState(item.start + int(item.frames.shape[0]), tensors)
            if state is not None:  # only the new frames' samples: zeros stand for the dropped context
                wave = torch.cat([wave.new_zeros(item.context * spf - self.trimmed_samples), wave])
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


# Frames the causal convolutions around the pre-transformer look back (kernel 7 at the frame rate,
# then the upsampling blocks' kernels in frames): measured at under 8 on the tiny checkpoint.
CONV_MARGIN = 16


def receptive_field(config: dict[str, Any]) -> int:
    """Frames of past input that can change a frame's output: each sliding-window attention layer
    of the pre-transformer reaches `sliding_window` frames further back, plus the convolutions."""
    return int(config["num_hidden_layers"]) * int(config["sliding_window"]) + CONV_MARGIN


def code2wav_model(pipeline: ResolvedPipeline, stage: ResolvedStage) -> Code2WavModel:
    """The code2wav stage's model part factory (one per replica)."""
    return Code2WavModel(pipeline, stage)
