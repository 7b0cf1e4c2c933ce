"""Fakes for tests about the core's own logic (routing, ordering, failures) and benchmarks.

Real model tests use real runtimes on tiny checkpoints; these stand in only where the subject is
the engine itself.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

import attrs

from omni_core.config.resolved import ResolvedEdge, ResolvedPipeline, ResolvedStage
from omni_core.connectors import create_connector
from omni_core.connectors.base import Connector
from omni_core.errors import ConnectorError, InvalidRequestError
from omni_core.outputs import Chunk, Payload, StageInput
from omni_core.parts import InputProcessor, PartContext
from omni_core.stages.base import ProgressCallback, StageRuntime


@attrs.frozen
class PassThroughOptions:
    max_batch_size: int = 64
    step_delay_s: float = 0.0
    load_error: str = ""  # when set, `load` raises RuntimeError with this message


class PassThroughRuntime(StageRuntime):
    """Emits every input's data as a chunk, batched: one `step` serves every request with input.

    Request params: ``repeat`` (emit each input that many times), ``fail`` (``"invalid"``: reject at
    add; ``"request"``: an error chunk; ``"stage"``: `step` raises; ``"crash"``: the process exits;
    ``"emit_then_crash"``: a first chunk, then the process exits at the next step),
    ``hold`` (never finish: for cancellation tests), ``echo`` (copied into the data). Adds
    ``"<stage>": chunk count`` and ``"<stage>_replica": replica index`` to the data.
    """

    Options = PassThroughOptions

    def load(self, progress: ProgressCallback | None = None) -> None:
        if self.options.load_error:
            raise RuntimeError(self.options.load_error)
        self.pending: dict[str, deque[StageInput]] = {}
        self.params: dict[str, dict[str, Any]] = {}
        self.emitted: dict[str, int] = {}
        self.steps = 0
        if progress:
            progress("loaded", 1.0)

    def add_request(self, request_id: str, stage_input: StageInput) -> None:
        if stage_input.params.get("fail") == "invalid":
            raise InvalidRequestError("this input is invalid on purpose", param="fail")
        self.params[request_id] = stage_input.params
        self.pending[request_id] = deque([stage_input])
        self.emitted[request_id] = 0

    def extend_request(self, request_id: str, stage_input: StageInput) -> None:
        self.pending[request_id].append(stage_input)

    def abort_request(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.params.pop(request_id, None)
        self.emitted.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return any(self.pending.values())

    def step(self) -> list[Chunk]:
        self.steps += 1
        if self.options.step_delay_s:
            time.sleep(self.options.step_delay_s)
        chunks = []
        for request_id in [r for r, q in self.pending.items() if q][: self.options.max_batch_size]:
            params = self.params[request_id]
            fail = params.get("fail")
            if fail == "stage":
                raise RuntimeError("stage failure on purpose")
            if fail == "crash" or (fail == "emit_then_crash" and self.emitted[request_id]):
                os._exit(3)
            if fail == "emit_then_crash":
                chunks.append(Chunk(request_id, self.stage.name, 0, dict(self.pending[request_id][0].data), False))
                self.emitted[request_id] = 1
                continue
            if fail == "request":
                chunks.append(Chunk(request_id, self.stage.name, self.emitted[request_id], error="request failure on purpose"))
                self.abort_request(request_id)
                continue
            stage_input = self.pending[request_id].popleft()
            if params.get("hold"):
                self.pending[request_id].appendleft(stage_input)
                continue
            repeat = int(params.get("repeat", 1))
            for i in range(repeat):
                final = stage_input.final and i == repeat - 1
                data = dict(stage_input.data) | {self.stage.name: self.emitted[request_id], f"{self.stage.name}_replica": self.replica}
                if "echo" in params:
                    data[f"{self.stage.name}_echo"] = params["echo"]
                chunks.append(Chunk(request_id, self.stage.name, self.emitted[request_id], data, final))
                self.emitted[request_id] += 1
            if stage_input.final:
                self.abort_request(request_id)
        return chunks


class SharingRuntime(PassThroughRuntime):
    """`PassThroughRuntime` whose "model" (a fresh token per load) another stage may share
    (``share_model_with``); each chunk names the model its stage ran on (``"<stage>_model"``: its
    own, or as a guest the one it was handed)."""

    def load(self, progress: ProgressCallback | None = None) -> None:
        super().load(progress)
        self.model = self.shared if self.shared is not None else f"model-{os.urandom(8).hex()}"

    def shared_model(self) -> Any:
        return self.model

    def step(self) -> list[Chunk]:
        chunks = super().step()
        for chunk in chunks:
            if chunk.data is not None:
                chunk.data[f"{self.stage.name}_model"] = self.model
        return chunks


def passthrough_pipeline(
    stages: int = 2,
    placement: str = "inline",
    connector: str | None = None,
    replicas: int = 1,
    streaming: bool = True,
    step_delay_s: float = 0.0,
) -> ResolvedPipeline:
    """A linear pipeline of pass-through stages ``s0 -> s1 -> ...``; the last outputs ``text``."""
    connector = connector or ("inproc" if placement == "inline" else "shm")
    refs = {
        "inproc": "omni_core.connectors.inproc:InProcessConnector",
        "shm": "omni_core.connectors.shm:SharedMemoryConnector",
    }
    resolved = []
    for i in range(stages):
        inputs = ()
        if i:
            inputs = (ResolvedEdge(f"s{i-1}", f"s{i}", None, connector, refs[connector], {}),)
        resolved.append(
            ResolvedStage(
                name=f"s{i}",
                kind="passthrough",
                runtime_ref="omni_core.testing.fakes:PassThroughRuntime",
                model="",
                inputs=inputs,
                output="text" if i == stages - 1 else None,
                final=i == stages - 1,
                placement=placement,
                placement_ref=f"omni_core.runtime.replica:{'InlineReplica' if placement == 'inline' else 'ProcessReplica'}",
                replicas=replicas,
                options={"max_batch_size": 64, "step_delay_s": step_delay_s},
            )
        )
    return ResolvedPipeline(
        model="fake",
        model_path="",
        family="passthrough",
        stages=tuple(resolved),
        streaming=streaming,
        output_connector=connector,
        output_connector_ref=refs[connector],
    )


class LoadingProcessor(InputProcessor):
    """An input processor with a ``load()`` (as one that loads a tokenizer): it records the thread
    that loaded it, and refuses requests before that."""

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.loaded_in: str | None = None

    def load(self) -> None:
        import threading

        self.loaded_in = threading.current_thread().name

    def process(self, request: Any) -> dict[str, StageInput]:
        if self.loaded_in is None:
            raise RuntimeError("the input processor was called before load()")
        return {self.context.pipeline.stages[0].name: StageInput(data={"prompt": request.prompt})}


class FailingLoadProcessor(LoadingProcessor):
    """A `LoadingProcessor` whose ``load()`` fails (an unreadable tokenizer)."""

    def load(self) -> None:
        raise OSError("tokenizer.json is unreadable (on purpose)")


class ParamsForLaterStages(InputProcessor):
    """An input processor that also sets parameters of a non-entry stage (``s1``: repeat twice)."""

    def process(self, request: Any) -> dict[str, StageInput]:
        return {"s0": StageInput(data={"prompt": request.prompt}), "s1": StageInput(params={"repeat": 2})}


_BUILT_IN_CONNECTORS = {
    "inproc": "omni_core.connectors.inproc:InProcessConnector",
    "shm": "omni_core.connectors.shm:SharedMemoryConnector",
}


class SlowConnector(Connector):
    """A built-in connector made slow, or failing, on purpose: for tests that the engine never
    waits on a connector on its event loop, and keeps its guarantees while calls take long.

    Options: `inner` (``"inproc"`` or ``"shm"``, built with `inner_options`); in the process
    whose pid is `slow_pid` (0: in every process), `put` first sleeps `put_delay_s`, and the n-th
    `get` sleeps ``get_delays_s[n % len(get_delays_s)]``; `get` raises `ConnectorError` for a
    payload whose ``"prompt"`` is `fail_get_prompt`. Slow only in the engine's process (its pid),
    stage workers in other processes stay fast: a worker inside a put answers no health ping.
    `outstanding()` counts the handles put through this instance and not yet released through it.
    """

    def __init__(
        self,
        inner: str = "shm",
        inner_options: dict[str, Any] | None = None,
        put_delay_s: float = 0.0,
        get_delays_s: list[float] | None = None,
        slow_pid: int = 0,
        fail_get_prompt: str = "",
    ) -> None:
        super().__init__(
            inner=inner, inner_options=inner_options, put_delay_s=put_delay_s, get_delays_s=get_delays_s,
            slow_pid=slow_pid, fail_get_prompt=fail_get_prompt,
        )
        self._inner = create_connector(_BUILT_IN_CONNECTORS[inner], inner_options, "SlowConnector.inner")
        self._put_delay_s = put_delay_s
        self._get_delays_s = list(get_delays_s or [0.0])
        self._slow_pid = slow_pid
        self._fail_get_prompt = fail_get_prompt
        self._lock = threading.Lock()
        self._gets = 0
        self._live: set[Any] = set()

    def _slow_here(self) -> bool:
        return self._slow_pid in (0, os.getpid())

    def put(self, payload: Payload, timeout: float | None = None) -> Any:
        if self._slow_here():
            time.sleep(self._put_delay_s)
        handle = self._inner.put(payload, timeout)
        with self._lock:
            self._live.add(handle)
        return handle

    def get(self, handle: Any) -> Payload:
        if self._slow_here():
            with self._lock:
                delay = self._get_delays_s[self._gets % len(self._get_delays_s)]
                self._gets += 1
            time.sleep(delay)
        payload = self._inner.get(handle)
        if self._fail_get_prompt and payload.get("prompt") == self._fail_get_prompt:
            raise ConnectorError(f"get failed on purpose (prompt {self._fail_get_prompt!r})")
        return payload

    def release(self, handle: Any) -> None:
        self._inner.release(handle)
        with self._lock:
            self._live.discard(handle)

    def outstanding(self) -> int:
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        self._inner.close()
        super().close()
