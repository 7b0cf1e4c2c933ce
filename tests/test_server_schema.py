"""Property-based tests of the chat route from the served OpenAPI schema (schemathesis).

Schemathesis generates valid and invalid bodies for ``POST /v1/chat/completions`` from the schema
the real server serves (``/schema/openapi.json``); whatever it sends, the server must never answer
5xx, and every error must be an OpenAI error body. ``model`` is set to the served model in every
generated object, or almost every request would stop at 404 before reaching the engine.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import hypothesis
from hypothesis import strategies as st
import pytest
import schemathesis
from schemathesis.generation.modes import GenerationMode

from omni_core.testing.live_server import LiveServer

pytestmark = pytest.mark.vllm

MODEL = os.environ.get("OMNI_SCHEMA_TEST_MODEL", "omni-tiny/toy")
INLINE = ("lm.placement=inline", "vocoder.placement=inline") if MODEL == "omni-tiny/toy" else ()
MAX_EXAMPLES = 50


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    server = LiveServer.start(MODEL, args=[arg for o in INLINE for arg in ("--set", o)])
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def chat_operation(live_server: LiveServer) -> Any:
    schema = schemathesis.openapi.from_url(f"{live_server.url}/schema/openapi.json", timeout=30)
    return schema["/v1/chat/completions"]["POST"]


# Schemathesis' own pytest plugin (`from_fixture` + `parametrize`) fails under pytest 9 (it reads a
# private `_nodeid`), so the test drives its hypothesis strategies directly.
def test_chat_route_never_fails_with_5xx(chat_operation: Any, live_server: LiveServer) -> None:
    cases = st.one_of(chat_operation.as_strategy(GenerationMode.POSITIVE), chat_operation.as_strategy(GenerationMode.NEGATIVE))
    seen: list[int] = []

    # A valid request the server must answer 200, whatever hypothesis draws next to it. The drawn
    # cases are derandomized: a CI run and a local run send the same bodies, so a failure repeats.
    valid = chat_operation.Case(body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})

    @hypothesis.settings(
        max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(hypothesis.HealthCheck), database=None, derandomize=True
    )
    @hypothesis.example(case=valid)
    @hypothesis.given(case=cases)
    def check(case: Any) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        response = case.call(base_url=live_server.url, timeout=120)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.body, response.status_code, response.text[:2000])
        if response.status_code >= 400:
            body = response.json()
            assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body

    check()
    # Both outcomes must have been reached, or the run tested only one side of the validation.
    assert any(code == 200 for code in seen) and any(400 <= code < 500 for code in seen), sorted(set(seen))


def test_schema_documents_openai_errors(live_server: LiveServer) -> None:
    import httpx

    document = httpx.get(f"{live_server.url}/schema/openapi.json", timeout=30).json()
    responses = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "text/event-stream" in responses["200"]["content"]
    for status in ("400", "401", "404", "413", "500"):
        ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse"), (status, ref)


# Every route of the served schema, valid and invalid bodies, parameters and paths: at least 2000
# requests in all, none answered 5xx, none left without an answer for FUZZ_TIMEOUT_S.
FUZZ_EXAMPLES = {"POST": 400, "GET": 250, "DELETE": 100}  # per operation (one without parameters runs out sooner)
FUZZ_TIMEOUT_S = 30.0
# Generation is capped so a valid request costs milliseconds: the fuzz run is about the server's
# handling of what it is sent, not about long generations (test_server.py covers those).
CAPPED_FIELDS = ("max_tokens", "max_completion_tokens")


def _capped(body: Any) -> Any:
    if isinstance(body, dict):
        if "model" in body:
            body["model"] = MODEL
        for field in CAPPED_FIELDS:
            if isinstance(body.get(field), int) and not isinstance(body[field], bool) and body[field] > 4:
                body[field] = 4
    return body


def test_every_route_fuzzed_without_5xx_or_hang(live_server: LiveServer) -> None:
    import httpx

    schema = schemathesis.openapi.from_url(f"{live_server.url}/schema/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9, [op.label for op in operations]
    sent: dict[str, list[int]] = {}

    for operation in operations:
        cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
        codes = sent.setdefault(operation.label, [])

        @hypothesis.settings(
            max_examples=FUZZ_EXAMPLES[operation.method.upper()],
            deadline=None,
            suppress_health_check=list(hypothesis.HealthCheck),
            database=None,
            derandomize=True,
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],  # no shrinking: a failure prints its case
        )
        @hypothesis.given(case=cases)
        def check(case: Any) -> None:
            case.body = _capped(case.body)
            try:
                response = case.call(base_url=live_server.url, timeout=FUZZ_TIMEOUT_S)
            except httpx.TimeoutException:
                pytest.fail(f"{operation.label}: no answer within {FUZZ_TIMEOUT_S} s to {case.path_parameters} {case.query} {case.body!r:.2000}")
            codes.append(response.status_code)
            assert response.status_code < 500, (operation.label, case.path_parameters, case.body, response.status_code, response.text[:2000])
            if response.status_code >= 400:
                body = response.json()
                assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body

        check()

    total = sum(len(codes) for codes in sent.values())
    assert total >= 2000, ", ".join(f"{label}: {len(codes)}" for label, codes in sent.items())
    every = [code for codes in sent.values() for code in codes]
    assert any(code < 300 for code in every) and any(400 <= code < 500 for code in every), sorted(set(every))
    # The server still answers a valid request after all that.
    response = httpx.post(
        f"{live_server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None, response.text
    assert httpx.get(f"{live_server.url}/health", timeout=30).status_code == 200
