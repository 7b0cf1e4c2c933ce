"""Offline entry points: `AsyncOmni` (async, streaming) and `Omni` (blocking, batched)."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from omni_core.config.resolved import ResolvedPipeline
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.engine.request import OmniRequest
from omni_core.engine.result import OmniResult
from omni_core.engine.sampling_params_list import stage_params_from_list
from omni_core.engine.vllm_inputs import is_vllm_prompt, request_from_vllm_prompt
from omni_core.errors import OmniError
from omni_core.outputs import OutputDelta

PromptLike = str | dict[str, Any] | OmniRequest


def to_request(prompt: PromptLike, modalities: Sequence[str] | None, params_per_stage: dict[str, dict] | None) -> OmniRequest:
    """Build an `OmniRequest` from a prompt string, a dict of request fields or a request."""
    if isinstance(prompt, OmniRequest):
        return prompt
    if isinstance(prompt, str):
        fields: dict[str, Any] = {"prompt": prompt}
    elif isinstance(prompt, dict):
        fields = dict(prompt)
    else:
        raise OmniError(f"a prompt must be a str, a dict or an OmniRequest, got {type(prompt).__name__}")
    if modalities is not None:
        fields.setdefault("modalities", tuple(modalities))
    if params_per_stage:
        fields.setdefault("params", params_per_stage)
    if fields.get("modalities") is not None:
        fields["modalities"] = tuple(fields["modalities"])
    return OmniRequest(**fields)


def _is_sampling_params_list(value: Any) -> bool:
    """Whether a positional `modalities` argument is really vLLM-Omni's ``sampling_params_list``
    (its entries are `SamplingParams` or dicts, not modality names)."""
    return isinstance(value, (list, tuple)) and bool(value) and not any(isinstance(v, str) for v in value)


def _stage_config_deploy(model: str | ResolvedPipeline, deploy: Any, path: str | Path, plugins: Any) -> dict[str, Any]:
    from omni_core.config.vllm_omni import convert_for_model

    if deploy is not None or not isinstance(model, str):
        raise OmniError("stage_configs_path goes with a model reference and no deploy (convert it with `omni convert-stage-config` to combine)")
    conversion = convert_for_model(path, model, plugins)
    for line in conversion.warnings:
        logging.getLogger(__name__).warning("%s: %s", path, line)
    return conversion.deploy


def _vllm_request(prompt: dict[str, Any], index: int, modalities: Sequence[str] | None, params: dict[str, dict] | None) -> OmniRequest:
    request = request_from_vllm_prompt(prompt, params, where=f"prompts[{index}]")
    if request.modalities is None and modalities is not None:
        request.modalities = tuple(modalities)
    return request


class AsyncOmni:
    """Async offline API: ``async with AsyncOmni(model) as omni: async for delta in omni.generate(...)``.

    `model` is a model reference (resolved with `deploy`/`overrides`) or a `ResolvedPipeline`.
    """

    def __init__(self, model: str | ResolvedPipeline, deploy: str | Path | None = None, overrides: Sequence[str] = (), plugins: Any = None) -> None:
        if isinstance(model, ResolvedPipeline):
            self.engine = AsyncOmniEngine(model)
        else:
            self.engine = AsyncOmniEngine.from_model(model, deploy=deploy, overrides=overrides, plugins=plugins)

    async def __aenter__(self) -> "AsyncOmni":
        await self.engine.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.engine.shutdown()

    async def generate(
        self, prompt: PromptLike, modalities: Sequence[str] | None = None, params_per_stage: dict[str, dict] | None = None
    ) -> AsyncIterator[OutputDelta]:
        """Yield the request's output deltas as they stream out."""
        async for delta in self.engine.generate(to_request(prompt, modalities, params_per_stage)):
            yield delta

    async def generate_result(
        self, prompt: PromptLike, modalities: Sequence[str] | None = None, params_per_stage: dict[str, dict] | None = None,
        on_delta: Callable[[OutputDelta], None] | None = None,
    ) -> OmniResult:
        """Run one request to completion and return its accumulated `OmniResult`."""
        request = to_request(prompt, modalities, params_per_stage)
        result = OmniResult(request.request_id)
        async for delta in self.engine.generate(request):
            result.add(delta)
            if on_delta is not None:
                on_delta(delta)
        return result


