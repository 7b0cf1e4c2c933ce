"""The `ar` stage runtime: an autoregressive model on vLLM's step-driven engine.

Each `step()` is one `LLMEngine.step()`: one batched schedule + forward + sample over every active
request. The model part (`ARModel`) says how to load the model and shape prompts, parameters and
chunks; vLLM internals stay in `vllm_bridge`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import attrs

from omni_core.config.modelref import resolve_dtype
from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.errors import ConfigError, InvalidRequestError, StageError
from omni_core.outputs import Chunk, Payload, StageInput
from omni_core.stages.ar_model import ARDelta, ARModel
from omni_core.stages.ar_options import AROptions
from omni_core.stages.base import ProgressCallback, StageRuntime, refuse_unapplied_options

if TYPE_CHECKING:
    import torch
    from vllm import LLMEngine

    from omni_core.stages import vllm_bridge

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 256 << 20
# The CPU default KV cache holds at least this many sequences of the model's full context length.
CPU_KV_CACHE_FULL_SEQUENCES = 2

# Input keys that already are a prompt; chat ``messages`` are rendered only without one of them.
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds")

@attrs.define
class _Request:
    """Per-request bookkeeping of the runtime (vLLM keeps the rest)."""

    params: dict[str, Any]
    data: Payload
    started: bool = False
    internal_id: str | None = None
    chunks: int = 0
    hidden_parts: list[torch.Tensor] = attrs.field(factory=list)
    hidden_next: int = 0  # position of the next hidden-state row not yet received
    capture: bool = True  # whether this request's chunks carry the captured rows
    input_final: bool = False
    prompt_info: Payload = attrs.field(factory=dict)
    # Streamed input: tokens generated so far (over every vLLM run of the request), the first
    # run's prompt ids, and whether the current run stops at the input's token budget.
    generated: list[int] = attrs.field(factory=list)
    prompt_ids: list[int] | None = None
    budget_limited: bool = False
    held: bool = False  # at its token budget, out of vLLM until more input comes
    session: bool = False  # runs as a vLLM streaming-input session (`ARModel.resumable`): kept there when held
    # Streamed input: the prefix-cache salt of every run of this request (see `_start`).
    cache_salt: str = attrs.field(factory=lambda: uuid.uuid4().hex)


def cpu_kv_cache_bytes(per_token: int | None, max_model_len: int) -> int:
    """The CPU default KV cache size: `CPU_DEFAULT_KV_CACHE_BYTES`, or room for
    `CPU_KV_CACHE_FULL_SEQUENCES` sequences of `max_model_len` tokens of `per_token` bytes when
    that is more (``None``: unknown, the fixed size)."""
    return max(CPU_DEFAULT_KV_CACHE_BYTES, CPU_KV_CACHE_FULL_SEQUENCES * max_model_len * (per_token or 0))


def _seeded_sampling(params: dict[str, Any]) -> bool:
    """Whether a request samples (temperature above 0; vLLM's default is 1) with a fixed seed."""
    temperature = params.get("temperature")
    return params.get("seed") is not None and (temperature is None or float(temperature) > 0)


class ARStageRuntime(StageRuntime):
    """One replica of an autoregressive stage on an in-process vLLM `LLMEngine`.

    Streaming emits a chunk per step with the new tokens (and hidden-state rows, when the model part
    captures them); otherwise one final chunk per request with everything. Both give the same tokens.
    Input that is not final (a streamed upstream) is buffered until the final piece and then started,
    unless the model part takes streamed input (`ARModel.streamed_input`, streaming on): then the
    request starts as soon as its input allows `streamed_input_min_tokens` tokens, runs in vLLM up
    to its input's token budget, and is then held out of vLLM (finished there, so no engine step
    waits for it) until more input arrives; it resumes as a new vLLM request whose prompt is the
    first prompt plus the tokens generated so far (`continuation_prompt`), under the same request
    key for its side inputs. Resuming re-prefills those tokens: the minimum trades latency for
    fewer resumptions. A model part that is `ARModel.resumable` runs such a request as a vLLM
    streaming-input session instead (`vllm_bridge.add_session_turn`): it starts as soon as its
    input allows one token (its prompt is prefilled while more input streams in), and when held it
    stays in vLLM, out of the batch, with its KV cache; resuming feeds only its last sampled token.
    Every run of a streamed-input request carries the request's own prefix-cache salt. A request
    that samples with a seed runs once, on its whole input, so that its samples follow the seed.
    """

    Options = AROptions
    # vLLM keeps process-wide state that two in-process engines would share (its parallel groups,
    # the forward context of compiled layers by layer name): a second inline engine fails to start
    # or mixes up the first one's layers.
    max_inline_replicas = 1

    @classmethod
    def check_resolved(cls, stage: ResolvedStage, options: AROptions, model_path: str) -> None:
        refuse_unapplied_options(stage, ["quantization"] if options.quantization is not None else [])

    def __init__(self, pipeline: ResolvedPipeline, stage: ResolvedStage, replica: int = 0) -> None:
        super().__init__(pipeline, stage, replica)
        self.options: AROptions
        self.model_part: ARModel | None = None
        self.engine: LLMEngine | None = None
        self._requests: dict[str, _Request] = {}
        self._by_internal: dict[str, str] = {}
        self._idle_since: float | None = None  # when an idle stage got its first new request
        self._idle = True  # no vLLM step has run since the stage last had nothing to do

    # --- lifecycle --------------------------------------------------------------------------

    def load(self, progress: ProgressCallback | None = None) -> None:
        from omni_core.stages import vllm_bridge

        if progress:
            progress(f"loading the model part of stage {self.stage.name!r}", 0.0)
        vllm_bridge.check_vllm_version()
        self.model_part = self.build_model_part(ARModel)
        self.model_part.register()
        args = self.engine_args()
        if progress:
            progress(f"starting vLLM for stage {self.stage.name!r}", 0.2)
        chosen: list[int] = []  # the CPU default's size, when it applies

        def cpu_kv_cache(per_token: int | None, max_model_len: int) -> int:
            chosen.append(cpu_kv_cache_bytes(per_token, max_model_len))
            if progress:
                tokens = f"{chosen[-1] // per_token} tokens" if per_token else "size per token unknown"
                progress(f"KV cache of {chosen[-1] >> 20} MiB ({tokens}; option kv_cache_memory_bytes)", 0.3)
            return chosen[-1]

        try:
            self.engine = vllm_bridge.create_engine(args, cpu_kv_cache if "kv_cache_memory_bytes" not in args else None)
        except ValueError as exc:
            if "KV cache" not in str(exc) and "cache blocks" not in str(exc):
                raise
            # vLLM names its own flags; say which of this stage's options set them.
            name = self.stage.name
            kv_bytes = args.get("kv_cache_memory_bytes") or (chosen[-1] if chosen else None)
            memory = (
                f"`{name}.kv_cache_memory_bytes` (now {kv_bytes})"
                if kv_bytes is not None
                else f"`{name}.gpu_memory_utilization` (now {args['gpu_memory_utilization']})"
            )
            raise ConfigError(
                f"vLLM's KV cache does not fit: {exc} In Omni, raise {memory} or lower "
                f"`{name}.max_model_len` (--set {name}.OPTION=VALUE, or the deploy file's stages.{name}.options)",
                key=f"stages.{name}.options",
            ) from exc
        if self.model_part.capture_hidden_states:
            vllm_bridge.attach_capture(self.engine)
        if progress:
            progress(f"stage {self.stage.name!r} ready", 1.0)

    def engine_args(self) -> dict[str, Any]:
        """The `EngineArgs` keywords: options, then the model part's needs, then passthrough."""
        assert self.model_part is not None
        opts = self.options
        args: dict[str, Any] = {
            "dtype": opts.dtype,
            "max_num_seqs": opts.max_num_seqs,
            "gpu_memory_utilization": opts.gpu_memory_utilization,
            "enforce_eager": opts.enforce_eager,
            "seed": opts.seed,
            "disable_log_stats": True,
        }
        for key in ("max_model_len", "max_num_batched_tokens"):
            if getattr(opts, key) is not None:
                args[key] = getattr(opts, key)
        # What the registered resolver made of the `quantization` option (e.g. {"quantization": "fp8"}).
        args.update(self.quantization() or {})
        if opts.kv_cache_memory_bytes is not None:  # (else the CPU default is sized in `load`)
            args["kv_cache_memory_bytes"] = opts.kv_cache_memory_bytes
        model_args = self.model_part.engine_args()
        args.update(model_args)
        # Either side may need prompt embeddings (the model part for a Talker-like stage).
        args["enable_prompt_embeds"] = opts.enable_prompt_embeds or bool(model_args.get("enable_prompt_embeds"))
        args.update(opts.engine_args)
        args["dtype"] = resolve_dtype(args["dtype"], args["model"])
        return args

    def shared_model(self) -> Any:
        """The `torch.nn.Module` vLLM loaded (rank 0's, in this process): a stage deployed with
        ``share_model_with`` runs on its weights (`vllm_bridge.loaded_model`)."""
        import torch

        from omni_core.stages import vllm_bridge

        assert self.engine is not None
        model = vllm_bridge.loaded_model(self.engine)
        if not isinstance(model, torch.nn.Module):
            raise StageError(self.stage.name, f"vLLM's engine did not hand back its model in this process (got {type(model).__name__})")
        return model

    def close(self) -> None:
        if self.engine is not None:
            from omni_core.stages import vllm_bridge

            for request_id in list(self._requests):
                self.abort_request(request_id)
            vllm_bridge.shutdown_engine(self.engine)
            self.engine = None
        self._requests.clear()
        self._by_internal.clear()

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, stage_input: StageInput) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request {request_id!r} is already running in stage {self.stage.name!r}")
        model = self._model()
        # Parameters are checked now: a request waiting for input fails at once, not when its
        # input ends, and the token budgets (`_run_params`) only ever see checked values.
        model.sampling_params(stage_input.params, delta=self.streaming)
        request = _Request(params=dict(stage_input.params), data=dict(stage_input.data), input_final=stage_input.final)
        request.capture = model.capture_hidden_states and model.wants_hidden_states(stage_input)
        self._requests[request_id] = request
        if self._streams_input():
            self._run_if_ready(request_id, request)
        elif stage_input.final:
            self._start(request_id, request)

    def extend_request(self, request_id: str, stage_input: StageInput) -> None:
        request = self._requests.get(request_id)
        if request is None:
            raise InvalidRequestError(f"request {request_id!r} is not waiting for input in stage {self.stage.name!r}")
        if request.input_final:
            raise InvalidRequestError(f"request {request_id!r} got input after its final input in stage {self.stage.name!r}")
        if request.started and not self._streams_input():
            raise InvalidRequestError(
                f"request {request_id!r} already started in 'ar' stage {self.stage.name!r}: its model part "
                "takes the whole prompt at once (ARModel.streamed_input is off), so upstream input must "
                "end (final=True) before it starts"
            )
        request.data = self._model().merge_input(request.data, stage_input.data)
        request.input_final = stage_input.final
        if self._streams_input():
            if request.internal_id is not None and not request.held:  # running: its model reads the new input
                self._sync_side_inputs(request_id, request)
            else:  # waiting or held: new input may let it (re)start
                self._run_if_ready(request_id, request)
        elif stage_input.final:
            self._start(request_id, request)

    def _streams_input(self) -> bool:
        # Without streaming the upstream sends one final input anyway, and a request's one chunk
        # must hold everything: both say start once the input is whole.
        return self._model().streamed_input and self.streaming

    def _sync_side_inputs(self, request_id: str, request: _Request, starting: bool = False) -> None:
        from omni_core.stages import vllm_bridge

        model = self._model()
        side = model.side_inputs(request.data, request.params, request.input_final)
        if starting and request.generated and model.capture_hidden_states:
            # A resumed run's prompt ends with the tokens generated so far: the model class
            # needs them (and the first prompt's length) to tell prompt rows from generated ones.
            side = {
                **(side or {}),
                vllm_bridge.RESUMED_TOKENS: list(request.generated),
                vllm_bridge.FIRST_PROMPT_LEN: len(request.prompt_ids or []),
            }
        if side is not None:
            vllm_bridge.update_side_inputs(self._engine(), request_id, side)

    def _run_if_ready(self, request_id: str, request: _Request) -> None:
        """(Re)start a streamed-input request in vLLM when its input allows enough tokens.

        A request that samples with a seed waits for its whole input instead: vLLM seeds a
        request's generator afresh on every run, so a resumed run would draw other samples than
        one run does, and the result would depend on when the input arrived.
        """
        budget = self._model().token_budget(request.data, request.input_final)
        if budget is None:
            self._start(request_id, request)
            return
        if _seeded_sampling(request.params):
            return
        room = budget - len(request.generated)
        # A resumable request's prompt is prefilled at once (vLLM keeps it while more input comes).
        least = 1 if self._model().resumable and not request.started else self.options.streamed_input_min_tokens
        if room >= least or (request.input_final and room > 0):
            self._start(request_id, request, budget=budget)

    def _start(self, request_id: str, request: _Request, budget: int | None = None) -> None:
        from vllm.exceptions import VLLMError

        from omni_core.stages import vllm_bridge

        model = self._model()
        resuming = bool(request.generated)
        try:
            self._sync_side_inputs(request_id, request, starting=True)
            data = request.data
            if data.get("messages") is not None and not any(data.get(k) is not None for k in _PROMPT_KEYS):
                data = {**data, **model.chat_prompt(data["messages"], self._engine().get_tokenizer())}
                request.data = data
            if resuming and request.session:
                # vLLM kept the request and its cache: feed the last sampled token, not yet computed.
                prompt = {"prompt_token_ids": [request.generated[-1]]}
            elif resuming:
                prompt = model.continuation_prompt(
                    StageInput(data=data, params=request.params), request.prompt_ids or [], request.generated
                )
            else:
                prompt = model.make_prompt(StageInput(data=data, params=request.params))
                request.prompt_info = model.prompt_info(StageInput(data=data, params=request.params, final=request.input_final))
            sampling = model.sampling_params(self._run_params(request, budget), delta=self.streaming)
            if request.capture and not resuming:
                # vLLM does not compute a prompt's blocks found in its prefix cache, so their rows
                # could not be captured: a capturing request computes its whole first prompt. (A
                # resumed run's rows up to its last token were delivered already, and vLLM always
                # computes the last one; requests that capture nothing read the cache as usual.)
                sampling.skip_reading_prefix_cache = True
            if model.capture_hidden_states:  # the side-input store lives on the capture class
                vllm_bridge.tag_request(sampling, request_id)
            if model.streamed_input:
                # A streamed-input model's rows may depend on its side inputs, and a resumed
                # embeddings prompt holds placeholder rows for the tokens generated so far (the
                # model class fills them in): vLLM's prefix cache sees neither, so two requests'
                # resumed runs could look alike to it. Each request's runs share cached blocks
                # with its own earlier runs only.
                prompt = {**prompt, "cache_salt": request.cache_salt}
            if request.session:
                internal_id = vllm_bridge.add_session_turn(self._engine(), request_id, prompt, sampling, request.internal_id)
            elif model.resumable and self._streams_input() and not request.input_final and not resuming:
                internal_id = vllm_bridge.add_session_turn(self._engine(), request_id, prompt, sampling)
                request.session = True
            else:
                engine = self._engine()
                internal_id = engine.add_request(request_id, vllm_bridge.engine_input(engine, prompt), sampling)
        except InvalidRequestError:
            self._forget(request_id)
            raise
        except (ValueError, TypeError, VLLMError) as exc:
            # vLLM validates prompts here (length, embeds shape, ...); only this request fails.
            self._forget(request_id)
            param = getattr(exc, "parameter", None)
            raise InvalidRequestError(
                f"stage {self.stage.name!r} rejected the request: {exc}",
                param=param if isinstance(param, str) else None,
            ) from exc
        request.started = True
        request.held = False
        request.internal_id = internal_id
        self._by_internal[internal_id] = request_id

    def _run_params(self, request: _Request, budget: int | None) -> dict[str, Any]:
        """The request's parameters for its next vLLM run: what is left of `max_tokens` /
        `min_tokens` after the tokens already generated, capped by the input's token budget."""
        params = dict(request.params)
        done = len(request.generated)
        remaining = params.get("max_tokens")
        remaining = None if remaining is None else int(remaining) - done
        request.budget_limited = budget is not None and (remaining is None or budget - done < remaining)
        if request.budget_limited:
            assert budget is not None
            remaining = budget - done
        if remaining is not None:
            params["max_tokens"] = remaining
        if params.get("min_tokens"):
            least = max(0, int(params["min_tokens"]) - done)
            params["min_tokens"] = least if remaining is None else min(least, remaining)
        return params

    def abort_request(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.internal_id is not None:
            self._by_internal.pop(request.internal_id, None)
            if self.engine is not None:
                self.engine.abort_request([request.internal_id], internal=True)
        self._drop_side_inputs(request_id)
        self._idle_if_empty()

    def has_unfinished(self) -> bool:
        if self.engine is None or not self.engine.has_unfinished_requests():
            return False
        # vLLM counts a held session (waiting for input, out of the batch) as unfinished.
        return any(not r.held for r in self._requests.values() if r.internal_id is not None)

    # --- stepping ---------------------------------------------------------------------------

    def step(self) -> list[Chunk]:
        from omni_core.stages import vllm_bridge

        engine = self._engine()
        model = self._model()
        if self._idle and self.options.admission_window_ms:
            # An idle stage: give requests sent together a moment to arrive, so they share a prefill.
            now = time.monotonic()
            self._idle_since = self._idle_since or now
            remaining = self.options.admission_window_ms / 1000.0 - (now - self._idle_since)
            if remaining > 0:
                time.sleep(min(remaining, 0.002))  # short: the worker takes in new requests between steps
                return []
        self._idle, self._idle_since = False, None
        outputs = engine.step()
        if model.capture_hidden_states:
            self._collect_hidden(vllm_bridge.drain_captured(engine))
        chunks: list[Chunk] = []
        for output in outputs:
            # vLLM reports the caller's (external) id; the internal one only names KV/batch rows.
            request_id = output.request_id
            request = self._requests.get(request_id)
            if request is None or not request.started:
                continue  # aborted meanwhile
            error = getattr(output, "error", None)
            if error is not None:
                # A request-level failure in vLLM: fail this request only.
                chunks.append(Chunk.failed(request_id, self.stage.name, request.chunks, str(error)))
                self._forget(request_id)
                continue
            completion = output.outputs[0]
            hidden = self._take_hidden(request) if request.capture else None
            if request.prompt_ids is None:
                request.prompt_ids = list(output.prompt_token_ids or [])
            token_ids = list(completion.token_ids)
            request.generated += token_ids  # a held request resumes in streaming mode only
            # At its input's token budget, not at its own end: wait for more input, out of vLLM;
            # unless it filled the model's context: then it ends ("length"), as one whole run does.
            # A session's turn ends with a finish reason while vLLM keeps it (finished=False).
            turn_over = output.finished or (request.session and completion.finish_reason is not None)
            hold = turn_over and request.budget_limited and completion.finish_reason == "length" and self._has_room(request)
            finished = turn_over and not hold
            delta = ARDelta(
                request_id=request_id,
                token_ids=token_ids,
                text=completion.text or "",
                prompt_token_ids=self._prompt_ids(request, output) if request.chunks == 0 else None,
                prompt_info=request.prompt_info if request.chunks == 0 else None,
                finish_reason=completion.finish_reason if finished else None,
                stop_reason=completion.stop_reason if finished else None,
                hidden_states=None if hidden is None else (hidden if hidden.dim() == 2 else hidden[:, 0].contiguous()),
                logprobs=_plain_logprobs(completion.logprobs),
                layer_states=self._split_layers(model, hidden),
            )
            chunks.append(
                Chunk(
                    request_id=request_id,
                    stage=self.stage.name,
                    index=request.chunks,
                    data=model.chunk_data(delta),
                    final=finished,
                )
            )
            request.chunks += 1
            if finished:
                self._forget(request_id)
            elif hold:
                try:
                    self._hold(request_id, request)
                except InvalidRequestError as exc:  # vLLM rejected the resumed run
                    chunks.append(Chunk.failed(request_id, self.stage.name, request.chunks, exc))
        return chunks

    def _has_room(self, request: _Request) -> bool:
        """Whether the request's sequence (its first prompt and every token generated since) is
        still shorter than the model's context, so that a resumed run could start."""
        return len(request.prompt_ids or []) + len(request.generated) < self._engine().model_config.max_model_len

    def _hold(self, request_id: str, request: _Request) -> None:
        """Take a request that reached its token budget out of vLLM (vLLM already freed it) until
        more input comes; resume at once if that input came while it ran."""
        assert request.internal_id is not None
        if not request.session:  # (a session stays in vLLM, out of its batch)
            self._by_internal.pop(request.internal_id, None)
            request.internal_id = None
        request.held = True
        self._run_if_ready(request_id, request)

    def _forget(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None and request.internal_id is not None:
            self._by_internal.pop(request.internal_id, None)
            if request.session and self.engine is not None:  # vLLM keeps a session until it is ended
                self.engine.abort_request([request.internal_id], internal=True)
        self._drop_side_inputs(request_id)
        self._idle_if_empty()

    def _idle_if_empty(self) -> None:
        if not self._requests:  # nothing left: the next request opens a new admission window
            self._idle, self._idle_since = True, None

    def _drop_side_inputs(self, request_id: str) -> None:
        if self.engine is not None and self.model_part is not None and self.model_part.capture_hidden_states:
            from omni_core.stages import vllm_bridge

            vllm_bridge.drop_side_inputs(self.engine, request_id)

    def _collect_hidden(self, captured: list[vllm_bridge.CapturedRows]) -> None:
        for rows in captured:
            request_id = self._by_internal.get(rows.request_id)
            request = self._requests.get(request_id) if request_id is not None else None
            if request is None or not request.capture:
                continue
            end = rows.start + rows.rows.shape[0]
            if end <= request.hidden_next:
                continue  # recomputed after preemption: rows already delivered
            if rows.start > request.hidden_next:
                raise RuntimeError(
                    f"hidden states of request {request_id!r} skipped positions "
                    f"{request.hidden_next}..{rows.start - 1}: vllm_bridge lost rows"
                )
            request.hidden_parts.append(rows.rows[request.hidden_next - rows.start :])
            request.hidden_next = end

    @staticmethod
    def _prompt_ids(request: _Request, output: Any) -> list[int] | None:
        # A prompt given as embeddings (vLLM holds placeholder ids for its rows): carry no ids.
        if request.data.get("prompt_embeds") is not None:
            return None
        return list(output.prompt_token_ids or [])

    @staticmethod
    def _split_layers(model: ARModel, hidden: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
        """``[n, n_layers, hidden]`` rows -> one ``[n, hidden]`` tensor per `capture_layers` key."""
        if hidden is None:
            return None
        keys = list(model.capture_layers)
        if hidden.dim() == 2:
            return {keys[0]: hidden}
        # Contiguous copies: connectors move whole buffers, not strided views.
        return {key: hidden[:, i].contiguous() for i, key in enumerate(keys)}

    @staticmethod
    def _take_hidden(request: _Request) -> torch.Tensor | None:
        import torch

        parts, request.hidden_parts = request.hidden_parts, []
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    # --- helpers ----------------------------------------------------------------------------

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError(f"stage {self.stage.name!r} is not loaded: call load() first")
        return self.engine

    def _model(self) -> ARModel:
        if self.model_part is None:
            raise RuntimeError(f"stage {self.stage.name!r} is not loaded: call load() first")
        return self.model_part


def _plain_logprobs(logprobs: Any) -> list[list[tuple[int, float, int | None, str | None]]] | None:
    """vLLM's per-position `{token_id: Logprob}` as plain data that connectors can move: per generated
    token, ``(token_id, logprob, rank, decoded token)`` of the sampled token and of the top ones."""
    if not logprobs:
        return None
    return [
        [(int(tid), float(lp.logprob), lp.rank, lp.decoded_token) for tid, lp in (position or {}).items()]
        for position in logprobs
    ]
