"""The core's default quantization resolvers (registered through `register_quantization_resolvers`).

A resolver maps a stage's ``quantization`` option to what that stage's runtime applies.
"""

from __future__ import annotations

from typing import Any

from omni_core.errors import ConfigError


def resolve_fp8(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """FP8: vLLM's ``fp8`` quantization for AR stages (GPU builds of vLLM)."""
    if kind == "ar":
        return {"quantization": "fp8"}
    raise ConfigError(f"the fp8 resolver does not support {kind!r} stages", key="quantization")
