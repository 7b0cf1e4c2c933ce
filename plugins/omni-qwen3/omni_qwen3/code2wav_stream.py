"""Streaming Code2Wav convolutions: each request's convolution stack keeps its state between chunks.

transformers' ``Qwen3OmniMoeCode2Wav`` is a sliding-window pre-transformer followed by a stack of
causal convolutions (upsampling, ConvNeXt, SnakeBeta residual units). Re-feeding left-context frames
makes chunked decoding exact but decodes the context again through the whole stack, by far its
most expensive part. `ConvStack` runs that stack incrementally instead, on the same modules: every
causal convolution keeps the last ``(kernel - 1) * dilation`` samples of its input per request and
every overlapping transposed convolution its last input sample, so a chunk's new frames alone give
exactly the samples a full decode gives for them. The pre-transformer still sees its left context
(it is cheap), and a request's first chunk starts from zeros, which is the full decode's padding.

Batched: the chunks of many requests run right-padded in one pass. A request that starts from
zeros loses the first samples of each overlapping transposed convolution, as the full decode
trims them; those samples are tracked per row as a leading region (``lead``) that is zeroed before
every convolution, which is what the full decode's zero padding sees there, and cut at the end.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.define
class StreamState:
    """One request's convolution states (in `ConvStack` order) and the next frame it expects."""

    next_frame: int
    tensors: list[torch.Tensor]  # per stateful op: [C, width]


@attrs.define
class _Op:
    kind: str  # "pointwise", "conv", "tconv", "convnext", "residual", "clamp"
    module: Any
    width: int = 0  # samples of state kept (conv: (k-1)*dilation; tconv with overlap: 1)
    stride: int = 1


class ConvStack:
    """The upsampling and decoder stack of a loaded ``Qwen3OmniMoeCode2Wav``, run incrementally."""

    def __init__(self, model: Any) -> None:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

        self._types = hf
        ops: list[_Op] = []
        for blocks in model.upsample:
            for block in blocks:
                ops.append(self._op(block))
        for block in model.decoder:
            if isinstance(block, hf.Qwen3OmniMoeCode2WavDecoderBlock):
                ops.extend(self._op(inner) for inner in block.block)
            else:
                ops.append(self._op(block))
        self.ops = ops

    def _op(self, module: Any) -> _Op:
        hf = self._types
        if isinstance(module, hf.Qwen3OmniMoeCausalConvNet):
            if module.stride != 1:
                raise NotImplementedError("streaming decode supports stride-1 causal convolutions only")
            return _Op("conv", module, width=module.kernel_size - 1)
        if isinstance(module, hf.Qwen3OmniMoeCausalTransConvNet):
            kernel, stride = module.conv.kernel_size[0], module.conv.stride[0]
            if kernel not in (stride, 2 * stride) or module.left_pad != kernel - stride:
                raise NotImplementedError(f"streaming decode: transposed convolution kernel {kernel}, stride {stride}")
            return _Op("tconv", module, width=1 if kernel == 2 * stride else 0, stride=stride)
        if isinstance(module, hf.Qwen3OmniMoeConvNeXtBlock):
            return _Op("convnext", module, width=module.dwconv.kernel_size - 1)
        if isinstance(module, hf.Qwen3OmniMoeCode2WavDecoderResidualUnit):
            if module.conv2.kernel_size != 1:
                raise NotImplementedError("streaming decode: residual units end in a 1-sample convolution")
            return _Op("residual", module, width=module.conv1.kernel_size - 1)
        if isinstance(module, hf.Qwen3OmniMoeSnakeBeta):
            return _Op("pointwise", module)
        raise NotImplementedError(f"streaming decode: unexpected module {type(module).__name__}")

    @torch.inference_mode()
    def run(
        self, hidden: torch.Tensor, lengths: list[int], states: list[StreamState | None]
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Decode `hidden` [B, H, T] (right-padded; `lengths` valid frames per row) from `states`
        (``None``: the row starts from zeros). Returns each row's new samples and its new states."""
        rows = hidden.shape[0]
        fresh = [state is None for state in states]
        end = list(lengths)
        lead = [0] * rows
        new_states: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        index = 0  # the next state slot
        x = hidden
        for op in self.ops:
            if op.kind == "pointwise":
                x = op.module(x)
            elif op.kind == "tconv":
                if op.width:
                    joined = self._with_state(x, states, index, op.width, end, new_states)
                    index += 1
                    x = op.module.conv(joined)[..., op.stride : op.stride + x.shape[-1] * op.stride]
                    # A row starting from zeros loses its first block, as the full decode trims it.
                    lead = [(lead[i] + fresh[i]) * op.stride for i in range(rows)]
                else:
                    x = op.module.conv(x)
                    lead = [value * op.stride for value in lead]
                end = [value * op.stride for value in end]
            elif op.kind == "conv":
                x = op.module.conv(self._with_state(_zero_lead(x, lead), states, index, op.width, end, new_states))
                index += 1
            elif op.kind == "convnext":
                block = op.module
                x = _zero_lead(x, lead)
                h = block.dwconv.conv(self._with_state(x, states, index, op.width, end, new_states)).permute(0, 2, 1)
                index += 1
                h = block.pwconv2(block.act(block.pwconv1(block.norm(h))))
                x = x + (block.gamma * h).permute(0, 2, 1)
            else:  # residual unit: act1 -> causal conv1 -> act2 -> 1-sample conv2, plus the input
                unit = op.module
                h = _zero_lead(unit.act1(x), lead)
                h = unit.conv1.conv(self._with_state(h, states, index, op.width, end, new_states))
                index += 1
                x = x + unit.conv2.conv(unit.act2(h))
        x = x.clamp(min=-1, max=1)
        return [x[i, 0, lead[i] : end[i]] for i in range(rows)], new_states

    @staticmethod
    def _with_state(
        x: torch.Tensor, states: list[StreamState | None], index: int, width: int, end: list[int],
        new_states: list[list[torch.Tensor]],
    ) -> torch.Tensor:
        """`x` with each row's past `width` input samples in front; records the rows' next states."""
        past = torch.stack([x.new_zeros(x.shape[1], width) if state is None else state.tensors[index] for state in states])
        joined = torch.cat([past, x], dim=-1)
        # Each row's last `width` real samples: [end, end + width) in joined coordinates.
        positions = torch.tensor(end, device=x.device)[:, None] + torch.arange(width, device=x.device)
        tail = joined.gather(2, positions[:, None, :].expand(-1, x.shape[1], -1))
        for row, state in zip(new_states, tail.unbind(0)):
            row.append(state)
        return joined


def _zero_lead(x: torch.Tensor, lead: list[int]) -> torch.Tensor:
    """`x` with each row's leading `lead` samples zeroed (what a full decode's zero padding holds there)."""
    if not any(lead):
        return x
    keep = torch.arange(x.shape[-1], device=x.device)[None, :] >= torch.tensor(lead, device=x.device)[:, None]
    return x * keep[:, None, :].to(x.dtype)
