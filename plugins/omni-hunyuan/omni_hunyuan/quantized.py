"""The ``dit`` stage's ``quantization`` option: the core's resolvers, applied to this transformer.

The core's `omni_core.quantization.quantize_linears` swaps the decoder layers' ``nn.Linear`` modules
(fused qkv, ``o_proj``, the shared expert; looped experts too) for its int8 or FP8 linears; the fp32
router stays as it is. Grouped experts (CUDA, bfloat16: `omni_hunyuan.layers.MoE.group_experts`) are
one stacked tensor per projection, which no linear swap reaches: `quantize_stacked` quantizes them
here, per expert and output channel, and `MoE.grouped_experts` runs them as

- ``fp8``: FP8 e4m3 weights, each token row scaled to FP8 on the fly, one ``torch._scaled_grouped_mm``
  per projection (Hopper: twice bf16's tensor-core rate; the scales applied to the output);
- ``int8_weight_only``: int8 weights dequantized to the activations' dtype at each call (half the
  weights' memory, no speed-up), then the bf16 grouped GEMMs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from omni_core.quantization import fp8_rows, quantize_linears

if TYPE_CHECKING:
    from omni_hunyuan.transformer import HunyuanImage3


def quantize_layers(model: HunyuanImage3, spec: dict[str, Any]) -> int:
    """Quantize `model`'s decoder layers as the resolved `spec` says (``{"method": ..., "min_features": ...}``,
    `omni_core.quantization`); returns how many linears and stacked projections were replaced.
    A method the core does not know, or ``fp8`` without an FP8 GPU, is its `ConfigError`."""
    layers = model.model.layers
    replaced = quantize_linears(layers, spec, skip=lambda name: name.endswith(".mlp.gate.wg"))
    for layer in layers:
        if layer.mlp.grouped:
            layer.mlp.quantize_experts(spec["method"])
            replaced += 2
    return replaced


def quantize_stacked(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' stacked projection ``[E, out, in]`` as ``method`` stores it, and its scales ``[E, out]``
    (fp32; symmetric, one per expert and output channel)."""
    if method == "fp8":
        quantized, scale = fp8_rows(weight.detach())
        return quantized, scale.squeeze(-1)
    if method == "int8_weight_only":
        full = weight.detach().float()
        scale = full.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
        return torch.round(full / scale[..., None]).clamp(-127, 127).to(torch.int8), scale
    raise ValueError(f"grouped experts cannot be quantized with {method!r} (fp8, int8_weight_only)")


def dequantize_stacked(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`quantize_stacked` undone, in `dtype` (a transient copy: int8 experts' call)."""
    return (weight.to(dtype) * scale[..., None].to(dtype)).contiguous()


def rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``[M, K]`` as FP8 e4m3 and their scales ``[M]`` (fp32; the core's `fp8_rows`, the layout
    ``torch._scaled_grouped_mm`` takes)."""
    x_fp8, scale = fp8_rows(x)
    return x_fp8, scale.squeeze(-1)


def fp8_grouped_mm(
    x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``x @ weight[g].T`` for the rows of each group ``g`` (rows ``ends[g-1]:ends[g]``), dequantized:
    FP8 rows `x` ``[M, K]`` with scales ``[M]``, FP8 weights ``[G, N, K]`` with scales ``[G, N]``; ``[M, N]``
    in `dtype`. On CUDA one ``torch._scaled_grouped_mm``; elsewhere (no such kernel)
    `fp8_grouped_mm_reference`."""
    if x.is_cuda:
        # Hopper's fast FP8 accumulation: -15% time at 4 requests' shapes (262k expert rows), 0.5% of
        # the output's range from exact fp32 sums (FP8 rounding itself is ~5%).
        weight_t = weight.transpose(1, 2)
        return torch._scaled_grouped_mm(x, weight_t, x_scale, scale, offs=ends, out_dtype=dtype, use_fast_accum=True)
    return fp8_grouped_mm_reference(x, x_scale, weight, scale, ends, dtype)


def fp8_grouped_mm_reference(
    x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """What the kernel computes, group by group: the FP8 values' products summed in fp32 (each FP8
    value is exact in fp32), then the row and channel scales."""
    out = torch.empty(x.shape[0], weight.shape[1], device=x.device, dtype=torch.float32)
    start = 0
    for group, end in enumerate(ends.tolist()):
        out[start:end] = (x[start:end].float() @ weight[group].float().T) * x_scale[start:end, None] * scale[group]
        start = end
    return out.to(dtype)
