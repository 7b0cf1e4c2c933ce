"""Connector calls never block the server: while a chat request's input put sleeps 2 s, ``/health``
answers within 50 ms.

The toy pipeline (tiny LM on vLLM in a worker process) is served over real HTTP by uvicorn in a
thread of this process, with a plugin's connector as its output connector: `SlowConnector` around
shm, registered by a throwaway plugin as a connector package registers its own, chosen by the
deploy overrides, and slow only in this process (the engine's), so the stage workers stay fast.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from omni_core import hookimpl
from omni_core.config.resolve import resolve
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.errors import ConfigError
from omni_core.plugins import PluginHost, load_plugins
from omni_core.server.app import bind_socket, create_app

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PUT_DELAY_S = 2.0


class SlowConnectors:
    """A connector plugin: registers ``slow`` (the engine's calls sleep, see `SlowConnector`)."""

    @hookimpl
    def register_connectors(register: Callable[[str, str], None]) -> None:
        register("slow", "omni_core.testing.fakes:SlowConnector")


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return load_plugins(extra_plugins=[SlowConnectors])


@pytest.fixture(scope="module")
def server(model_dir: Path, host: PluginHost) -> Iterator[str]:
    """The app on a free loopback port, served by uvicorn in a thread (its own event loop). The port is
    bound here and the socket handed to uvicorn: a port chosen free and bound only once the engine
    has started was taken in between once (``address already in use``, a CI run)."""
    overrides = [
        "output_connector.connector=slow",
        f"output_connector.put_delay_s={PUT_DELAY_S}",
        f"output_connector.slow_pid={os.getpid()}",
    ]
    engine = AsyncOmniEngine(resolve(str(model_dir), overrides=overrides, plugins=host))
    listener = bind_socket("127.0.0.1", 0)  # (as `omni serve` binds before loading)
    port = listener.getsockname()[1]
    config = uvicorn.Config(create_app(engine, model_name="toy"), log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [listener]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 240
        while not uv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(60)
        listener.close()


CHAT = {"model": "toy", "modalities": ["text"], "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def test_health_answers_while_a_request_input_put_sleeps(server: str) -> None:
    chat: dict[str, Any] = {}
    # Clients made up front: making one loads CA certificates, holding the GIL of this process
    # (the server's too) for a few hundred ms.
    with httpx.Client(base_url=server, timeout=120) as asker, httpx.Client(base_url=server, timeout=10) as client:

        def ask() -> None:
            started = time.monotonic()
            chat["response"] = asker.post("/v1/chat/completions", json=CHAT)
            chat["seconds"] = time.monotonic() - started

        # Warm: a first request compiles the chat template and more.
        assert asker.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client.get("/health").status_code == 200
        thread = threading.Thread(target=ask)
        thread.start()
        time.sleep(0.3)  # the request is in its 2 s put now
        latencies = []
        until = time.monotonic() + PUT_DELAY_S - 0.6
        while time.monotonic() < until:
            started = time.monotonic()
            response = client.get("/health")
            latencies.append(time.monotonic() - started)
            assert response.status_code == 200, response.text
            time.sleep(0.05)
        thread.join(120)
    assert chat["response"].status_code == 200, chat["response"].text
    assert chat["response"].json()["choices"][0]["message"]["content"]
    assert chat["seconds"] >= PUT_DELAY_S  # its input put did sleep
    assert max(latencies) < 0.05, f"/health took {max(latencies) * 1000:.0f} ms while a put slept: {latencies}"
    assert len(latencies) >= 10


def test_connector_options_are_checked_when_the_deploy_resolves(model_dir: Path, host: PluginHost) -> None:
    # Before anything starts: a misspelled option of the plugin's connector names the key.
    with pytest.raises(ConfigError) as error:
        resolve(str(model_dir), overrides=["output_connector.connector=slow", "output_connector.put_delay=2"], plugins=host)
    assert error.value.key == "output_connector.options.put_delay"
    assert "did you mean 'put_delay_s'" in str(error.value)
    with pytest.raises(ConfigError) as error:
        resolve(str(model_dir), overrides=["edge.lm->vocoder.connector=slow", "edge.lm->vocoder.slow_pdi=1"], plugins=host)
    assert error.value.key == "edges.lm->vocoder.options.slow_pdi"
