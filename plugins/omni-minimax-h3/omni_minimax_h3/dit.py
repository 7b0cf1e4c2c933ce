"""The ``dit`` stage's model part: MiniMax-H3's denoising of many requests at once, then the decode.

Per request, everything around the denoising loop is diffusers' own blocks, run through the
modular pipeline's public call (so layouts, noise draws and decodes are the library's):

- `start`: the keyframe VAE encode (fl2va), the packed layout, the conditioning and target noise
  from the request's generator (conditioning, then video, then audio: the library's order), both
  sigma schedules (video shift and audio shift, from ``scheduler/`` and ``audio_scheduler/``);
- `decode`: the after-denoise unpacking, the video VAE and the audio VAE.

The loop itself is ours: each step, every running request (whatever its step, size or duration)
goes through ONE transformer forward (`omni_minimax_h3.packed`: the requests' packed sequences
concatenated, attention per request), then each request's two schedulers step its generated rows,
as diffusers' `MiniMaxH3LoopSchedulerStep` does. The VAE encodes run here, not in the ``encoder``
stage, because this stage holds the video VAE for decoding anyway: one copy of its weights.

A replica may span devices with ``parallel: {ulysses: N}`` (`omni_core.stages.diffusion_parallel`):
each rank runs the block stack on 1/N of every request's rows (`forward_packed`). There is no
``cfg`` mode: the checkpoint is guidance-distilled (one forward per step, no unconditional branch),
so a second guidance rank would have nothing to compute.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from omni_core.errors import ConfigError, InvalidRequestError, MissingDependencyError
from omni_core.parts import PartContext
from omni_core.stages.diffusion_model import DiffusionModel, DiffusionSample, LoadSpec
from omni_core.stages.diffusion_parallel import SINGLE, ParallelConfig, check_heads
from omni_minimax_h3.loading import LOAD_LOCK
from omni_minimax_h3.packed import EAGER, BlockKernels, CacheRow, PackedInput, forward_packed, use_segmented_attention
from omni_minimax_h3.requests import MAX_STEPS, USER_PARAMS, Geometry, Request, parse_request

DIFFUSERS_REQUIREMENT = "diffusers>=0.40,<0.43"
TRANSFORMERS = ("transformer", "transformer_ref")
LAYOUT_FIELDS = ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")
KNOWN_PARAMS = USER_PARAMS | {"token_tags", "keyframes", "keyframe_anchors", "references"}  # (the input processor's own)


@attrs.define(eq=False)
class SampleState:
    """One request in the loop: the library's pipeline state after the prepare blocks, plus its schedulers."""

    request: Request
    prompt_embeds: torch.Tensor  # [1, T, text_dim]
    token_tags: torch.Tensor  # [T] the presentation's per-row modality tags
    keyframes: list[Any]  # PIL images on the canvas (fl2va), in packed order
    keyframe_anchors: tuple[str, ...]
    transformer: str
    references: list[Any] = attrs.field(factory=list)  # diffusers' reference objects (ref2va), normalized, in packed order
    values: dict[str, Any] = attrs.field(factory=dict)  # the prepared pipeline state's values
    scheduler: Any = None
    audio_scheduler: Any = None


