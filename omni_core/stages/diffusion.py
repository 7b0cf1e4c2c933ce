"""The ``diffusion`` stage runtime: batched denoising with step batching and cache acceleration.

Requests are validated by the model part when they arrive (`DiffusionModel.prepare`) and wait in
an admission queue. Each `step()` admits waiting samples while fewer than `max_num_seqs` are
running and their tokens fit `max_batch_tokens` (after a short admission window when the stage is
idle, so requests arriving together start together), groups the running samples by their
`batch_key` and runs ONE denoising step for every group, each sample at its own step: a new
request joins a running batch at its step 0 (step batching). Finished samples are decoded (batched
per key) and their request gets one final chunk; with streaming on, every step also emits a
non-final ``progress`` chunk per request. Aborting a request between steps frees its slots for the
next step.

With the ``parallel`` option a replica spans several devices (`omni_core.stages.diffusion_parallel`):
this runtime is rank 0 and repeats each of its model part calls on the other ranks first.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any, Callable

import attrs

from omni_core.config.modelref import resolve_dtype
from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.errors import ConfigError, InvalidRequestError, StageError
from omni_core.outputs import Chunk, StageInput
from omni_core.stages.base import Dtype, ProgressCallback, StageRuntime, device_option, dtype_option, refuse_unapplied_options
from omni_core.stages.diffusion_cache import CACHE_MODES, CacheConfig, CacheState, resolve_cache
from omni_core.stages.diffusion_model import DiffusionModel, DiffusionSample, LoadSpec
from omni_core.stages.diffusion_parallel import ParallelConfig, RankGroup, check_parallel, rank_devices, sample_keys

BATCH_SIZES_KEPT = 1024


@attrs.frozen
class DiffusionOptions:
    """Deploy options of a ``diffusion`` stage.

    Each field's ``metadata["doc"]`` documents it (`omni stages diffusion`, ``docs/stage-options.md``).
    """

    max_num_seqs: int = attrs.field(
        default=8,
        validator=attrs.validators.ge(1),
        metadata={"doc": "Most samples denoised at once (a request with ``n`` images counts ``n``)."},
    )
    max_batch_tokens: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.ge(1)),
        metadata={
            "doc": "Most tokens (the sequence positions of every guidance branch, as the model part counts them) in "
            "one denoising step: waiting requests start, in arrival order, while the running ones leave room (one "
            "always runs). Where one request already fills the device, batching more makes each wait for all at "
            "the same throughput; with this budget they finish one after another, as if served alone. ``None``: no "
            "limit but `max_num_seqs`."
        },
    )
    admission_window_ms: float = attrs.field(
        default=5.0,
        validator=attrs.validators.ge(0),
        metadata={"doc": "When the stage is idle, how long the first request waits for others to start with it (0: never)."},
    )
    dtype: Dtype = dtype_option()
    device: str | None = device_option()
    quantization: str | None = attrs.field(
        default=None,
        metadata={
            "doc": "A registered quantization resolver (``int8`` for CPU, ``fp8`` for GPU, ...; `omni plugins` lists "
            "them) applied to the DiT linears; ``None``: not quantized."
        },
    )
    cache: str = attrs.field(
        default="none",
        validator=attrs.validators.in_(CACHE_MODES),
        metadata={
            "doc": "Default cache acceleration: ``none``, or ``first_block`` (skip the remaining blocks while the first "
            "block's output barely changes); a request may override it, `cache_threshold` and `cache_warmup_steps` "
            "with its ``cache`` parameter."
        },
    )
    cache_threshold: float = attrs.field(
        default=0.1,
        validator=attrs.validators.ge(0),
        metadata={
            "doc": "With the cache on: how much the first block's output may change (relative L1, accumulated since "
            "the last full step) before the whole stack runs again; 0 never skips."
        },
    )
    cache_warmup_steps: int = attrs.field(
        default=1,
        validator=attrs.validators.ge(0),
        metadata={"doc": "With the cache on: the first steps, which always run the whole stack (the last step does too)."},
    )
    vae_tiling: bool = attrs.field(
        default=False, metadata={"doc": "Decode in spatial tiles of `vae_tile` pixels (bounded memory for large outputs)."}
    )
    vae_tile: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.ge(16)),
        metadata={"doc": "The tile size in pixels with `vae_tiling` (``None``: the VAE's default)."},
    )
    progress: bool = attrs.field(
        default=True,
        metadata={
            "doc": "Emit a ``progress`` chunk per request per step (when streaming); off, only the first one, which "
            "says the request started (a video job's ``in_progress``)."
        },
    )
    compile: bool = attrs.field(
        default=False,
        metadata={
            "doc": "Compile the denoiser with `torch.compile` (the first step of each new batch shape compiles, later "
            "ones run fused kernels); off by default, like diffusers."
        },
    )
    cuda_graphs: bool = attrs.field(
        default=False,
        metadata={
            "doc": "On CUDA, replay a step's denoiser forward as a CUDA graph while the batch composition stays the "
            "same (recorded at its second step): a small model's step is otherwise bound by launching its kernels. "
            "Steps with the cache on stay eager. Ignored on CPU."
        },
    )
    parallel: ParallelConfig = attrs.field(
        factory=ParallelConfig,
        metadata={
            "doc": "Span each replica over ``cfg * ulysses`` devices (the stage's `devices`, else the first visible "
            "GPUs, else as many CPU processes talking over gloo): ``cfg: 2`` computes the conditional and "
            "unconditional guidance branches on different devices, ``ulysses: N`` splits the image/video tokens "
            "over N devices (all-to-all around attention). The model part must support the mode; the replica "
            "runs in a process and restarts as a whole when one of its ranks dies."
        },
    )


@attrs.define
class _Request:
    samples: list[DiffusionSample]
    outputs: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    chunks: int = 0  # sent so far (progress chunks until the final one)


# The options `load` receives through `LoadSpec` and when a stage sets them (`DiffusionModel.load_options`).
_LOAD_OPTIONS: dict[str, Callable[[DiffusionOptions], bool]] = {
    "quantization": lambda options: options.quantization is not None,
    "compile": lambda options: options.compile,
    "cuda_graphs": lambda options: options.cuda_graphs,
    "vae_tiling": lambda options: options.vae_tiling or options.vae_tile is not None,
}


class DiffusionStageRuntime(StageRuntime):
    """Runs a `DiffusionModel` over many requests at once (kind ``diffusion``)."""

    Options = DiffusionOptions
    options: DiffusionOptions

    @classmethod
    def check_resolved(cls, stage: ResolvedStage, options: DiffusionOptions, model_path: str) -> None:
        from omni_core.refs import load_ref

        refuse_unapplied_options(stage, [name for name, is_set in _LOAD_OPTIONS.items() if is_set(options)])
        if stage.share_model_with is not None:
            if options.parallel.world_size > 1:
                raise ConfigError(
                    f"stage {stage.name!r}: share_model_with runs on another stage's model in this process; it cannot "
                    "span ranks (parallel)",
                    key=f"stages.{stage.name}.share_model_with",
                )
            if not getattr(load_ref(stage.model), "takes_shared_model", False):
                raise ConfigError(
                    f"stage {stage.name!r}: its model part ({stage.model}) loads its own weights; it does not run on "
                    f"another stage's model (share_model_with)",
                    key=f"stages.{stage.name}.share_model_with",
                )
        if options.parallel.world_size == 1:
            return
        part = load_ref(stage.model)
        key = f"stages.{stage.name}.options.parallel"
        check_parallel(options.parallel, stage, getattr(part, "parallel_modes", frozenset()), key=key)
        try:
            part.check_parallel(options.parallel, model_path)  # `DiffusionModel.check_parallel`
        except ConfigError as exc:
            raise ConfigError(exc.message, key=key) from None
        if options.cuda_graphs:
            raise ConfigError(
                f"stage {stage.name!r}: cuda_graphs do not combine with parallel (its collectives run outside a graph)",
                key=f"stages.{stage.name}.options.cuda_graphs",
            )

    def __init__(self, pipeline: ResolvedPipeline, stage: ResolvedStage, replica: int = 0) -> None:
        super().__init__(pipeline, stage, replica)
        self.model: DiffusionModel | None = None
        self.ranks: RankGroup | None = None  # the other ranks, with the `parallel` option
        self.cache_default = CacheConfig(
            mode=self.options.cache, threshold=self.options.cache_threshold, warmup_steps=self.options.cache_warmup_steps  # type: ignore[arg-type]
        )
        self._requests: dict[str, _Request] = {}
        self._waiting: OrderedDict[int, DiffusionSample] = OrderedDict()  # id(sample) -> sample, arrival order
        self._running: list[DiffusionSample] = []
        self._idle_since: float | None = None
        # Samples per forward, for tests and benchmarks: the last BATCH_SIZES_KEPT or more (a
        # server runs for weeks: an ever-growing list was a leak).
        self.batch_sizes: list[int] = []

    # -- lifecycle -------------------------------------------------------------------------------

    def load(self, progress: ProgressCallback | None = None) -> None:
        model = self.build_model_part(DiffusionModel)
        if progress is not None:
            progress(f"loading {self.stage.name}", 0.0)
        spec = LoadSpec(
            device=self.device(),
            dtype=resolve_dtype(self.options.dtype, self.pipeline.model_path),
            quantization=self.quantization(),
            vae_tiling=self.options.vae_tiling,
            vae_tile=self.options.vae_tile,
            compile=self.options.compile,
            cuda_graphs=self.options.cuda_graphs,
            shared_model=self.shared,
        )
        parallel = self.options.parallel
        if parallel.world_size > 1:
            explicit = getattr(self.options, "device", None)
            devices = rank_devices(self.stage.devices, parallel.world_size, cuda=spec.device.startswith("cuda"))
            if explicit is not None:
                devices[0] = spec.device
            if progress is not None:
                progress(f"starting {parallel.world_size} ranks ({', '.join(parallel.modes)}) on {', '.join(devices)}", 0.0)
            shared = {k: v for k, v in attrs.asdict(spec, recurse=False).items() if k not in ("device", "parallel")}
            self.ranks = RankGroup(self.pipeline, self.stage, self.replica, parallel, devices, shared)
            spec = attrs.evolve(spec, device=devices[0], parallel=self.ranks.parallel)
        model.load(spec)
        self.model = model
        if progress is not None:
            progress(f"loaded {self.stage.name}", 1.0)

    def close(self) -> None:
        self._requests.clear()
        self._waiting.clear()
        self._running.clear()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        if self.model is not None:
            self.model.close()
            self.model = None

    def health_stats(self) -> dict[str, Any]:
        if self.ranks is None:
            return {}
        return {"ranks": self.ranks.describe()}

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, stage_input: StageInput) -> None:
        model = self._loaded()
        if request_id in self._requests:
            raise InvalidRequestError(f"request {request_id!r} is already running in stage {self.stage.name!r}")
        if not stage_input.final:
            raise InvalidRequestError(f"stage {self.stage.name!r} takes its whole input at once (final=True)")
        params = dict(stage_input.params)
        cache = resolve_cache(self.cache_default, params.pop("cache", None))
        takes_seed = model.request_params is None or "seed" in model.request_params
        if self.ranks is not None and takes_seed and params.get("seed") is None and stage_input.data.get("seed") is None:
            params["seed"] = random.randrange(2**31)  # one seed for every rank (DiffusionModel.parallel_modes)
        samples = model.prepare(request_id, dict(stage_input.data), dict(params))
        if not samples:
            raise StageError(self.stage.name, f"model part prepared no samples for request {request_id!r}")
        for sample in samples:
            if not 1 <= sample.total_steps <= model.max_steps:
                raise InvalidRequestError(
                    f"num_inference_steps must be between 1 and {model.max_steps}, got {sample.total_steps}",
                    param="num_inference_steps",
                )
            sample.cache = CacheState(cache) if cache.enabled else None
        if self.ranks is not None:
            self.ranks.send("prepare", request_id, dict(stage_input.data), params, cache)
        self._requests[request_id] = _Request(samples)
        for sample in samples:
            self._waiting[id(sample)] = sample

    def abort_request(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for sample in request.samples:
            self._waiting.pop(id(sample), None)
        self._running = [s for s in self._running if s.request_id != request_id]
        if self.ranks is not None:
            self.ranks.send("drop", [request_id])

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # -- stepping --------------------------------------------------------------------------------

    def step(self) -> list[Chunk]:
        try:
            return self._step()
        except Exception as exc:
            if self.ranks is not None:
                self.ranks.check(exc)
            raise

    def _step(self) -> list[Chunk]:
        model = self._loaded()
        if not self._admit():
            return []
        groups: dict[Any, list[DiffusionSample]] = {}
        for sample in self._running:
            groups.setdefault(sample.batch_key, []).append(sample)
        for group in groups.values():
            self.batch_sizes.append(len(group))
            if len(self.batch_sizes) > 2 * BATCH_SIZES_KEPT:
                del self.batch_sizes[:-BATCH_SIZES_KEPT]
            if self.ranks is not None:
                self.ranks.send("denoise", sample_keys(group))
            model.denoise(group)
            for sample in group:
                sample.step += 1
        return self._emit()

    def _admit(self) -> bool:
        """Move waiting samples into the running batch; False to wait a bit longer for company."""
        free = self.options.max_num_seqs - len(self._running)
        budget = self.options.max_batch_tokens
        room = budget is None or sum(s.tokens for s in self._waiting.values()) < budget
        if not self._running and self._waiting and len(self._waiting) < free and room:
            # Idle stage: give requests sent together a moment to arrive, so they share every step
            # (while they leave room: a budget they already fill starts the first at once).
            now = time.monotonic()
            if self._idle_since is None:
                self._idle_since = now
            remaining = self.options.admission_window_ms / 1000.0 - (now - self._idle_since)
            if remaining > 0:
                time.sleep(min(remaining, 0.002))  # short: the worker drains its inbox between steps
                return False
        self._idle_since = None
        admitted: list[DiffusionSample] = []
        used = sum(s.tokens for s in self._running) if budget is not None else 0
        while self._waiting and free > 0:
            sample = next(iter(self._waiting.values()))
            if budget is not None and used + sample.tokens > budget and (self._running or admitted):
                break  # (arrival order: a small request does not pass a large one that waits)
            self._waiting.popitem(last=False)
            admitted.append(sample)
            used += sample.tokens
            free -= 1
        if admitted:
            if self.ranks is not None:
                self.ranks.send("start", sample_keys(admitted))
            self._loaded().start(admitted)
            for sample in admitted:
                sample.started = True
            self._running.extend(admitted)
        return bool(self._running)

    def _emit(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        finished = [s for s in self._running if s.done]
        self._running = [s for s in self._running if not s.done]
        by_key: dict[Any, list[DiffusionSample]] = {}
        for sample in finished:
            by_key.setdefault(sample.batch_key, []).append(sample)
        for group in by_key.values():
            payloads = self._loaded().decode(group)
            for sample, payload in zip(group, payloads, strict=True):
                self._requests[sample.request_id].outputs[sample.index] = payload
        for request_id, request in list(self._requests.items()):
            if len(request.outputs) == len(request.samples):
                chunks.append(self._final(request_id, request))
            # (with `progress` off, only the first progress chunk: it says the request started)
            elif self.streaming and any(s.started for s in request.samples) and (self.options.progress or not request.chunks):
                done = sum(s.step for s in request.samples)
                total = sum(s.total_steps for s in request.samples)
                chunks.append(Chunk(request_id, self.stage.name, request.chunks, {"progress": {"step": done, "total": total}}))
                request.chunks += 1
        return chunks

    def _final(self, request_id: str, request: _Request) -> Chunk:
        del self._requests[request_id]
        if self.ranks is not None:
            self.ranks.send("drop", [request_id])
        outputs = [request.outputs[i] for i in sorted(request.outputs)]
        data = dict(outputs[0])
        if len(outputs) > 1:  # n samples: media keys become lists, one entry per sample
            for key in ("image", "video", "audio", "actions"):
                if key in data:
                    data[key] = [out[key] for out in outputs]
        cache = [s.cache for s in request.samples if s.cache is not None]
        if cache:
            data["cache"] = {
                "computed_steps": sum(c.computed_steps for c in cache),
                "skipped_steps": sum(c.skipped_steps for c in cache),
            }
        return Chunk(request_id, self.stage.name, request.chunks, data, final=True)

    def _loaded(self) -> DiffusionModel:
        if self.model is None:
            raise StageError(self.stage.name, "the stage runtime is not loaded: call load() first")
        return self.model
