"""The toy vocoder: codes (or LM hidden states) -> waveform, a small causal conv net.

Embedding (or a linear projection of hidden states) -> residual causal dilated Conv1d layers ->
transposed conv upsampling (kernel == stride, so frames do not overlap) -> tanh. Being causal with a
finite receptive field, it decodes chunk by chunk with left context exactly like in one piece.

It honours the test hook of `omni_toy.fail_hook` (stage parameter ``fail``).
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from omni_core.errors import InvalidRequestError
from omni_core.parts import PartContext
from omni_core.stages.generation_model import DecodeBatch, DecodeItem, GenerationModel
from omni_toy import fail_hook

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@attrs.frozen
class VocoderConfig:
    """The vocoder's ``config.json``."""

    vocab_size: int
    input_hidden_size: int = 64
    channels: int = 32
    kernel_size: int = 3
    dilations: tuple[int, ...] = (1, 2, 4)
    samples_per_frame: int = 8
    sample_rate: int = 16000
    chunk_size: int = 4
    left_context: int = 16
    model_type: str = "omni-toy-vocoder"

    @property
    def receptive_field(self) -> int:
        """Frames one output frame depends on (itself included)."""
        return 1 + sum((self.kernel_size - 1) * d for d in self.dilations)

    @classmethod
    def read(cls, directory: Path) -> "VocoderConfig":
        data = json.loads((Path(directory) / CONFIG_NAME).read_text())
        data["dilations"] = tuple(data.get("dilations", cls.__attrs_attrs__.dilations.default))
        return cls(**data)

    def write(self, directory: Path) -> None:
        (Path(directory) / CONFIG_NAME).write_text(json.dumps(attrs.asdict(self), indent=2) + "\n")


class ToyVocoderNet(nn.Module):
    """The network; `forward` takes features ``[B, T, channels]`` and gives ``[B, T * spf]``."""

    def __init__(self, config: VocoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.channels)
        self.in_proj = nn.Linear(config.input_hidden_size, config.channels)
        self.convs = nn.ModuleList(
            nn.Conv1d(config.channels, config.channels, config.kernel_size, dilation=d) for d in config.dilations
        )
        self.up = nn.ConvTranspose1d(config.channels, 1, config.samples_per_frame, stride=config.samples_per_frame)

    def features(self, frames: torch.Tensor) -> torch.Tensor:
        """Codes ``[..., T]`` (integer) or hidden states ``[..., T, hidden]`` -> ``[..., T, channels]``."""
        if frames.is_floating_point():
            return self.in_proj(frames.to(self.in_proj.weight.dtype))
        return self.embed(frames)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = features.transpose(1, 2)  # [B, C, T]
        for conv in self.convs:
            left = (self.config.kernel_size - 1) * conv.dilation[0]
            x = x + F.gelu(conv(F.pad(x, (left, 0))))  # left padding only: causal
        return torch.tanh(self.up(x)).squeeze(1)


def write_vocoder(directory: Path, vocab_size: int, input_hidden_size: int, seed: int = 0) -> None:
    """Write a random-weight vocoder (config.json + model.safetensors) into `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = VocoderConfig(vocab_size=vocab_size, input_hidden_size=input_hidden_size)
    with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's RNG state
        torch.manual_seed(seed)
        net = ToyVocoderNet(config)  # PyTorch's default init keeps tanh mostly out of saturation
    config.write(directory)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(directory / WEIGHTS_NAME))


class ToyVocoder(GenerationModel):
    """The ``vocoder`` stage's model part (also its factory: ``ToyVocoder(context)``)."""

    input_key = "codes"
    output_key = "audio"
    request_params = fail_hook.PARAMS

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.directory = Path(context.model_path) / "vocoder"
        self.config = VocoderConfig.read(self.directory)
        self.chunk_size = self.config.chunk_size
        self.left_context = self.config.left_context
        self.samples_per_frame = self.config.samples_per_frame
        self.extra_outputs = types.MappingProxyType({"sample_rate": self.config.sample_rate})
        self.net: ToyVocoderNet | None = None
        self.device = torch.device("cpu")
        self.batch_sizes: list[int] = []  # one entry per forward: tests check the batching

    def load(self, device: str, dtype: str) -> None:
        from safetensors.torch import load_file

        net = ToyVocoderNet(self.config)
        net.load_state_dict(load_file(str(self.directory / WEIGHTS_NAME)))
        self.device = torch.device(device)
        self.net = net.to(device=self.device, dtype=getattr(torch, dtype)).eval()

    def to_frames(self, value: Any) -> torch.Tensor:
        frames = super().to_frames(value)
        if frames.is_floating_point():
            if frames.ndim != 2 or frames.shape[1] != self.config.input_hidden_size:
                raise InvalidRequestError(
                    f"hidden-state frames must be [T, {self.config.input_hidden_size}], got {tuple(frames.shape)}",
                    param=self.input_key,
                )
            return frames
        if frames.dtype in (torch.bool, torch.complex64, torch.complex128) or frames.ndim != 1:
            raise InvalidRequestError(
                f"codes must be integer ids of shape [T], got {frames.dtype} {tuple(frames.shape)}",
                param=self.input_key,
            )
        if frames.numel() and (int(frames.min()) < 0 or int(frames.max()) >= self.config.vocab_size):
            raise InvalidRequestError(
                f"codes must be in [0, {self.config.vocab_size}), got [{int(frames.min())}, {int(frames.max())}]",
                param=self.input_key,
            )
        return frames.to(torch.long)

    def check_params(self, params: dict[str, Any]) -> None:
        fail_hook.check_params(params)

    def check(self, item: DecodeItem) -> None:
        fail_hook.check_item(item)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        assert self.net is not None, "load() first"
        fail_hook.before_decode(batch)
        # Codes and hidden states may share a batch: features per kind, then one forward for all.
        frames, _lengths = batch.padded(device=self.device) if _same_kind(batch) else (None, None)
        with torch.inference_mode():
            if frames is not None:
                features = self.net.features(frames)
            else:
                features = _mixed_features(self.net, batch, self.device)
            self.batch_sizes.append(len(batch))
            return self.net(features)


def _same_kind(batch: DecodeBatch) -> bool:
    return len({item.frames.is_floating_point() for item in batch.items}) == 1


def _mixed_features(net: ToyVocoderNet, batch: DecodeBatch, device: torch.device) -> torch.Tensor:
    lengths = batch.lengths()
    out = torch.zeros(len(lengths), max(lengths), net.config.channels, device=device, dtype=net.up.weight.dtype)
    for row, item in enumerate(batch.items):  # rare (mixed inputs): small per-item projections
        out[row, : lengths[row]] = net.features(item.frames.to(device))
    return out
