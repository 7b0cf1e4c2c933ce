"""The Cosmos3 model part of the ``diffusion`` stage: diffusers' Cosmos3 components, denoised in batches.

`Cosmos3OmniPipeline` runs one sample per call and one transformer forward per guidance branch.
This model part reproduces its denoising loop for many samples at once, on the same diffusers
modules (`Cosmos3OmniTransformer`, `AutoencoderKLWan`, `Cosmos3AVAEAudioTokenizer`,
`UniPCMultistepScheduler`) loaded from the same checkpoint:

- The transformer is a Mixture-of-Transformers: a causal *reasoner* (understanding) tower over the
  prompt tokens and a *generator* tower over the vision/sound tokens, which attends to the
  reasoner's keys/values. The reasoner never sees the generator, so its keys/values are the same
  at every step: they are computed once per request and guidance branch (`start`) and reused.
- Each step, the generator tower runs once for every row of the batch (sample x guidance branch),
  rows padded to the longest prompt and masked; requests at different steps share the forward.
- Samples with equal latent shapes (and sound lengths) share a forward: that is the batch key.
- Classifier-free guidance, per-sample schedulers (UniPC keeps history) and the VAE decode follow
  the pipeline exactly, so each request's output equals the pipeline run alone on it.
- A replica may span devices (the stage's ``parallel`` option): with ``cfg: 2`` each guidance
  branch's rows run on their own rank, with ``ulysses: N`` each rank runs 1/N of the generator
  tokens (`omni_core.stages.diffusion_parallel`); the reasoner runs on each rank for its rows.
- Action tasks (``policy``, ``inverse_dynamics``; checkpoints with ``action_gen``) add action
  tokens after the vision tokens (embodiment-specific projections, one domain per sample) and keep
  the conditioning latent frames clean (no timestep embedding, zero velocity), as the pipeline does
  for a `CosmosActionCondition`; the conditioning frames are VAE-encoded once per request in `start`.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from omni_core.errors import InvalidRequestError, MissingDependencyError
from omni_core.parts import PartContext
from omni_core.stages import diffusion_cache
from omni_core.stages.cuda_graphs import GraphCache
from omni_core.stages.diffusion_model import DiffusionModel, DiffusionSample, LoadSpec
from omni_core.stages.diffusion_parallel import SINGLE, ParallelConfig, check_heads
from omni_cosmos3 import diffusers_private
from omni_cosmos3.layers import EAGER, Context, LayerKernels, attention, generator_layer, patchify, rope, unpatchify
from omni_cosmos3.positions import build_row
from omni_cosmos3.samples import (
    Actions, Conditioning, Row, SampleState, SchedulerGroup, float_rows, group_schedulers, group_step, guided, noisy_frames_rows, row_branch,
)
from omni_cosmos3.scheduling import scheduler_step
from omni_cosmos3.tasks import PARAMS, TASKS, ActionSpec, Request, parse_request
from omni_cosmos3.vae2d import SingleFrameDecoder


DIFFUSERS_REQUIREMENT = "diffusers>=0.40,<0.43"
"""The diffusers versions this plugin was checked against (as its pyproject.toml pins them)."""


class Cosmos3Model(DiffusionModel):
    """The ``generator`` stage's model part (also its factory: ``Cosmos3Model(context)``)."""

    max_steps = 200  # the multistep scheduler's step update fails further (IndexError at 400 steps)
    load_options = frozenset({"quantization", "compile", "cuda_graphs", "vae_tiling"})
    parallel_modes = frozenset({"cfg", "ulysses"})
    request_params = PARAMS
    media_params = frozenset({"image", "video"})  # conditioning frames: data: URLs (over HTTP, what the operator allowed too)

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.path = Path(context.model_path)
        self.pipe: Any = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        # batch_key -> (the rows, their attention context): a group's context only changes when a
        # sample joins or leaves, so it is rebuilt then, not every step (hundreds of small copies).
        self._contexts: OrderedDict[Any, tuple[list[Row], Context]] = OrderedDict()
        self.kernels = EAGER
        self.graphs: GraphCache | None = None  # CUDA graphs of the generator stack (LoadSpec.cuda_graphs)
        self.vae_decode: SingleFrameDecoder | None = None  # `vae.decode(z).sample`, in 2-D for images
        self.parallel = SINGLE

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def check_parallel(cls, config: ParallelConfig, model_path: str) -> None:
        path = Path(model_path) / "transformer" / "config.json"
        if config.ulysses > 1 and path.is_file():
            check_heads(config, int(json.loads(path.read_text())["num_attention_heads"]), "transformer/config.json")

    def load(self, spec: LoadSpec) -> None:
        try:
            from diffusers import Cosmos3OmniPipeline
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise MissingDependencyError(f"Cosmos3 needs diffusers: pip install '{DIFFUSERS_REQUIREMENT}' ({exc})") from None

        self.dtype = getattr(torch, spec.dtype)
        self.parallel = spec.parallel
        kwargs: dict[str, Any] = {"enable_safety_checker": False}
        if self.dtype != torch.float32:
            kwargs["dtype"] = self.dtype
        pipe = Cosmos3OmniPipeline.from_pretrained(str(self.path), **kwargs)
        self.device = torch.device(spec.device)
        pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        if spec.quantization is not None:
            from omni_core.quantization import quantize_linears

            # Only the towers' blocks: the modality projections and time embedding are small and precision-sensitive.
            quantize_linears(pipe.transformer, spec.quantization, skip=lambda name: not name.startswith("layers."))
        if self.device.type == "cuda":
            # cuDNN's tensor-core 3-D convolutions want channels-last activations: the VAE decode is
            # a large share of a small model's request.
            for module in pipe.vae.modules():
                if isinstance(module, torch.nn.Conv3d):
                    module.to(memory_format=torch.channels_last_3d)
        if spec.vae_tiling:
            tile = spec.vae_tile
            if tile is None:
                pipe.vae.enable_tiling()
            else:
                pipe.vae.enable_tiling(
                    tile_sample_min_height=tile, tile_sample_min_width=tile,
                    tile_sample_stride_height=tile * 3 // 4, tile_sample_stride_width=tile * 3 // 4,
                )
        self.pipe = pipe
        self.vae_decode = SingleFrameDecoder(pipe.vae)  # after the weights' final device and layout
        self.kernels = LayerKernels.compiled() if spec.compile else EAGER
        self.graphs = GraphCache() if spec.cuda_graphs and self.device.type == "cuda" else None
        config = pipe.transformer.config
        self.patch = int(config.latent_patch_size)
        self.sf_spatial = int(pipe.vae_scale_factor_spatial)
        self.sf_temporal = int(pipe.vae_scale_factor_temporal)
        self.has_sound = pipe.sound_tokenizer is not None and bool(getattr(config, "sound_gen", False))
        self.has_actions = bool(getattr(config, "action_gen", False))

    def close(self) -> None:
        self.pipe = None
        self.vae_decode = None
        self._contexts.clear()
        if self.graphs is not None:
            self.graphs.clear()

    @property
    def transformer(self) -> Any:
        """The loaded `Cosmos3OmniTransformer` (both towers)."""
        return self.pipe.transformer

    # -- requests --------------------------------------------------------------------------------

    def prepare(self, request_id: str, data: dict[str, Any], params: dict[str, Any]) -> list[DiffusionSample]:
        request = parse_request(data, params, pixels_per_token=self.sf_spatial * self.patch, temporal_factor=self.sf_temporal)
        if request.sound and not self.has_sound:
            raise InvalidRequestError(
                f"task {request.task!r} needs a checkpoint with a sound tokenizer and sound_gen; this one has none",
                param="task",
            )
        if request.num_inference_steps > self.max_steps:
            raise InvalidRequestError(
                f"num_inference_steps must be between 1 and {self.max_steps}, got {request.num_inference_steps}",
                param="num_inference_steps",
            )
        pipe = self.pipe
        conditioning = None
        if request.action is not None:
            request, conditioning = self._action_request(request)
        cond_ids, uncond_ids = pipe.tokenize_prompt(
            request.prompt,
            request.negative_prompt,
            num_frames=request.num_frames,
            height=request.height,
            width=request.width,
            fps=request.fps,
            use_system_prompt=request.use_system_prompt,
            action_mode=request.task if request.action is not None else None,
            action_view_point=request.action.view_point if request.action is not None else None,
        )
        seed = request.seed if request.seed is not None else random.randrange(2**31)
        samples = []
        for index in range(request.n):
            state = self._new_state(request, cond_ids, uncond_ids, seed + index, conditioning)
            key = (
                tuple(state.latents.shape),
                0 if state.sound_latents is None else int(state.sound_latents.shape[1]),
                0 if state.actions is None else state.actions.length,
            )
            tokens = sum(int(row.gen_positions.shape[1]) for row in state.rows)  # the generator's rows, every branch
            samples.append(DiffusionSample(request_id, index, len(state.scheduler.timesteps), key, state, tokens=tokens))
        return samples

    def _action_request(self, request: Request) -> tuple[Request, Conditioning]:
        """Validate an action request against the checkpoint; size it and lay out its frames (no encode yet)."""
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

        spec: ActionSpec = request.action
        if not self.has_actions:
            raise InvalidRequestError(
                f"task {request.task!r} needs a checkpoint trained with action_gen; this one has no action head", param="task"
            )
        frames = spec.frames if spec.is_video else spec.frames[0]
        try:
            # diffusers' own checks: known embodiment with a fixed action width, mode vs frames.
            condition = CosmosActionCondition(
                mode=request.task, chunk_size=spec.chunk_size, domain_name=spec.domain, resolution_tier=spec.resolution_tier,
                image=None if spec.is_video else frames, video=frames if spec.is_video else None, view_point=spec.view_point,
            )
        except ValueError as exc:
            raise InvalidRequestError(f"{exc}", param="domain") from None
        config = self.transformer.config
        if condition.raw_action_dim > int(config.action_dim):
            raise InvalidRequestError(
                f"domain {spec.domain!r} has {condition.raw_action_dim} action channels; this checkpoint's action head "
                f"has {config.action_dim}: pick an embodiment it was trained on",
                param="domain",
            )
        # The tier's canvas: the request's size, as the pipeline sizes an action run.
        pixels, image_size, height, width = diffusers_private.prepare_action_video_conditioning(
            self.pipe, list(spec.frames), spec.resolution_tier, spec.chunk_size + 1, device=self.device, dtype=torch.float32
        )
        request = attrs.evolve(request, width=int(width), height=int(height), num_frames=spec.chunk_size + 1)
        return request, Conditioning(pixels, image_size, raw_dim=int(condition.raw_action_dim))

    def _new_state(
        self, request: Request, cond_ids: list[int], uncond_ids: list[int], seed: int, conditioning: Conditioning | None = None
    ) -> SampleState:
        from diffusers.utils.torch_utils import randn_tensor

        pipe = self.pipe
        generator = torch.Generator(device="cpu").manual_seed(seed)
        height, width = request.height, request.width
        if conditioning is not None:  # the latent keeps only the content, not the canvas padding
            height, width = int(conditioning.image_size[2]), int(conditioning.image_size[3])
        latent_shape = (
            1,
            int(self.transformer.config.latent_channel),
            (request.num_frames - 1) // self.sf_temporal + 1,
            max(height // self.sf_spatial, 1),
            max(width // self.sf_spatial, 1),
        )
        actions = None
        if conditioning is not None:
            # The noise is drawn in `start`, once the conditioning frames are encoded.
            latents = torch.zeros(latent_shape, device=self.device)
            actions = self._new_actions(request, latent_shape[2], conditioning, generator)
        else:
            # The pipeline mixes the (all-zero) conditioning with the noise under an all-zero mask:
            # for text-to-image/video that is the noise itself.
            latents = randn_tensor(latent_shape, generator=generator, device=self.device, dtype=torch.float32)
        sound = None
        if request.sound:
            # The tokenizer's hop (its documented default: the product of its decoder strides).
            tokenizer_config = pipe.sound_tokenizer.config
            hop_size = tokenizer_config.hop_size
            hop = int(hop_size) if hop_size is not None else math.prod(tokenizer_config.dec_strides)
            samples = int(request.num_frames / request.fps * pipe.sound_tokenizer.config.sampling_rate)
            sound_shape = (int(self.transformer.config.sound_dim), (samples + hop - 1) // hop)
            sound = randn_tensor(sound_shape, generator=generator, device=self.device, dtype=torch.float32)
        scheduler = copy.deepcopy(pipe.scheduler)
        if pipe.config.use_native_flow_schedule:
            sigmas = np.linspace(1.0 - 1.0 / scheduler.config.num_train_timesteps, 0.0, request.num_inference_steps + 1)[:-1]
            scheduler.set_timesteps(request.num_inference_steps, device=self.device, sigmas=sigmas)
        else:
            scheduler.set_timesteps(request.num_inference_steps, device=self.device)
        branches = [cond_ids] + ([uncond_ids] if request.guidance_scale != 1.0 else [])
        action_len = actions.length if actions is not None else 0
        rows = [
            build_row(self.transformer.config, ids, latent_shape, sound, request.fps, self.patch, self.sf_temporal, self.device, action_len)
            for ids in branches
        ]
        if actions is not None:
            actions.scheduler = copy.deepcopy(scheduler)
        return SampleState(
            request=request,
            rows=rows,
            latents=latents,
            scheduler=scheduler,
            sound_latents=sound,
            sound_scheduler=copy.deepcopy(scheduler) if sound is not None else None,
            actions=actions,
        )

    def _new_actions(self, request: Request, latent_t: int, conditioning: Conditioning, generator: torch.Generator) -> Actions:
        spec = request.action
        noisy = torch.ones(latent_t, device=self.device)
        if request.task == "policy":
            noisy[0] = 0.0  # the first frame is given
        else:  # inverse_dynamics: every frame is given, only the actions are generated
            noisy.zero_()
        return Actions(
            domain_id=diffusers_private.embodiment_domain_id(spec.domain),
            raw_dim=conditioning.raw_dim,
            length=spec.chunk_size,
            noisy_frames=noisy,
            conditioning=conditioning,
            generator=generator,
        )

    # -- the reasoner tower, once per request ------------------------------------------------------

    @torch.inference_mode()
    def start(self, samples: list[DiffusionSample]) -> None:
        for sample in samples:
            if sample.state.actions is not None:
                self._start_actions(sample.state)
        group_schedulers(samples)
        # This rank's guidance branches only (all of them on one device).
        rows = [row for sample in samples for branch, row in enumerate(sample.state.rows) if self.parallel.owns_branch(branch)]
        if not rows:
            return
        transformer = self.transformer
        lengths = [len(row.input_ids) for row in rows]
        n_max = max(lengths)
        ids = torch.zeros(len(rows), n_max, dtype=torch.long, device=self.device)
        positions = torch.zeros(3, len(rows), n_max, dtype=rows[0].text_positions.dtype, device=self.device)
        for i, row in enumerate(rows):
            ids[i, : lengths[i]] = torch.tensor(row.input_ids, device=self.device)
            positions[:, i, : lengths[i]] = row.text_positions
        hidden = transformer.embed_tokens(ids)
        cos, sin = transformer.rotary_emb(position_ids=positions, device=self.device, dtype=hidden.dtype)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        per_layer: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in transformer.layers:
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q = attn.norm_q(attn.to_q(normed).unflatten(-1, (attn.num_attention_heads, attn.head_dim)))
            k = attn.norm_k(attn.to_k(normed).unflatten(-1, (attn.num_key_value_heads, attn.head_dim)))
            v = attn.to_v(normed).unflatten(-1, (attn.num_key_value_heads, attn.head_dim))
            k_for_gen = attn.k_norm_und_for_gen(k) if attn.k_norm_und_for_gen is not None else k
            q, k, k_for_gen = (rope(x, cos, sin) for x in (q, k, k_for_gen))
            per_layer.append((k_for_gen, v))
            # Right padding is harmless under a causal mask: real tokens never see the padding.
            out = attention(q, k, v, causal=True)
            hidden = hidden + attn.to_out(out.transpose(1, 2).flatten(-2))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        for i, row in enumerate(rows):  # views of the batch's (small) keys: a clone each would be ~400 copies
            row.kv = [(k[i, : lengths[i]], v[i, : lengths[i]]) for k, v in per_layer]

    def _start_actions(self, state: SampleState) -> None:
        """Encode the conditioning frames (once per request) and draw the initial vision and action noise."""
        from diffusers.utils.torch_utils import randn_tensor

        actions = state.actions
        conditioning = actions.conditioning
        if conditioning.latents is None:
            conditioning.latents = self._encode_conditioning(conditioning.pixels, conditioning.image_size)
            conditioning.pixels = None
        x0 = conditioning.latents
        if tuple(x0.shape) != tuple(state.latents.shape):
            raise RuntimeError(f"conditioning latents {tuple(x0.shape)} differ from the planned {tuple(state.latents.shape)}")
        # Same draws in the same order as `Cosmos3OmniPipeline.prepare_latents`: vision, then actions.
        noise = randn_tensor(tuple(x0.shape), generator=actions.generator, device=self.device, dtype=torch.float32)
        given = (1.0 - actions.noisy_frames).view(1, 1, -1, 1, 1)
        state.latents = given * x0 + (1.0 - given) * noise
        shape = (actions.length, int(self.transformer.config.action_dim))
        latents = randn_tensor(shape, generator=actions.generator, device=self.device, dtype=torch.float32)
        latents[:, actions.raw_dim :] = 0
        actions.latents = latents

    def _encode_conditioning(self, pixels: torch.Tensor, image_size: torch.Tensor) -> torch.Tensor:
        """Normalised latents of the conditioning frames, the canvas padding cut off: what the
        pipeline's ``_encode_video`` and ``_remove_action_video_padding_from_latent`` give, from
        the VAE's public encode and config."""
        vae = self.pipe.vae
        mu = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
        mean, inv_std = self._latent_stats(mu.device, vae.dtype)
        latents = ((mu - mean) * inv_std).to(pixels.dtype).float()
        height = max(int(image_size[2].item()) // self.sf_spatial, 1)
        width = max(int(image_size[3].item()) // self.sf_spatial, 1)
        return latents[:, :, :, :height, :width].contiguous()

    def _latent_stats(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE latents' mean and inverse std ([1, C, 1, 1, 1]) from its config, computed in the
        VAE's dtype as the pipeline does when it is built, then moved to `device` / `dtype`."""
        vae = self.pipe.vae
        mean = torch.tensor(vae.config.latents_mean, dtype=vae.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=vae.dtype)
        return (
            mean.to(device=device, dtype=dtype).view(1, -1, 1, 1, 1),
            inv_std.to(device=device, dtype=dtype).view(1, -1, 1, 1, 1),
        )

    # -- one denoising step for a group ------------------------------------------------------------

    @torch.inference_mode()
    def denoise(self, samples: list[DiffusionSample]) -> None:
        transformer = self.transformer
        config = transformer.config
        states: list[SampleState] = [s.state for s in samples]
        timesteps = [s.state.scheduler.timesteps[s.step] for s in samples]
        row_sample = [i for i, st in enumerate(states) for _ in st.rows]
        rows = [row for st in states for row in st.rows]

        # Generator-tower input per sample (identical for its guidance branches).
        latents = torch.cat([st.latents for st in states]).to(self.dtype)  # [S, C, T, h, w]
        tokens = transformer.proj_in(patchify(latents, self.patch))
        time_dtype = next(transformer.time_embedder.parameters()).dtype
        # One stacked tensor, not .item() per sample: each .item() would wait for the GPU.
        scaled = torch.stack([torch.as_tensor(t, device=self.device) for t in timesteps]).float() * config.timestep_scale
        temb = transformer.time_embedder(transformer.time_proj(scaled).to(time_dtype)).to(tokens.dtype)[:, None]
        has_actions = states[0].actions is not None
        if has_actions:
            # Conditioning frames get no timestep embedding (the pipeline adds it to noisy frames only).
            per_frame = tokens.shape[1] // latents.shape[2]
            noisy = torch.stack([st.actions.noisy_frames for st in states]).repeat_interleave(per_frame, dim=1)
            parts = [tokens + temb * noisy[:, :, None].to(tokens.dtype)]
        else:
            parts = [tokens + temb]
        if states[0].sound_latents is not None:
            sound = torch.stack([st.sound_latents for st in states]).transpose(1, 2).to(tokens.dtype)
            parts.append(transformer.audio_proj_in(sound) + transformer.audio_modality_embed + temb)
        num_vision = tokens.shape[1]
        num_sound = parts[1].shape[1] if len(parts) > 1 else 0
        if has_actions:
            domains = torch.tensor([st.actions.domain_id for st in states], device=self.device)
            action_in = torch.stack([st.actions.latents for st in states]).to(tokens.dtype)  # [S, Ta, D]
            # Every action token is generated in these tasks, so every one gets the timestep embedding.
            parts.append(transformer.action_proj_in(action_in, domains) + transformer.action_modality_embed + temb)
        inputs = torch.cat(parts, dim=1)  # [S, M, H]
        num_tokens = inputs.shape[1]

        # This rank's rows (all of them on one device); each row's tokens, or under Ulysses this
        # rank's share of them.
        parallel = self.parallel
        local = [i for i in range(len(rows)) if parallel.owns_branch(row_branch(row_sample, i))]
        local_sample = [row_sample[i] for i in local]
        preds_vision = preds_sound = preds_action = None
        if local:
            gen = parallel.shard(inputs.index_select(0, diffusion_cache.device_rows(local_sample, self.device)), 1)  # [B, M/U, H]
            context = self._context(samples[0].batch_key, [rows[i] for i in local], num_tokens, gen.dtype)
            cache_rows = [(samples[row_sample[i]].cache, row_branch(row_sample, i)) for i in local]
            if any(state is not None for state, _ in cache_rows):
                gen = self._cached_stack(gen, context, cache_rows, samples, local_sample, num_tokens)
            else:
                def stack(x: torch.Tensor) -> torch.Tensor:
                    for index, layer in enumerate(transformer.layers):
                        x = generator_layer(layer, x, context, index, self.kernels)
                    return x

                if self.graphs is not None:  # the context's tensors stay put while it is the group's
                    gen = self.graphs.run((samples[0].batch_key, id(context)), stack, gen, keepalive=context)
                else:
                    gen = stack(gen)
            gen = transformer.norm_moe_gen(parallel.gather(gen, num_tokens))

            preds_vision = unpatchify(transformer.proj_out(gen[:, :num_vision]), latents.shape[1:], self.patch)
            if states[0].sound_latents is not None:
                preds_sound = transformer.audio_proj_out(gen[:, num_vision : num_vision + num_sound]).transpose(1, 2)  # [B, Cs, Ts]
            if has_actions:
                # Conditioning frames have no velocity (the pipeline predicts only the noisy ones).
                preds_vision = preds_vision * noisy_frames_rows(states, local_sample).to(preds_vision.dtype)
                preds_action = transformer.action_proj_out(gen[:, num_vision + num_sound :], domains[local_sample])  # [B, Ta, D]
        if parallel.cfg > 1:  # every rank gets every row's prediction (float32, as the guidance reads them)
            preds_vision = parallel.combine_rows(float_rows(preds_vision, latents.shape[1:], self.device), local, len(rows))
            if states[0].sound_latents is not None:
                preds_sound = parallel.combine_rows(float_rows(preds_sound, states[0].sound_latents.shape, self.device), local, len(rows))
            if has_actions:
                preds_action = parallel.combine_rows(float_rows(preds_action, states[0].actions.latents.shape, self.device), local, len(rows))

        first = 0
        grouped: dict[int, tuple[SchedulerGroup, Any, int, dict[int, torch.Tensor]]] = {}
        for sample, state, t in zip(samples, states, timesteps):
            count = len(state.rows)
            velocity = guided(preds_vision[first : first + count].float(), state.request.guidance_scale)
            if state.group is not None:
                entry = grouped.setdefault(id(state.group), (state.group, t, sample.step, {}))
                if entry[2] != sample.step:
                    raise RuntimeError(f"scheduler group out of step: {entry[2]} and {sample.step}")
                entry[3][id(state)] = velocity
            else:
                latents = state.latents.unsqueeze(0)
                state.latents = scheduler_step(state.scheduler, velocity.unsqueeze(0).unsqueeze(0), t, latents).squeeze(0)
            if preds_sound is not None:
                velocity = guided(preds_sound[first : first + count].float(), state.request.guidance_scale)
                sound = state.sound_latents.unsqueeze(0)
                state.sound_latents = scheduler_step(state.sound_scheduler, velocity.unsqueeze(0), t, sound).squeeze(0)
            if preds_action is not None:
                actions = state.actions
                velocity = preds_action[first : first + count].float()
                velocity[:, :, actions.raw_dim :] = 0
                velocity = guided(velocity, state.request.guidance_scale)
                actions.latents = scheduler_step(actions.scheduler, velocity.unsqueeze(0), t, actions.latents.unsqueeze(0)).squeeze(0)
                actions.latents[:, actions.raw_dim :] = 0
            first += count
        for group, t, _, velocities in grouped.values():
            group_step(group, t, velocities)

    def _context(self, key: Any, rows: list[Row], num_tokens: int, dtype: torch.dtype) -> "Context":
        """The group's attention context, reused while the group's rows stay the same."""
        cached = self._contexts.get(key)
        if cached is not None and len(cached[0]) == len(rows) and all(a is b for a, b in zip(cached[0], rows)):
            self._contexts.move_to_end(key)
            return cached[1]
        positions = torch.stack([row.gen_positions for row in rows], dim=1)  # [3, B, M]
        cos, sin = self.transformer.rotary_emb(position_ids=positions, device=self.device, dtype=dtype)
        parallel = self.parallel
        context = Context.build(rows, cos.unsqueeze(2), sin.unsqueeze(2), parallel.padded(num_tokens), self.device)
        context = context.for_ranks(parallel, num_tokens, self.transformer.layers[0].self_attn.num_attention_heads)
        self._contexts[key] = (list(rows), context)
        while len(self._contexts) > 4:  # groups of other shapes that have finished
            self._contexts.popitem(last=False)
        return context

    def _cached_stack(
        self, gen: torch.Tensor, context: "Context", cache_rows: list, samples: list[DiffusionSample], row_sample: list[int],
        num_tokens: int,
    ) -> torch.Tensor:
        """First-block caching: run block 0 everywhere, the rest only on rows whose input changed enough.

        Under Ulysses every rank measures its share of the tokens (the padding left out) and the
        ranks add their sums, so they all take the same decisions."""
        layers = list(self.transformer.layers)
        before = gen
        gen = generator_layer(layers[0], gen, context, 0, self.kernels)
        signal = gen - before
        parallel = self.parallel
        sums = None
        if parallel.ulysses > 1:
            share = gen.shape[1]
            real = max(0, min(share, num_tokens - parallel.ulysses_rank * share))
            if real < share:
                signal = signal.clone()
                signal[:, real:] = 0
            sums = parallel.sum_over_tokens
        steps = [samples[i].step for i in row_sample]
        totals = [samples[i].total_steps for i in row_sample]
        compute = diffusion_cache.decide(cache_rows, signal, steps, totals, sums)

        def rest(index: list[int], rows: torch.Tensor) -> torch.Tensor:
            sub, hidden = context.select(index), gen.index_select(0, rows)
            for layer_index, layer in enumerate(layers[1:], start=1):
                hidden = generator_layer(layer, hidden, sub, layer_index, self.kernels)
            return hidden

        return diffusion_cache.finish_rows(cache_rows, gen, signal, compute, rest)

    # -- decoding --------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, samples: list[DiffusionSample]) -> list[dict[str, Any]]:
        pipe = self.pipe
        vae_dtype = pipe.vae.dtype
        latents = torch.cat([s.state.latents for s in samples])
        mean, inv_std = self._latent_stats(latents.device, vae_dtype)
        decoded = self.vae_decode(latents.to(vae_dtype) / inv_std + mean).to(latents.dtype)
        frames = pipe.video_processor.postprocess_video(decoded, output_type="pt")  # [S, T, 3, H, W] in [0, 1]
        # The pipeline's rounding of its float32 frames to 8 bits, done where the frames are: the same
        # float32 operations, then a copy of a quarter of the bytes and no passes of numpy over them.
        videos = (frames * 255.0).round().clamp(0, 255).to(torch.uint8).permute(0, 1, 3, 4, 2).cpu().numpy()
        payloads = []
        for sample, pixels in zip(samples, videos):
            request: Request = sample.state.request
            # (the cond row's tokens: what the request's usage counts as its prompt)
            payload: dict[str, Any] = {"task": request.task, "prompt_token_ids": list(sample.state.rows[0].input_ids)}
            if request.task == "t2i":
                payload["image"] = pixels[0]
            else:
                payload["video"] = pixels
                payload["fps"] = float(request.fps)
            actions = sample.state.actions
            if actions is not None:
                payload["actions"] = actions.latents[:, : actions.raw_dim].float().cpu().numpy()
                payload["domain"] = request.action.domain
            if sample.state.sound_latents is not None:
                waveform = pipe.decode_sound(sample.state.sound_latents).float()  # [channels, N]
                payload["audio"] = waveform.mean(dim=0).cpu().numpy().astype(np.float32)  # mono mix-down
                payload["sample_rate"] = int(pipe.sound_tokenizer.config.sampling_rate)
            payloads.append(payload)
        return payloads


__all__ = ["Cosmos3Model", "TASKS"]
