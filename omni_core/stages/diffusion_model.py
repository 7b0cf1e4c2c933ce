"""The model part of a ``diffusion`` stage: what a diffusion family implements.

A family supplies a factory ``(PartContext) -> DiffusionModel`` as the stage's ``model`` reference
(`omni_core.parts`; the subclass itself is the usual factory, its context in ``self.context``). The
`DiffusionStageRuntime` owns scheduling: it validates and admits requests, groups the running ones by
`DiffusionSample.batch_key` and calls `DiffusionModel.denoise` once per group per step, so requests
at *different* denoising steps share one forward (step batching), and decodes finished samples.
The model owns the math: its per-sample state (latents, scheduler, conditioning) lives in
`DiffusionSample.state`, and `denoise` runs ONE batched forward for the group (classifier-free
guidance branches are rows of that batch too).

torch is imported lazily: this module is imported by the core at discovery time.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import attrs

from omni_core.parts import Part

from omni_core.stages.diffusion_parallel import SINGLE, Parallel, ParallelConfig

if TYPE_CHECKING:
    from omni_core.stages.diffusion_cache import CacheState


@attrs.define(eq=False)
class DiffusionSample:
    """One sample being denoised (a request asking for ``n`` images has ``n`` samples).

    - `total_steps`: denoising steps of this sample; `step` counts those done.
    - `batch_key`: samples with equal keys can share a forward (e.g. equal latent shapes); the
      runtime never puts samples with different keys into one `denoise` call.
    - `state`: the model's private per-sample state.
    - `cache`: cache-acceleration state when the request enabled it (see `diffusion_cache`).
    - `tokens`: the sequence positions the sample puts through one denoising forward (latent
      tokens of every guidance branch, and any text or conditioning rows the forward recomputes),
      what the stage's ``max_batch_tokens`` option counts; 0 when the model part does not say.
    """

    request_id: str
    index: int
    total_steps: int
    batch_key: Hashable
    state: Any = None
    step: int = 0
    cache: CacheState | None = None
    started: bool = False
    tokens: int = 0

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps


@attrs.frozen
class LoadSpec:
    """How the runtime asks a model part to load itself.

    - `quantization`: the resolved quantization spec for DiT linears (what the configured resolver
      returned, e.g. ``{"method": "int8_weight_only"}``), or ``None``.
    - `vae_tiling`: decode in spatial tiles (bounded memory for large outputs); `vae_tile` is the
      tile size in pixels (``None``: the VAE's default).
    - `compile`: compile the denoiser's layers with `torch.compile` (slower first step per shape).
    - `cuda_graphs`: replay the denoiser's forward as a CUDA graph while the batch stays the same
      (`omni_core.stages.cuda_graphs`); ignored off CUDA.
    - `parallel`: this rank's place in a replica that spans several devices and the collectives
      to split a step with (`omni_core.stages.diffusion_parallel`); `SINGLE` for one device.
    - `shared_model`: with ``share_model_with``, what the other stage's runtime offers
      (`omni_core.stages.base.StageRuntime.shared_model`, e.g. the modules its vLLM engine loaded)
      for the model part to run on instead of loading those weights again (`DiffusionModel.takes_shared_model`);
      ``None`` otherwise.
    """

    device: str
    dtype: str
    quantization: dict[str, Any] | None = None
    vae_tiling: bool = False
    vae_tile: int | None = None
    compile: bool = False
    cuda_graphs: bool = False
    parallel: Parallel = SINGLE
    shared_model: Any = None


class DiffusionModel(Part, abc.ABC):
    """What a ``diffusion`` stage's model part does.

    `max_steps` bounds a request's denoising steps (more is rejected before any work starts).
    `parallel_modes`: which of ``cfg`` and ``ulysses`` (`omni_core.stages.diffusion_parallel`) the
    model part's `denoise` implements with `LoadSpec.parallel`; the stage's ``parallel`` option may
    ask for these only. Every rank runs `prepare`, `start` and `denoise` on the same samples;
    only rank 0 runs `decode`. A model part that draws a random seed when a request gives none
    must read it from ``seed`` in the stage input's data or params: without one, the runtime draws
    a seed for all ranks and passes it as the ``seed`` parameter.
    `request_params`: the names of the per-request parameters `prepare` takes (the runtime's own
    ``cache`` is always taken); the engine refuses any other before the request starts, even where
    the stage runs after others. ``None``: not declared, `prepare` alone checks them.
    `takes_shared_model`: `load` runs on `LoadSpec.shared_model` when the stage is deployed with
    ``share_model_with`` (another stage's loaded weights); `resolve()` refuses that deploy for a
    model part that does not declare it.
    `load_options`: which of the stage's options that reach `load` through `LoadSpec` the model
    part applies: ``quantization``, ``compile``, ``cuda_graphs``, ``vae_tiling`` (with ``vae_tile``).
    `resolve()` refuses a stage that sets one it does not declare (it would be silently ignored).
    `media_params`: those of `request_params` that carry a medium (an image, a video, audio) as
    a URL. A request's own string is its data: a base64 ``data:`` URL. Over HTTP, the server
    also takes the ``file://`` and ``http(s)://`` URLs its operator allowed (vLLM's flags
    ``--allowed-local-media-path``, ``--allowed-media-domains``) and hands the stage the
    equivalent ``data:`` URL; any other is a 400 before the request starts.
    """

    max_steps: int = 1000
    parallel_modes: frozenset[str] = frozenset()
    takes_shared_model: bool = False
    load_options: frozenset[str] = frozenset()
    request_params: frozenset[str] | None = None
    media_params: frozenset[str] = frozenset()

    @classmethod
    def check_parallel(cls, config: ParallelConfig, model_path: str) -> None:
        """Refuse, with a `omni_core.errors.ConfigError`, a ``parallel`` setting this checkpoint
        cannot run (e.g. attention heads that do not split over the Ulysses ranks, `check_heads`):
        `resolve()` calls it before anything loads. The default takes every declared mode."""

    @abc.abstractmethod
    def load(self, spec: LoadSpec) -> None:
        """Load the transformer(s), VAE(s), scheduler and tokenizer; apply `spec.quantization`."""

    @abc.abstractmethod
    def prepare(self, request_id: str, data: dict[str, Any], params: dict[str, Any]) -> list[DiffusionSample]:
        """Validate a request and build its samples (no forward pass yet).

        Raise `omni_core.errors.InvalidRequestError` (naming the parameter) for anything this model
        cannot do: the runtime calls this in ``add_request``, before any work starts.
        """

    def start(self, samples: list[DiffusionSample]) -> None:
        """One-off work for newly admitted samples, batched (e.g. encoding the prompts once)."""

    @abc.abstractmethod
    def denoise(self, samples: list[DiffusionSample]) -> None:
        """Advance every sample (all share one `batch_key`) by one denoising step, with one forward.

        Samples may be at different steps. The runtime increments `DiffusionSample.step` afterwards.
        """

    @abc.abstractmethod
    def decode(self, samples: list[DiffusionSample]) -> list[dict[str, Any]]:
        """Decode finished samples (one `batch_key`) into output payloads, one per sample.

        Payload keys are the core's output keys: ``image`` (HxWx3 uint8), ``video`` (TxHxWx3
        uint8), ``fps``, ``audio`` (float32 samples), ``sample_rate``, ``actions``.
        """

    def close(self) -> None:
        """Release weights and device memory."""