class MiniMaxH3DiT(DiffusionModel):
    """The ``dit`` stage's model part (its own factory: ``MiniMaxH3DiT(context)``)."""

    max_steps = MAX_STEPS
    load_options = frozenset({"quantization", "compile", "vae_tiling"})  # (no CUDA graphs: the step's row count varies)
    parallel_modes = frozenset({"ulysses"})
    request_params = USER_PARAMS  # (the engine refuses any other a request sets, before the encoder runs)

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.path = Path(context.model_path)
        self.pipe: Any = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.geometry: Geometry | None = None
        self.parallel = SINGLE
        self.kernels = EAGER

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def check_parallel(cls, config: ParallelConfig, model_path: str) -> None:
        # A diffusers layout is checked here; a native partition's config is read when it loads.
        for name in TRANSFORMERS:
            path = Path(model_path) / name / "config.json"
            if config.ulysses > 1 and path.is_file():
                check_heads(config, int(json.loads(path.read_text())["num_attention_heads"]), f"{name}/config.json")

    def load(self, spec: LoadSpec) -> None:
        with LOAD_LOCK:  # diffusers' lazy imports and from_pretrained are not thread-safe (`loading`)
            self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        try:
            from diffusers import ModularPipeline
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise MissingDependencyError(f"MiniMax-H3 needs diffusers: pip install '{DIFFUSERS_REQUIREMENT}' ({exc})") from None

        from omni_minimax_h3.native import diffusers_layout

        self.path = Path(diffusers_layout(self.path))  # a native partition is read through its diffusers layout
        self.dtype = getattr(torch, spec.dtype)
        self.device = torch.device(spec.device)
        self.parallel = spec.parallel
        names = [name for name in ("vae", "audio_vae", "scheduler", "audio_scheduler", *TRANSFORMERS) if (self.path / name).is_dir()]
        pipe = ModularPipeline.from_pretrained(str(self.path))
        pipe.load_components(names=names, dtype=self.dtype)
        pipe.to(self.device)
        for name in TRANSFORMERS:
            transformer = getattr(pipe, name, None)
            if transformer is None:
                continue
            if spec.quantization is not None:
                from omni_core.quantization import quantize_linears

                quantize_linears(transformer, spec.quantization, skip=lambda n: not n.startswith("transformer_blocks."))
            use_segmented_attention(transformer)
            heads = transformer.config.num_attention_heads
            if heads % self.parallel.ulysses:
                raise ConfigError(f"{name}/ has {heads} attention heads: they do not split over {self.parallel.ulysses} Ulysses ranks")
        if spec.vae_tiling:  # tiles of `vae_tile` pixels overlapping by a quarter (the library's default: 256, 64)
            tile = spec.vae_tile
            pipe.vae.enable_tiling(tile, tile, tile and tile // 4, tile and tile // 4)
        self.pipe = pipe
        self.kernels = BlockKernels.compiled() if spec.compile else EAGER
        self.geometry = Geometry.from_checkpoint(self.path)
        pipe.set_progress_bar_config(disable=True)
        self._prepare = {task: self._blocks(task) for task in ("t2va", "fl2va", "ref2va")}
        self._reference_setup = self._blocks("ref2va_setup")
        self._finish = self._blocks("decode")

    def _blocks(self, task: str) -> Any:
        """The library's blocks for the work around the loop: `task`'s prepare steps (its core
        denoise sequence without the loop and the unpacking), or ``decode``."""
        from diffusers.modular_pipelines import SequentialPipelineBlocks
        from diffusers.modular_pipelines.minimax_h3 import modular_blocks_minimax_h3 as library
        from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep, MiniMaxH3Ref2VAReferenceEncoderStep

        if task == "ref2va_setup":  # (run at `prepare`: the references' sizes give the request's rows)
            return SequentialPipelineBlocks.from_blocks_dict({"setup": MiniMaxH3Ref2VASetupStep()})
        if task == "decode":
            return SequentialPipelineBlocks.from_blocks_dict(
                {"after_denoise": library.MiniMaxH3AfterDenoiseStep(), "decode": library.MiniMaxH3DecodeStep()}
            )
        cores = {"t2va": library.MiniMaxH3CoreDenoiseStep, "fl2va": library.MiniMaxH3FL2VACoreDenoiseStep, "ref2va": library.MiniMaxH3Ref2VACoreDenoiseStep}
        blocks = {name: block for name, block in cores[task]().sub_blocks.items() if name not in ("denoise", "after_denoise")}
        if task == "fl2va":
            blocks = {"vae_encoder": MiniMaxH3KeyframeVaeEncoderStep(), **blocks}
        elif task == "ref2va":  # the references, already on the model's rates and sizes (``ref2va_setup``), encoded
            blocks = {"vae_encoder": MiniMaxH3Ref2VAReferenceEncoderStep(), **blocks}
        return SequentialPipelineBlocks.from_blocks_dict(blocks)

    def _run(self, blocks: Any, **inputs: Any) -> Any:
        """Run `blocks` on the loaded pipeline's components, as `ModularPipeline.__call__` runs its
        own blocks (inputs not given take the blocks' defaults); returns the `PipelineState`.

        The loaded pipeline holds every component, so the pipeline's facts (latent channels, VAE
        chunking, patch size: properties that read the VAEs and the transformer) are the checkpoint's.
        """
        from diffusers.modular_pipelines import PipelineState

        state = PipelineState()
        for param in blocks.inputs:
            if param.name is None:
                continue
            state.set(param.name, inputs[param.name] if param.name in inputs else param.default, param.kwargs_type)
        _, state = blocks(self.pipe, state)
        return state

    def close(self) -> None:
        self.pipe = None

    # -- requests --------------------------------------------------------------------------------

    def prepare(self, request_id: str, data: dict[str, Any], params: dict[str, Any]) -> list[DiffusionSample]:
        unknown = sorted(set(params) - KNOWN_PARAMS)
        if unknown:
            raise InvalidRequestError(f"unknown MiniMax-H3 parameters {unknown}; known: {sorted(KNOWN_PARAMS | {'cache'})}", param=unknown[0])
        embeds = data.get("prompt_embeds")
        if embeds is None:
            raise InvalidRequestError("the dit stage needs prompt_embeds (the encoder stage's output)", param="prompt_embeds")
        keyframes = list(params.get("keyframes") or ())
        references = list(params.get("references") or ())
        default_size = keyframes[0].size if keyframes else None
        request = parse_request(params, self.geometry, default_size=default_size)
        transformer = "transformer_ref" if references else "transformer"
        if getattr(self.pipe, transformer, None) is None:  # (before any work on the references or the embeddings)
            raise InvalidRequestError(f"this checkpoint has no {transformer}/ for {'ref2va' if references else 't2va/fl2va'}", param="references")
        if references:
            references = self._normalized_references(request, references)
        prompt_embeds = torch.as_tensor(np.asarray(embeds) if not isinstance(embeds, torch.Tensor) else embeds)
        if prompt_embeds.ndim == 2:
            prompt_embeds = prompt_embeds[None]
        tags = params.get("token_tags")
        tags = torch.full((prompt_embeds.shape[1],), int(self.pipe.text_tag), dtype=torch.long) if tags is None else torch.as_tensor(tags, dtype=torch.long)
        if tags.shape != (prompt_embeds.shape[1],):
            raise InvalidRequestError(f"token_tags has {tags.shape[0]} rows for {prompt_embeds.shape[1]} prompt rows", param="token_tags")
        state = SampleState(
            request=request,
            prompt_embeds=prompt_embeds.to(self.device),
            token_tags=tags,
            keyframes=keyframes,
            keyframe_anchors=tuple(params.get("keyframe_anchors") or ()),
            transformer=transformer,
            references=references,
        )
        schedule = copy.deepcopy(self.pipe.scheduler)
        schedule.set_timesteps(request.num_inference_steps)
        tokens = self._tokens(request, int(prompt_embeds.shape[1]), len(keyframes), references)
        return [DiffusionSample(request_id, 0, int(schedule.timesteps.numel()), state.transformer, state, tokens=tokens)]

    def _normalized_references(self, request: Request, references: list[Any]) -> list[Any]:
        """The library's ref2va setup: its checks, and the references on the model's sizes and rates (an
        image at its own ``reference_image_short_edge``, a soundtrack resampled and cut to the video)."""
        inputs = {"references": references, "height": request.height, "width": request.width, "num_frames": request.num_frames}
        try:
            return list(self._run(self._reference_setup, **inputs).get("normalized_references"))
        except (ImportError, ValueError) as exc:  # (resampling a soundtrack needs torchaudio)
            raise InvalidRequestError(f"{exc}", param="references") from None

    def _tokens(self, request: Request, text_rows: int, keyframes: int, references: list[Any]) -> int:
        """The rows of one forward (the library's packed layout): text, each reference's (an image's
        patches at its own size, a soundtrack's audio latents of each channel), the keyframes' and the
        generated video latents' patches, the generated audio latents of each channel."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            audio_latent_num_frames,
            video_latent_num_frames,
        )

        g = self.geometry
        frames = video_latent_num_frames(request.num_frames, g.frames_per_chunk, g.latents_per_chunk) + keyframes
        patches = (request.height // g.canvas_multiple) * (request.width // g.canvas_multiple)
        rows = text_rows + frames * patches + audio_latent_num_frames(request.num_frames) * int(self.pipe.audio_channels)
        hop = int(self.pipe.audio_vae.hop_length)  # (its encoder pads a waveform to a multiple of it)
        for reference in references:
            if reference.kind == "image":
                width, height = reference.image.size
                rows += (height // g.canvas_multiple) * (width // g.canvas_multiple)
            if reference.has_audio:
                rows += int(reference.audio.shape[0]) * -(-int(reference.audio.shape[-1]) // hop)
        return rows

    def start(self, samples: list[DiffusionSample]) -> None:
        for sample in samples:
            self.prepare_state(sample.state)

    @torch.inference_mode()
    def prepare_state(self, state: SampleState, latents: torch.Tensor | None = None, audio_latents: torch.Tensor | None = None) -> None:
        """Run the library's prepare blocks for one request (given `latents`/`audio_latents`, as
        the pipeline's own inputs, the matching noise draws are skipped)."""
        request = state.request
        task = "ref2va" if state.references else "fl2va" if state.keyframes else "t2va"
        seed = request.seed if request.seed is not None else random.randrange(2**31)
        inputs: dict[str, Any] = {
            "prompt_embeds": state.prompt_embeds,
            "text_token_tags": state.token_tags,
            "height": request.height,
            "width": request.width,
            "num_frames": request.num_frames,
            "num_inference_steps": request.num_inference_steps,
            "generator": torch.Generator().manual_seed(seed),
            "latents": latents,
            "audio_latents": audio_latents,
        }
        if state.keyframes:
            inputs.update(keyframes=state.keyframes, keyframe_anchors=state.keyframe_anchors)
        if state.references:
            inputs["normalized_references"] = state.references
        prepared = self._run(self._prepare[task], **inputs)
        state.values = dict(prepared.values)
        # Each request steps its own copies (set by the blocks just now): the schedulers count their steps.
        state.scheduler = copy.deepcopy(self.pipe.scheduler)
        state.audio_scheduler = copy.deepcopy(self.pipe.audio_scheduler)

    # -- one step for every running request -------------------------------------------------------

    @torch.inference_mode()
    def denoise(self, samples: list[DiffusionSample]) -> None:
        transformer = getattr(self.pipe, samples[0].batch_key)
        inputs = [self._packed_input(sample.state, sample.step) for sample in samples]
        caches = [CacheRow(s.cache, s.step, s.total_steps) if s.cache is not None else None for s in samples]
        outputs = forward_packed(transformer, inputs, caches, self.parallel, self.kernels)
        for sample, (video, audio) in zip(samples, outputs):
            self._scheduler_step(sample.state, sample.step, video, audio)

    def _packed_input(self, state: SampleState, step: int) -> PackedInput:
        values = state.values
        timestep, timestep_indices = values["row_timestep_plan"][step]
        return PackedInput(
            hidden_states=values["latents"],
            audio_hidden_states=values["audio_latents"],
            encoder_hidden_states=state.prompt_embeds[0],
            timestep=timestep,
            timestep_indices=timestep_indices,
            **{name: values[name] for name in LAYOUT_FIELDS},
        )

    @staticmethod
    def _scheduler_step(state: SampleState, step: int, video: torch.Tensor, audio: torch.Tensor) -> None:
        """`MiniMaxH3LoopSchedulerStep`: only the generated rows move; the conditioning rows stay."""
        values = state.values
        video_rows, audio_rows = values.get("num_condition_video_rows", 0), values.get("num_condition_audio_rows", 0)
        latents, audio_latents = values["latents"], values["audio_latents"]
        latents[video_rows:] = state.scheduler.step(video[video_rows:].float(), values["timesteps"][step], latents[video_rows:], return_dict=False)[0]
        audio_latents[audio_rows:] = state.audio_scheduler.step(
            audio[audio_rows:].float(), values["audio_timesteps"][step], audio_latents[audio_rows:], return_dict=False
        )[0]

    # -- decoding --------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode_tensors(self, state: SampleState) -> dict[str, Any]:
        """The library's unpacking and decodes: ``videos`` [1, T, 3, H, W] in [0, 1], ``audio`` [1, 2, N]."""
        values = state.values
        names = ("latents", "audio_latents", "num_condition_video_rows", "num_condition_audio_rows",
                 "num_latent_frames", "latent_height", "latent_width", "num_audio_latents")
        state = self._run(self._finish, **{name: values.get(name) for name in names}, output_type="pt")
        return state.get(["videos", "audio", "sampling_rate"])

    def decode(self, samples: list[DiffusionSample]) -> list[dict[str, Any]]:
        payloads = []
        for sample in samples:
            out = self.decode_tensors(sample.state)
            video = (out["videos"][0].permute(0, 2, 3, 1).float() * 255.0).round().clamp(0, 255).to(torch.uint8)
            payloads.append({
                "video": video.cpu().numpy(),
                "fps": float(self.geometry.fps),
                "audio": out["audio"][0].float().transpose(0, 1).contiguous().cpu().numpy(),  # [N, channels]
                "sample_rate": int(out["sampling_rate"]),
            })
        return payloads
