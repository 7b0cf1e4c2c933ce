"""Load on the HTTP server: N concurrent streaming chat clients with audio for D seconds (not a test).

Starts ``omni serve MODEL`` (default deploy: a worker process per stage) unless ``--url`` points at
a running server, then:

1. reference pass: each of K prompt variants (K = 2 x clients by default) runs alone, greedy, and
   its text, usage and audio are recorded;
2. load pass: N clients send streaming chat requests (text + audio, temperature 0) back to back for
   D seconds. Request number n carries its number in the prompt (variant n mod K) and in ``user``;
   in-flight requests are numbered within a window of about N, so with K > N concurrent requests
   nearly always have different prompts and any mix-up between them shows;
3. every response is checked: it ended with ``[DONE]``, every chunk carries one id that no other
   request had, and its text, usage and audio equal what the same prompt gave alone. Requests that
   failed or never finished are "lost"; answers with another prompt's content are "mixed up".

Prints markdown tables: counts, throughput, and p50/p99 of TTFT (first text delta), TTFP (first
audio delta) and end-to-end latency as the client sees them.

    python bench/server_load.py [--clients 64] [--duration 60] [--model omni-tiny/toy] [--set lm.max_num_seqs=16]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time
from typing import Any

import attrs
import httpx
import numpy as np

from omni_core.testing.live_server import LiveServer

SEEDS = (
    "Once upon a time there was a little robot",
    "The weather today is sunny with a gentle breeze",
    "Please describe the picture of a red apple",
    "She counted the stars at night, one by one",
)


def variant_prompt(k: int) -> str:
    return f"Request {k:04d}: {SEEDS[k % len(SEEDS)]}"


@attrs.define
class StreamResult:
    """One streamed chat completion as the client saw it."""

    text: str = ""
    audio_parts: list[np.ndarray] = attrs.field(factory=list)
    sample_rate: int | None = None
    usage: dict[str, int] | None = None
    chunk_ids: set[str] = attrs.field(factory=set)
    done: bool = False
    error: str | None = None
    ttft: float | None = None
    ttfp: float | None = None
    e2el: float = 0.0

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.audio_parts) if self.audio_parts else np.zeros(0, dtype=np.float32)


@attrs.define
class Outcome:
    """One load-pass request and what its check found (`problem` None: correct)."""

    number: int
    variant: int
    result: StreamResult
    problem: str | None
    kind: str  # "ok", "lost" or "mixed"


async def stream_chat(client: httpx.AsyncClient, model: str, prompt: str, fields: dict[str, Any], user: str) -> StreamResult:
    """One streaming chat request; `fields` adds request fields (max_tokens, audio, stage_params)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "audio": {"format": "pcm16"},
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": user,
        **fields,
    }
    out = StreamResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"in-band error: {event['error'].get('message')}"
                    continue
                out.chunk_ids.add(event["id"])
                if event.get("usage"):
                    out.usage = event["usage"]
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("content"):
                        out.ttft = out.ttft if out.ttft is not None else time.perf_counter() - start
                        out.text += delta["content"]
                    if delta.get("audio"):
                        out.ttfp = out.ttfp if out.ttfp is not None else time.perf_counter() - start
                        pcm = np.frombuffer(base64.b64decode(delta["audio"]["data"]), dtype="<i2")
                        out.audio_parts.append(pcm.astype(np.float32) / 32767.0)
                        out.sample_rate = delta["audio"].get("sample_rate")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.e2el = time.perf_counter() - start
    return out


def check(result: StreamResult, expected: StreamResult, seen_ids: set[str], audio_atol: float) -> tuple[str, str | None]:
    """(kind, problem) of a load-pass response against the same prompt run alone."""
    if result.error or not result.done:
        return "lost", result.error or "the stream ended without [DONE]"
    if len(result.chunk_ids) != 1:
        return "mixed", f"chunks carry {len(result.chunk_ids)} different ids"
    (chunk_id,) = result.chunk_ids
    if chunk_id in seen_ids:
        return "mixed", f"id {chunk_id} was already used by another response"
    seen_ids.add(chunk_id)
    if result.text != expected.text:
        return "mixed", f"text {result.text[:40]!r} != alone {expected.text[:40]!r}"
    if result.usage != expected.usage:
        return "mixed", f"usage {result.usage} != alone {expected.usage}"
    audio, want = result.audio, expected.audio
    if audio.shape != want.shape or result.sample_rate != expected.sample_rate:
        return "mixed", f"audio {audio.shape} @ {result.sample_rate} Hz != alone {want.shape} @ {expected.sample_rate} Hz"
    if audio.size and float(np.abs(audio - want).max()) > audio_atol:
        return "mixed", f"audio differs from alone by {float(np.abs(audio - want).max()):.2e}"
    return "ok", None


