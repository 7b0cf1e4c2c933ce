"""The core's default quantization resolvers (registered through `register_quantization_resolvers`).

A resolver maps a stage's ``quantization`` option to what that stage's runtime applies: vLLM's
quantization arguments for ``ar`` stages, a linear-layer swap spec for ``diffusion`` stages. The
swap itself (`quantize_linears`) replaces the ``torch.nn.Linear`` modules of a DiT:

- ``int8``: int8 weight-only (per-output-channel symmetric scales, activations stay in the model's
  dtype); runs anywhere, halves (fp16/bf16) or quarters (fp32) the weights' memory.
- ``fp8``: FP8 e4m3 weights (a scale per output channel) and FP8 activations scaled per token row on
  the fly, through ``torch._scaled_mm`` (GPUs with FP8 tensor cores: Hopper, Ada, Blackwell).

torch is imported inside functions: the core imports this module at discovery time.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

from omni_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def resolve_fp8(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """FP8: vLLM's ``fp8`` quantization for AR stages; FP8 DiT linears for diffusion stages (GPU)."""
    if kind == "ar":
        return {"quantization": "fp8"}
    if kind == "diffusion":
        return {"method": "fp8", "min_features": 64}
    raise ConfigError(f"the fp8 resolver does not support {kind!r} stages", key="quantization")


def resolve_int8(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """int8 weight-only DiT linears for diffusion stages (CPU and GPU)."""
    if kind == "diffusion":
        return {"method": "int8_weight_only", "min_features": 64}
    raise ConfigError(
        f"the int8 resolver does not support {kind!r} stages (for ar stages use a vLLM method, e.g. fp8)",
        key="quantization",
    )


def quantize_linears(module: torch.nn.Module, spec: dict[str, Any], skip: Callable[[str], bool] | None = None) -> int:
    """Replace the ``nn.Linear`` layers of `module` as `spec` says; return how many were replaced.

    Layers with fewer than ``spec["min_features"]`` input or output features stay as they are
    (tiny projections gain nothing), as do those whose qualified name `skip` accepts and, for
    ``fp8``, those with a dimension that is not a multiple of 16 (``torch._scaled_mm`` needs it).
    """
    import torch

    method = spec.get("method")
    builders = {"int8_weight_only": _int8_class, "fp8": _fp8_class}
    if method not in builders:
        raise ConfigError(f"unknown linear quantization method {method!r}; known: {', '.join(builders)}", key="quantization")
    if method == "fp8" and not _fp8_supported():
        raise ConfigError(
            "fp8 linears need a CUDA GPU with FP8 support (compute capability >= 8.9); "
            "on CPU use quantization: int8",
            key="quantization",
        )
    cls = builders[method]()
    min_features = int(spec.get("min_features", 0))
    replaced = named = narrow = unaligned = 0
    for name, child in list(module.named_modules()):
        for child_name, layer in list(child.named_children()):
            qualified = f"{name}.{child_name}" if name else child_name
            if type(layer) is not torch.nn.Linear:
                continue
            if skip is not None and skip(qualified):
                named += 1
            elif min(layer.in_features, layer.out_features) < min_features:
                narrow += 1
            elif method == "fp8" and (layer.in_features % 16 or layer.out_features % 16):
                unaligned += 1  # torch._scaled_mm needs both dimensions of the weight to be multiples of 16
            else:
                setattr(child, child_name, cls.from_linear(layer))
                replaced += 1
    kept = [f"{named} left unquantized by the family"] if named else []
    kept += [f"{narrow} narrower than {min_features} features"] if narrow else []
    kept += [f"{unaligned} with a dimension not a multiple of 16"] if unaligned else []
    logger.info("%s: %d of %d linear layers replaced%s", method, replaced, replaced + named + narrow + unaligned,
                f" (kept: {', '.join(kept)})" if kept else "")
    return replaced


def _fp8_supported() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and hasattr(torch, "_scaled_mm")


@functools.cache
def _int8_class() -> type:
    import torch

    class Int8WeightOnlyLinear(torch.nn.Module):
        """A linear layer with int8 weights and per-output-channel scales; computes in the input's dtype."""

        def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
            super().__init__()
            self.in_features = weight_int8.shape[1]
            self.out_features = weight_int8.shape[0]
            self.register_buffer("weight_int8", weight_int8)
            self.register_buffer("scale", scale)
            self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

        @classmethod
        def from_linear(cls, linear: torch.nn.Linear) -> "Int8WeightOnlyLinear":
            weight = linear.weight.detach().float()
            scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
            return cls(quantized, scale.to(linear.weight.dtype), linear.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Scaling the output instead of the weight keeps the dequantized weight transient:
            # (x @ W_int8^T) * s == x @ (W_int8 * s)^T.
            out = torch.nn.functional.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
            return out if self.bias is None else out + self.bias.to(x.dtype)

    return Int8WeightOnlyLinear


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `x` (along its last dimension) as FP8 e4m3, each scaled by its absolute maximum, and
    those scales (fp32, `x`'s shape with a last dimension of 1): ``x ~= rows * scales``. An activation's
    token rows, or a weight's output channels (``[N, K]``, ``[experts, N, K]``). Traceable by
    ``torch.compile``."""
    import torch

    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    full = x.float()
    scale = full.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / fp8_max
    return (full / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale


@functools.cache
def _fp8_class() -> type:
    import torch

    # On a GPU the scaling is one fused kernel even when the model is not compiled: eager, its
    # five passes over the activation (a float copy, abs, max, divide, cast) cost more than the FP8
    # GEMM saves (bench/fp8_linear.py). Compiled on its first call, for any row count.
    fused_rows_fp8 = torch.compile(fp8_rows, dynamic=True)

    class FP8Linear(torch.nn.Module):
        """A linear layer with FP8 e4m3 weights (a scale per output channel) and FP8 inputs scaled on the
        fly (a scale per token row): ``torch._scaled_mm``'s row-wise scaling, fp32 scales, bf16 output.

        Row-wise scales keep one large row or channel from flattening the others' precision (a
        per-tensor scale does). Hopper's fast FP8 accumulation is on: it sums in lower precision
        inside the tensor cores (on HunyuanImage-3.0's expert GEMMs: 0.5% of the output's range,
        against FP8 rounding's ~5%, for 15% less time; `bench/fp8_linear.py` measures this layer)."""

        def __init__(self, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
            super().__init__()
            self.in_features = weight_fp8.shape[1]
            self.out_features = weight_fp8.shape[0]
            self.register_buffer("weight_fp8", weight_fp8)
            self.register_buffer("scale", scale)  # [1, out_features], fp32
            self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

        @classmethod
        def from_linear(cls, linear: torch.nn.Linear) -> "FP8Linear":
            quantized, scale = fp8_rows(linear.weight.detach())
            return cls(quantized, scale.t().contiguous(), linear.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            x_fp8, x_scale = (fused_rows_fp8 if x.is_cuda else fp8_rows)(x.reshape(-1, shape[-1]))
            # contiguous: a column-major view (e.g. a transposed activation) could stay column-major
            # through the elementwise ops, and _scaled_mm takes only a row-major first operand.
            x_fp8 = x_fp8.contiguous()
            out = torch._scaled_mm(
                x_fp8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=torch.bfloat16, use_fast_accum=True
            )
            out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias.to(x.dtype)

    return FP8Linear
