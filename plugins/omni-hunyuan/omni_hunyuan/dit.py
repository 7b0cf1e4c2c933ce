"""The ``dit`` stage: text-to-image on the core diffusion runtime, with our transformer and sampler.

Per request: the prompt's token rows (cond, plus uncond under CFG) are encoded ONCE into a text-prefix
KV cache (`start`); every step then runs only ``<timestep>`` and the image tokens. Requests at
different steps and with prompts of different lengths share one forward (`denoise`): their caches are
right-padded and masked, their timesteps are per row, and each request keeps its own sigmas.
The defaults (steps, guidance, flow shift, template) come from the checkpoint's generation_config;
a request's ``seed`` draws the release's starting noise, so it reproduces the release's image.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import torch

from omni_core.errors import InvalidRequestError
from omni_core.stages.diffusion_model import DiffusionModel, DiffusionSample, LoadSpec
from omni_hunyuan.config import HunyuanConfig, generation_defaults
from omni_hunyuan.prompt import t2i_rows
from omni_hunyuan.sampler import flow_sigmas, initial_noise
from omni_hunyuan.tokens import NUM_BASE_RATIOS, SpecialTokens
from omni_hunyuan.transformer import PrefixCache


@attrs.define(eq=False)
class _State:
    prefix_ids: torch.Tensor  # [rows, L]: [cond, uncond] under CFG
    latents: torch.Tensor  # fp32 [1, C, h, w]
    sigmas: torch.Tensor
    guidance_scale: float
    cache: PrefixCache | None = None


def square_ratio_index() -> int:
    """The 1:1 entry of the base release's 33 ratios (the middle one).

    The rest of the release's resolution table is not implemented yet (issue 25): until it is, the
    stage draws square images at the checkpoint's ``image_base_size``.
    """
    return NUM_BASE_RATIOS // 2


class HunyuanDiT(DiffusionModel):
    """Text -> image with HunyuanImage-3.0's own transformer; stage params ``seed``, ``size``
    ([width, height]), ``num_inference_steps``, ``guidance_scale`` (defaults from generation_config)."""

    max_steps = 200

    def load(self, spec: LoadSpec) -> None:
        from transformers import AutoTokenizer

        from omni_hunyuan.vae import load_vae
        from omni_hunyuan.weights import load_transformer

        path = self.context.model_path
        self.config = HunyuanConfig.from_pretrained(path)
        self.defaults = generation_defaults(path)
        self.device = spec.device
        self.transformer = load_transformer(path, device=spec.device, dtype=getattr(torch, spec.dtype))
        self.vae = load_vae(path, self.config.vae, device=spec.device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokens = SpecialTokens.from_tokenizer(self.tokenizer, self.config.image_base_size)
        template = self.defaults.get("sequence_template", "pretrain")
        if template != "pretrain":
            # The instruct template (chat roles, think/recaption) is the AR->DiT task's, not built yet.
            raise NotImplementedError(f"sequence_template {template!r}: only 'pretrain' is implemented")

    def _param(self, data: dict[str, Any], params: dict[str, Any], key: str, default: Any) -> Any:
        return params.get(key, data.get(key, default))

    def prepare(self, request_id: str, data: dict[str, Any], params: dict[str, Any]) -> list[DiffusionSample]:
        prompt = data.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError("HunyuanImage-3.0 needs a text prompt", param="prompt")
        base = self.config.image_base_size
        try:
            width, height = (int(v) for v in self._param(data, params, "size", (base, base)))
        except (TypeError, ValueError):
            raise InvalidRequestError("size must be [width, height]", param="size") from None
        if (width, height) != (base, base):
            raise InvalidRequestError(
                f"size: this checkpoint draws {base}x{base} images for now (its resolution table is not implemented)",
                param="size",
            )
        steps = int(self._param(data, params, "num_inference_steps", self.defaults.get("diff_infer_steps", 50)))
        if not 1 <= steps <= self.max_steps:
            raise InvalidRequestError(f"num_inference_steps must be in 1..{self.max_steps}, got {steps}", param="num_inference_steps")
        guidance = float(self._param(data, params, "guidance_scale", self.defaults.get("diff_guidance_scale", 5.0)))
        seed = self._param(data, params, "seed", None)
        seed = random.randrange(2**31) if seed is None else int(seed)
        side_h, side_w = height // self.config.vae_downsample, width // self.config.vae_downsample
        rows = t2i_rows(self.tokenizer, self.tokens, prompt, square_ratio_index(), side_h, side_w, cfg=guidance > 1.0)
        state = _State(
            prefix_ids=rows.prefix.to(self.device),
            latents=initial_noise(seed, self.config.latent_channels, side_h, side_w, self.device),
            sigmas=flow_sigmas(steps, float(self.defaults.get("flow_shift", 3.0))).to(self.device),
            guidance_scale=guidance,
        )
        return [DiffusionSample(request_id, 0, steps, (side_h, side_w), state)]

    def start(self, samples: list[DiffusionSample]) -> None:
        for sample in samples:
            sample.state.cache = self.transformer.encode_prefix(sample.state.prefix_ids)

    @torch.no_grad()
    def denoise(self, samples: list[DiffusionSample]) -> None:
        states: list[_State] = [s.state for s in samples]
        dtype = self.transformer.model.wte.weight.dtype
        rows = [state.prefix_ids.shape[0] for state in states]
        latents = torch.cat([state.latents.expand(n, -1, -1, -1) for state, n in zip(states, rows)]).to(dtype)
        timesteps = torch.cat(
            [(state.sigmas[sample.step] * 1000).repeat(n) for sample, state, n in zip(samples, states, rows)]
        )
        caches = [state.cache for state in states]
        assert all(cache is not None for cache in caches)
        velocity = self.transformer.velocity(PrefixCache.concat(caches), latents, timesteps).float()  # type: ignore[arg-type]
        for sample, state, part in zip(samples, states, velocity.split(rows)):
            if part.shape[0] == 2:
                cond, uncond = part.chunk(2)
                part = uncond + state.guidance_scale * (cond - uncond)
            state.latents = state.latents + part * (state.sigmas[sample.step + 1] - state.sigmas[sample.step])

    def decode(self, samples: list[DiffusionSample]) -> list[dict[str, Any]]:
        from omni_hunyuan.vae import decode_latents

        images = decode_latents(self.vae, torch.cat([s.state.latents for s in samples]), self.config.vae).cpu().numpy()
        for sample in samples:
            sample.state.cache = None  # the prefix KV is the request's largest state: drop it now
        return [{"image": image} for image in images]