class Omni:
    """Blocking offline API: ``Omni(model).generate(["a", "b"])`` runs the prompts concurrently.

    The engine runs on an event loop in a background thread; call `close()` (or use ``with``).
    """

    def __init__(
        self, model: str | ResolvedPipeline, deploy: str | Path | None = None, overrides: Sequence[str] = (), plugins: Any = None,
        *, stage_configs_path: str | Path | None = None,
    ) -> None:
        """`stage_configs_path`: a vLLM-Omni stage-config YAML read as the deploy config
        (`omni_core.config.vllm_omni`; each ignored field logged as one warning), as vLLM-Omni's
        ``Omni(model=..., stage_configs_path=...)``."""
        if stage_configs_path is not None:
            deploy = _stage_config_deploy(model, deploy, stage_configs_path, plugins)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-engine-loop", daemon=True)
        self._thread.start()
        self._omni = AsyncOmni(model, deploy=deploy, overrides=overrides, plugins=plugins)
        try:
            self._run(self._omni.engine.start())
        except BaseException:
            try:  # (Ctrl-C while loading: `_run` cancelled the load; the replicas it started stop now)
                self._run(self._omni.engine.shutdown())
            finally:
                self._stop_loop()
            raise

    @property
    def pipeline(self) -> Any:
        return self._omni.engine.pipeline

    def health(self) -> list[dict[str, Any]]:
        """Each stage replica's state, as the server's ``/health`` lists them (stage, replica, pid,
        device, healthy, active requests, ...)."""
        return self._run(self._omni.engine.health())

    def _run(self, coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()  # (the coroutine is cancelled on the loop: Ctrl-C stops what it was doing)
            raise

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        modalities: Sequence[str] | None = None,
        params_per_stage: dict[str, dict] | None = None,
        on_delta: Callable[[OutputDelta], None] | None = None,
        *,
        sampling_params_list: Sequence[Any] | None = None,
    ) -> list[OmniResult]:
        """Run every prompt (concurrently, so stages batch them); results in prompt order.

        vLLM-Omni's call works too: ``generate(inputs, sampling_params_list)``, `inputs` a vLLM
        prompt dict (``prompt``, ``multi_modal_data``, ...) or a list of them and the second
        argument a list of one vLLM `SamplingParams` (or dict) per stage, in stage order
        (`omni_core.engine.vllm_inputs`, `omni_core.engine.sampling_params_list`).

        Raises the first request's error if any request fails.
        """
        if sampling_params_list is None and _is_sampling_params_list(modalities):
            modalities, sampling_params_list = None, modalities
        items = [prompts] if isinstance(prompts, (str, dict, OmniRequest)) else list(prompts)
        if sampling_params_list is not None:
            listed = stage_params_from_list(self._omni.engine.pipeline, sampling_params_list)
            params_per_stage = {**listed, **{k: {**listed.get(k, {}), **v} for k, v in (params_per_stage or {}).items()}}
        vllm_call = sampling_params_list is not None
        requests = [_vllm_request(p, i, modalities, params_per_stage) if isinstance(p, dict) and (vllm_call or is_vllm_prompt(p)) else p for i, p in enumerate(items)]

        async def run_all() -> list[OmniResult]:
            tasks = [self._omni.generate_result(p, modalities, params_per_stage, on_delta) for p in requests]
            return list(await asyncio.gather(*tasks))

        return self._run(run_all())

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._run(self._omni.engine.shutdown())
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "Omni":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
