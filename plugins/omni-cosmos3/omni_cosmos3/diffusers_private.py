"""Every private name of diffusers (and of accelerate, which diffusers uses) that omni-cosmos3 relies on.

The Cosmos3 model part reproduces `Cosmos3OmniPipeline`'s denoising loop on diffusers' own modules,
and must match it exactly. Where diffusers offers no public way to do one of its steps, the plugin
calls the private one through a thin function here, and nowhere else: a diffusers release that
renames or changes one of them then fails `tests/test_diffusers_private.py` by name (each name's
existence, signature and behaviour is checked there) instead of changing outputs. The plugin's
``pyproject.toml`` pins diffusers to the range these were checked against.

========================================  ================================================================
function here                             private name it wraps (why there is no public way)
========================================  ================================================================
`prepare_action_video_conditioning`       ``Cosmos3OmniPipeline._prepare_action_video_conditioning``: the
                                          action task's resize and pad of the conditioning frames onto a
                                          resolution-tier canvas (only `__call__` uses it)
`embodiment_domain_id`                    ``pipeline_cosmos3_omni._EMBODIMENT_TO_DOMAIN_ID``: an embodiment's
                                          index into the action projections (`CosmosActionCondition`
                                          exposes its action width, not its domain id)
`init_step_index`, `advance_step_index`   ``UniPCMultistepScheduler._init_step_index`` / ``._step_index``:
                                          the step counter that `step` keeps (``step_index`` is read-only)
`sigma_to_alpha_sigma_t`                  ``UniPCMultistepScheduler._sigma_to_alpha_sigma_t``: the
                                          scheduler's sigma -> (alpha_t, sigma_t) for its configuration
`causal_conv_padding`                     ``WanCausalConv3d._padding``: its explicit (causal) padding; the
                                          public ``padding`` is zeroed for the 3-D convolution it wraps
`has_offload_hook`                        accelerate's ``_hf_hook`` attribute: whether an offload hook
                                          wraps a module (diffusers tests it the same way)
========================================  ================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def prepare_action_video_conditioning(
    pipe: Any, clip: Any, resolution_tier: int, num_frames: int, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The conditioning frames of an action request as the pipeline prepares them: ``(pixels
    [1, 3, num_frames, H, W] in [-1, 1] on the tier's canvas, image_size [canvas_h, canvas_w,
    content_h, content_w], canvas height, canvas width)``; the clip is repeated or cut to `num_frames`."""
    return pipe._prepare_action_video_conditioning(clip, resolution_tier, num_frames, device=device, dtype=dtype)


def embodiment_domain_id(domain: str) -> int:
    """The action-projection index of embodiment `domain` (a `CosmosActionCondition.domain_name`)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _EMBODIMENT_TO_DOMAIN_ID

    return int(_EMBODIMENT_TO_DOMAIN_ID[domain])


def init_step_index(scheduler: Any, timestep: Any) -> None:
    """Set a UniPC scheduler's step index from `timestep`, as its `step` does on the first call."""
    scheduler._init_step_index(timestep)


def advance_step_index(scheduler: Any) -> None:
    """Count one step done, as the end of UniPC's `step` does."""
    scheduler._step_index += 1


def sigma_to_alpha_sigma_t(scheduler: Any, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha_t, sigma_t)`` of `sigma` for a UniPC scheduler's configuration (flow or not)."""
    return scheduler._sigma_to_alpha_sigma_t(sigma)


def causal_conv_padding(conv: Any) -> tuple[int, int, int, int, int, int]:
    """A `WanCausalConv3d`'s padding in `F.pad` order: ``(w, w, h, h, 2 * t, 0)``, time in front only."""
    return tuple(conv._padding)  # type: ignore[return-value]


def has_offload_hook(module: Any) -> bool:
    """Whether accelerate wrapped `module` with a hook (CPU offload, device maps), which runs code
    around its forward that a walk of the module's parts would skip."""
    return hasattr(module, "_hf_hook")


__all__ = [
    "advance_step_index",
    "causal_conv_padding",
    "embodiment_domain_id",
    "has_offload_hook",
    "init_step_index",
    "prepare_action_video_conditioning",
    "sigma_to_alpha_sigma_t",
]
