"""A stage that crash-loops, over HTTP on a real server: it is restarted a few times, then given up
on, and ``/health`` says which stage and why (503), as a Kubernetes readiness probe needs.

The served model is ``omni-tiny/toy-passthrough`` (one generation stage in its own process, no
vLLM): the stage parameter ``fail: crash`` ends its worker process the way a real crash would.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import pytest

from omni_core.runtime.stage_group import MAX_RESTARTS
from omni_core.testing.live_server import LiveServer

MODEL = "omni-tiny/toy-passthrough"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    server = LiveServer.start(MODEL)
    try:
        yield server
    finally:
        server.close()


def _speech(server: LiveServer, **extra: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/speech", json={"model": MODEL, "input": "hello", **extra}, timeout=60)


def _error(response: httpx.Response) -> dict[str, Any]:
    assert 500 <= response.status_code < 600, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error", error
    return error


def test_a_crash_looping_stage_is_given_up_on_and_health_says_so(server: LiveServer) -> None:
    crash = {"stage_params": {"echo": {"fail": "crash"}}}
    for attempt in range(MAX_RESTARTS):
        assert "crashed" in _error(_speech(server, **crash))["message"]
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{server.url}/health")).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.1)
        assert health.json()["replicas"][0]["restarts"] == attempt + 1
        assert _speech(server).status_code == 200  # restarted, and serving

    _error(_speech(server, **crash))  # one crash more than the restarts allowed
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503
    body = health.json()
    assert body["status"] == "unhealthy" and body["replicas"][0]["state"] == "failed", body
    [error] = body["errors"]
    assert "'echo'" in error and "not being restarted" in error and f"crashed {MAX_RESTARTS + 1} times within 10 min" in error, error

    # Requests now fail at once with the reason, instead of waiting for a replica that never comes.
    started = time.monotonic()
    assert "none is being restarted" in _error(_speech(server))["message"]
    assert time.monotonic() - started < 5
    assert httpx.get(f"{server.url}/health").status_code == 503
    log = server.log_tail(200_000)
    assert log.count("not being restarted") == 1, log[-4000:]
    assert log.count("no replica left") == 1, log[-4000:]