async def reference_pass(client: httpx.AsyncClient, model: str, variants: int, fields: dict[str, Any]) -> list[StreamResult]:
    references = []
    for k in range(variants):
        result = await stream_chat(client, model, variant_prompt(k), fields, f"reference-{k}")
        if result.error or not result.done:
            raise SystemExit(f"reference request {k} failed: {result.error}")
        references.append(result)
    return references


async def load_pass(
    client: httpx.AsyncClient, model: str, clients: int, duration: float, references: list[StreamResult], fields: dict[str, Any], audio_atol: float
) -> tuple[list[Outcome], float]:
    counter = iter(range(10**9))
    outcomes: list[Outcome] = []
    seen_ids: set[str] = set()
    start = time.perf_counter()
    deadline = start + duration

    async def worker() -> None:
        while time.perf_counter() < deadline:
            n = next(counter)
            k = n % len(references)
            result = await stream_chat(client, model, variant_prompt(k), fields, f"load-{n}")
            kind, problem = check(result, references[k], seen_ids, audio_atol)
            outcomes.append(Outcome(n, k, result, problem, kind))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return outcomes, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(value: float) -> str:
    return f"{value * 1000:.0f}"


def report(args: argparse.Namespace, outcomes: list[Outcome], elapsed: float, server_metrics: str | None) -> str:
    ok = [o for o in outcomes if o.kind == "ok"]
    lost = [o for o in outcomes if o.kind == "lost"]
    mixed = [o for o in outcomes if o.kind == "mixed"]
    tokens = sum((o.result.usage or {}).get("completion_tokens", 0) for o in ok)
    audio_s = sum(len(o.result.audio) / (o.result.sample_rate or 1) for o in ok)
    lines = [
        f"Model `{args.model}`, {args.clients} clients, {args.duration:.0f} s, max_tokens {args.max_tokens}, "
        f"{args.variants or 2 * args.clients} prompt variants, streaming text + audio",
        "",
        "| requests | ok | lost | mixed up | req/s | output tok/s | audio s/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(outcomes)} | {len(ok)} | {len(lost)} | {len(mixed)} | {len(ok) / elapsed:.2f} | {tokens / elapsed:.1f} | {audio_s / elapsed:.3f} |",
        "",
        "| latency (ms) | p50 | p99 | mean |",
        "|---|---:|---:|---:|",
    ]
    for name, values in (
        ("TTFT (first text)", [o.result.ttft for o in ok if o.result.ttft is not None]),
        ("TTFP (first audio)", [o.result.ttfp for o in ok if o.result.ttfp is not None]),
        ("E2EL", [o.result.e2el for o in ok]),
    ):
        mean = statistics.fmean(values) if values else float("nan")
        lines.append(f"| {name} | {_ms(percentile(values, 0.5))} | {_ms(percentile(values, 0.99))} | {_ms(mean)} |")
    problems = [o for o in outcomes if o.problem][:10]
    if problems:
        lines += ["", "First problems:"] + [f"- request {o.number} (variant {o.variant}, {o.kind}): {o.problem}" for o in problems]
    if server_metrics is not None:
        running = next((line.split()[-1] for line in server_metrics.splitlines() if line.startswith("omni_requests_running ")), "?")
        lines += ["", f"Server after the run: omni_requests_running {running}"]
    return "\n".join(lines)


async def run(args: argparse.Namespace, url: str) -> str:
    variants = args.variants or 2 * args.clients
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(300.0), limits=limits) as client:
        started = time.perf_counter()
        fields: dict[str, Any] = {"max_tokens": args.max_tokens}
        if args.voice:
            fields["audio"] = {"format": "pcm16", "voice": args.voice}
        if args.stage_params:
            fields["stage_params"] = json.loads(args.stage_params)
        references = await reference_pass(client, args.model, variants, fields)
        print(f"reference pass: {variants} prompts alone in {time.perf_counter() - started:.1f} s", flush=True)
        outcomes, elapsed = await load_pass(client, args.model, args.clients, args.duration, references, fields, args.audio_atol)
        metrics = (await client.get("/metrics")).text
    return report(args, outcomes, elapsed, metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="omni-tiny/toy")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--voice", default=None, help="audio voice (default: the model's)")
    parser.add_argument("--stage-params", default=None, metavar="JSON", help='per-stage parameters, e.g. \'{"talker": {"max_tokens": 48}}\'')
    parser.add_argument("--variants", type=int, default=0, help="distinct prompts (default: 2 x clients)")
    parser.add_argument("--audio-atol", type=float, default=2e-3, help="largest sample difference from the prompt run alone")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.OPTION=VALUE", help="deploy override for the started server")
    parser.add_argument("--url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    if args.url:
        print(asyncio.run(run(args, args.url.rstrip("/"))))
        return
    server_args = [arg for override in args.overrides for arg in ("--set", override)]
    print(f"starting omni serve {args.model} ...", flush=True)
    server = LiveServer.start(args.model, args=server_args, api_key=args.api_key)
    try:
        print(asyncio.run(run(args, server.url)))
    finally:
        server.close()


if __name__ == "__main__":
    main()
