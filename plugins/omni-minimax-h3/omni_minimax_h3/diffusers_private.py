"""Every private name of diffusers that omni-minimax-h3 relies on, behind one thin function each.

The plugin runs MiniMax-H3 on diffusers' own modules and blocks and must match
`MiniMaxH3ModularPipeline` exactly. Where diffusers offers no public way to do a step, the plugin
calls the private one here and nowhere else: a release that renames or changes it then fails
``tests/test_diffusers_private.py`` by name instead of changing outputs silently. ``pyproject.toml``
pins diffusers to the range these were checked against.

========================  ==========================================================================
function here             private name it wraps (why there is no public way)
========================  ==========================================================================
`apply_rotary_emb`        ``transformer_minimax_h3._apply_rotary_emb``: the rotation of the leading
                          rotary channels of every head that `MiniMaxH3AttnProcessor` applies; an
                          attention processor of our own (segmented attention) must apply the same
`gather_vision_features`  ``MiniMaxH3Ref2VATextEncoderStep._gather_vision_features``: a ref2va
                          request's reference pixels through the conditioner's processors; the
                          block runs it only inside its own conditioner call, and the plugin runs
                          the conditioner in another stage
`build_presentation`      ``MiniMaxH3Ref2VATextEncoderStep._build_presentation``: the labelled
                          ref2va presentation (token ids and row tags), same reason
========================  ==========================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def apply_rotary_emb(hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of every head of ``(batch, seq, heads, head_dim)`` states."""
    from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

    return _apply_rotary_emb(hidden_states, cos, sin)


def gather_vision_features(block: Any, processor: Any, references: list[Any], fps: float) -> tuple[dict, list[int], list[int], list[list[float]]]:
    """``(vision inputs, image token counts, video block token counts, video block timestamps)`` of
    normalized references; `processor` needs ``image_processor`` (and ``video_processor`` for videos)."""
    return block._gather_vision_features(processor, references, fps)


def build_presentation(
    tokenizer: Any, prompt: str, references: list[Any], image_token_counts: list[int], video_token_counts: list[int],
    video_timestamps: list[list[float]], text_tag: int, video_tag: int,
) -> tuple[list[int], list[int]]:
    """``(token ids, row tags)`` of a ref2va request's presentation."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    return MiniMaxH3Ref2VATextEncoderStep._build_presentation(
        tokenizer, prompt, references, image_token_counts, video_token_counts, video_timestamps,
        text_tag=text_tag, video_tag=video_tag,
    )


__all__ = ["apply_rotary_emb", "build_presentation", "gather_vision_features"]
