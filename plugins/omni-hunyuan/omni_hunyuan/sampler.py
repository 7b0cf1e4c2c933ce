"""The release's text-to-image sampler: flow-match Euler with CFG over a cached text prefix.

- sigmas ``shift * s / (1 + (shift - 1) * s)`` over ``linspace(1, 0, steps + 1)``, shift =
  ``generation_config.flow_shift``; the model sees ``t = sigma * 1000``;
- starting noise: ``torch.randn`` in bfloat16 from a generator seeded with the request's seed, on the
  device, then cast up; this draws what the release draws, so a seed reproduces its image;
- CFG: rows [cond, uncond] in one forward, ``uncond + g * (cond - uncond)`` when g > 1;
- the text prefix's keys/values are computed once and reused by every step (text never sees the image);
- a -Distil checkpoint has no CFG rows: ``cfg_distilled`` embeds the guidance scale in a ``<guidance>``
  token (`distilled_guidance`), ``use_meanflow`` the next step's timestep (``sigma_next * 1000``, 0 at
  the last step) in a ``<timestep_r>`` token; the update stays Euler.
"""

from __future__ import annotations

import torch

from omni_hunyuan.transformer import HunyuanImage3


def flow_sigmas(steps: int, shift: float) -> torch.Tensor:
    """fp32 ``[steps + 1]`` sigmas from 1 to 0."""
    sigmas = torch.linspace(1, 0, steps + 1)
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def distilled_guidance(scale: float) -> float:
    """What a -Distil checkpoint's ``<guidance>`` token embeds for a guidance scale: ``1000 * scale``
    rounded to bfloat16, as the release hands it over (2.5 -> 2496), whatever the model's dtype."""
    return float(torch.tensor(1000.0 * scale, dtype=torch.bfloat16))


def initial_noise(seed: int, channels: int, height: int, width: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """fp32 ``[1, C, h, w]`` starting latents drawn as the release draws them (bf16 normal, one generator)."""
    generator = torch.Generator(device).manual_seed(seed)
    return torch.randn((1, channels, height, width), generator=generator, device=device, dtype=torch.bfloat16).float()


@torch.no_grad()
def sample_t2i(
    model: HunyuanImage3,
    prefix_ids: torch.Tensor,
    latents: torch.Tensor,
    steps: int,
    guidance_scale: float,
    flow_shift: float,
) -> torch.Tensor:
    """Denoise fp32 `latents` ``[1, C, h, w]`` given prefix rows ``[1 or 2, L]`` ([cond, uncond] for CFG;
    a -Distil checkpoint: cond only, the guidance embedded)."""
    config = model.config
    cfg = guidance_scale > 1.0 and not config.cfg_distilled
    if cfg != (prefix_ids.shape[0] == 2):
        raise ValueError("CFG needs the [cond, uncond] prefix rows, and only CFG does")
    dtype = model.model.wte.weight.dtype
    prefix = model.encode_prefix(prefix_ids.to(latents.device))
    rows = prefix_ids.shape[0]
    sigmas = flow_sigmas(steps, flow_shift).to(latents.device)
    timesteps = sigmas * 1000
    scalars: dict[str, torch.Tensor] = {}
    if config.cfg_distilled:
        scalars["guidance"] = torch.tensor([distilled_guidance(guidance_scale)], device=latents.device)
    for step in range(steps):
        if config.use_meanflow:
            scalars["timestep_r"] = timesteps[step + 1][None]
        # (the rows share the latents and timestep: the UNet embedder runs once, `velocity`'s `repeats`)
        velocity = model.velocity(prefix, latents.to(dtype), timesteps[step][None], repeats=[rows], **scalars).float()
        if cfg:
            cond, uncond = velocity.chunk(2)
            velocity = uncond + guidance_scale * (cond - uncond)
        latents = latents + velocity * (sigmas[step + 1] - sigmas[step])
    return latents
