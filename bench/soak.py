"""Soak test of the HTTP server (not a test of the suite): hours of clients in minutes of CPU.

For each family, on its tiny checkpoint with the default deploy (a worker process per stage):

1. reference: each of a small fixed set of distinct prompts runs alone (greedy, or a fixed seed);
2. warm-up: the load below for ``--warmup`` seconds, then the resident memory (RSS) of the server
   and of every stage process is sampled;
3. soak: N clients send requests back to back, each renewed as it finishes, for ``--minutes``;
   every answer is compared with its prompt's reference (text, usage and audio for Qwen3-Omni
   streaming chat; the decoded pixels of images; the text of HunyuanImage-3.0's answers; the decoded
   frames and sound of MiniMax-H3's MP4s); RSS is sampled again once it drains;
4. kill: a few requests are started, the stage process is SIGKILLed, and the times from the kill to
   each failed request's error and to the stage serving a request again are measured.

- ``qwen3-omni``: 64 concurrent streaming text + audio chat requests, 30 min by default;
- ``cosmos3``: 8 concurrent image requests, 20 min by default;
- ``hunyuan-image3``: 8 concurrent requests of its three paths mixed (t2i, t2t, think_t2i with the
  dit reusing the ar stage's keys/values; both stages on one loaded model, in one process), 20 min;
- ``minimax-h3``: 4 concurrent video jobs (create, poll, download the MP4), 20 min.

Writes a markdown table to ``bench/results/soak-<date>.md`` (``soak-<date>-short.md`` when a
family ran for less than its default time) and exits non-zero on any error, mismatch, or RSS
growth above 10% in any process.

    python bench/soak.py [--family qwen3-omni --family cosmos3] [--minutes M] [--clients N] [--no-kill]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import io
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs
import httpx
import numpy as np

from omni_core.testing.live_server import LiveServer
from server_load import StreamResult, check, stream_chat  # bench/ is the script's own directory

RESULTS = Path(__file__).parent / "results"
MAX_RSS_GROWTH = 0.10
PROMPTS = (
    "Once upon a time there was a little robot",
    "The weather today is sunny with a gentle breeze",
    "Please describe the picture of a red apple",
    "She counted the stars at night, one by one",
    "A short poem about the sea and the wind",
    "Explain how a bicycle stays upright",
    "What do cats dream about at night?",
    "List three colours of the rainbow",
)


@attrs.frozen
class Family:
    """How to soak one family: its model, default load and stage to kill, and one request's check."""

    name: str
    model: str
    clients: int
    minutes: float
    kill_stage: str
    # (client, prompt index, reference or None) -> (result, problem or None); reference None: record it.
    request: Callable[[httpx.AsyncClient, int, Any], Awaitable[tuple[Any, str | None]]]
    # What the kill section keeps in the stage (default: `request`): one that runs long enough in
    # `kill_stage` that all of them are there at once.
    kill_request: Callable[[httpx.AsyncClient, int, Any], Awaitable[tuple[Any, str | None]]] | None = None


# -- Qwen3-Omni: streaming chat, text + audio ------------------------------------------------------

QWEN_FIELDS: dict[str, Any] = {
    "max_tokens": 16,
    "stage_params": {"thinker": {"temperature": 0.0}, "talker": {"temperature": 0.0, "max_tokens": 40}},
}


async def qwen_request(client: httpx.AsyncClient, k: int, reference: StreamResult | None) -> tuple[StreamResult, str | None]:
    result = await stream_chat(client, "omni-tiny/qwen3-omni", PROMPTS[k], QWEN_FIELDS, f"soak-{k}")
    if reference is None:
        return result, result.error or (None if result.done else "the stream ended without [DONE]")
    _, problem = check(result, reference, set(), audio_atol=2e-3)
    return result, problem


# -- Cosmos3: images ---------------------------------------------------------------------------------

COSMOS_FIELDS: dict[str, Any] = {"size": "32x32", "stage_params": {"generator": {"num_inference_steps": 4}}}


def _pixels(b64_png: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64_png))), dtype=np.int16)


def _image_problem(image: np.ndarray, reference: np.ndarray) -> str | None:
    if image.shape != reference.shape:
        return f"image {image.shape} != alone {reference.shape}"
    # Batched and alone forwards may round differently in float32: one 8-bit step at most.
    diff = int(np.abs(image - reference).max())
    return None if diff <= 1 else f"pixels differ from alone by up to {diff}"


async def cosmos_request(client: httpx.AsyncClient, k: int, reference: np.ndarray | None) -> tuple[np.ndarray | None, str | None]:
    body = {"model": "omni-tiny/cosmos3", "prompt": PROMPTS[k], "seed": k, **COSMOS_FIELDS}
    try:
        response = await client.post("/v1/images/generations", json=body)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}: {response.text[:300]}"
    image = _pixels(response.json()["data"][0]["b64_json"])
    return image, None if reference is None else _image_problem(image, reference)


# -- HunyuanImage-3.0: the three paths mixed (t2i on the dit alone, t2t on the ar alone, think_t2i
# through both, the dit reusing the ar stage's keys/values), one model loaded in one process -------

HUNYUAN = "omni-tiny/hunyuan-image3"
HUNYUAN_TASKS = ("t2i", "t2t", "think_t2i")


async def hunyuan_request(client: httpx.AsyncClient, k: int, reference: tuple[str | None, np.ndarray | None] | None) -> tuple[Any, str | None]:
    task = HUNYUAN_TASKS[k % len(HUNYUAN_TASKS)]
    messages = [{"role": "user", "content": PROMPTS[k]}]
    if task == "t2i":
        route, body = "/v1/images/generations", {"model": HUNYUAN, "prompt": PROMPTS[k], "seed": k, "size": "48x80", "num_inference_steps": 2}
    elif task == "t2t":
        route, body = "/v1/chat/completions", {"model": HUNYUAN, "messages": messages, "modalities": ["text"], "max_tokens": 16}
    else:
        route, body = "/v1/chat/completions", {
            "model": HUNYUAN, "messages": messages, "modalities": ["text", "image"], "max_tokens": 16,
            "stage_params": {"dit": {"seed": k, "num_inference_steps": 2}},
        }
    try:
        response = await client.post(route, json=body)
    except httpx.HTTPError as exc:
        return None, f"{task}: {type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return None, f"{task}: HTTP {response.status_code}: {response.text[:300]}"
    answer = response.json()
    text: str | None = None
    image: np.ndarray | None = None
    if task == "t2i":
        image = _pixels(answer["data"][0]["b64_json"])
    elif task == "t2t":
        text = answer["choices"][0]["message"]["content"]
    else:
        parts = answer["choices"][0]["message"]["content"]
        text = "".join(p["text"] for p in parts if p["type"] == "text")
        urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
        if len(urls) != 1:
            return (text, None), f"{task}: {len(urls)} images in the answer"
        image = _pixels(urls[0].split(",", 1)[1])
    if reference is None:
        return (text, image), None
    if text != reference[0]:
        return (text, image), f"{task}: text {text!r} != alone {reference[0]!r}"
    problem = None if image is None else _image_problem(image, reference[1])
    return (text, image), None if problem is None else f"{task}: {problem}"


async def hunyuan_long_request(client: httpx.AsyncClient, k: int, reference: Any) -> tuple[Any, str | None]:
    """think_t2i with a long reasoning and many steps (seconds in the ar stage): the kill section's."""
    body = {
        "model": HUNYUAN, "messages": [{"role": "user", "content": PROMPTS[k]}], "modalities": ["text", "image"], "max_tokens": 1000,
        "min_tokens": 1000, "stage_params": {"dit": {"seed": k, "num_inference_steps": 50}},
    }
    try:
        response = await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return response, None if response.status_code == 200 else f"HTTP {response.status_code}: {response.text[:300]}"


# -- MiniMax-H3: video jobs (OpenAI's Videos API: create, poll, download) --------------------------

MINIMAX = "omni-tiny/minimax-h3"


def _mp4_streams(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The decoded frames (int16 ``[T, H, W, 3]``) and sound (float32 ``[channels, N]``) of an MP4."""
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]).astype(np.int16)
    with av.open(io.BytesIO(data)) as container:
        sound = np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=-1).astype(np.float32)
    return frames, sound


async def minimax_video(client: httpx.AsyncClient, k: int, steps: int) -> tuple[bytes | None, str | None]:
    body = {"model": MINIMAX, "prompt": PROMPTS[k], "seconds": "5", "size": "32x32", "seed": k, "num_inference_steps": steps}
    try:
        created = await client.post("/v1/videos", json=body)
        if created.status_code != 200:
            return None, f"HTTP {created.status_code}: {created.text[:300]}"
        video_id = created.json()["id"]
        deadline = time.monotonic() + 600
        while (job := (await client.get(f"/v1/videos/{video_id}")).json())["status"] in ("queued", "in_progress"):
            if time.monotonic() > deadline:
                return None, f"job {video_id} still in progress after 600 s"
            await asyncio.sleep(0.05)
        if job["status"] != "completed":
            return None, f"job {job['status']}: {job.get('error')}"
        content = await client.get(f"/v1/videos/{video_id}/content")
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return (content.content, None) if content.status_code == 200 else (None, f"content: HTTP {content.status_code}")


async def minimax_request(client: httpx.AsyncClient, k: int, reference: tuple[np.ndarray, np.ndarray] | None) -> tuple[Any, str | None]:
    data, problem = await minimax_video(client, k, 2)
    if data is None:
        return None, problem
    frames, sound = _mp4_streams(data)
    if reference is None:
        return (frames, sound), None
    if frames.shape != reference[0].shape or sound.shape != reference[1].shape:
        return (frames, sound), f"video {frames.shape} / sound {sound.shape} != alone {reference[0].shape} / {reference[1].shape}"
    # Batched and alone may round differently in float32, which H.264 and AAC can spread a little.
    frame_diff = float(np.abs(frames - reference[0]).mean())
    sound_diff = float(np.abs(sound - reference[1]).max())
    return (frames, sound), None if frame_diff <= 1.0 and sound_diff <= 1e-2 else f"mean pixel diff {frame_diff:.2f}, max sound diff {sound_diff:.2g} from alone"


async def minimax_long_request(client: httpx.AsyncClient, k: int, reference: Any) -> tuple[Any, str | None]:
    """A job of 1,000 steps (seconds in the dit stage): the kill section's."""
    return await minimax_video(client, k, 1000)


FAMILIES = {
    "qwen3-omni": Family("qwen3-omni", "omni-tiny/qwen3-omni", 64, 30.0, "thinker", qwen_request),
    "cosmos3": Family("cosmos3", "omni-tiny/cosmos3", 8, 20.0, "generator", cosmos_request),
    "hunyuan-image3": Family("hunyuan-image3", HUNYUAN, 8, 20.0, "ar", hunyuan_request, hunyuan_long_request),
    "minimax-h3": Family("minimax-h3", MINIMAX, 4, 20.0, "dit", minimax_request, minimax_long_request),
}


# -- memory ----------------------------------------------------------------------------------------


def process_names(server: LiveServer) -> dict[int, str]:
    """pid -> a label: ``server``, ``stage <name>/<replica>`` (and its allocator), or the helper's command."""
    names = {server.process.pid: "server"}
    stages: dict[int, list[str]] = {}  # (stages sharing a model share a process)
    for replica in httpx.get(f"{server.url}/health", timeout=30).json()["replicas"]:
        if "pid" in replica:
            allocator = f", {replica['allocator']}" if "allocator" in replica else ""
            stages.setdefault(replica["pid"], []).append(f"{replica['stage']}/{replica['replica']}")
            names[replica["pid"]] = f"stage {' + '.join(stages[replica['pid']])}{allocator}"
    for proc in server.children():
        if proc.pid not in names:
            try:
                names[proc.pid] = f"helper {proc.pid} ({os.path.basename(proc.cmdline()[0]) if proc.cmdline() else '?'})"
            except Exception:
                continue
    return names


def rss(pids: list[int]) -> dict[int, int]:
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            out[pid] = 0
    return out


# -- load ------------------------------------------------------------------------------------------


@attrs.define
class Tally:
    requests: int = 0
    errors: int = 0
    mismatches: int = 0
    problems: list[str] = attrs.field(factory=list)


async def load(family: Family, client: httpx.AsyncClient, references: list[Any], seconds: float, tally: Tally) -> None:
    deadline = time.monotonic() + seconds
    counter = iter(range(10**9))

    async def worker() -> None:
        while time.monotonic() < deadline:
            k = next(counter) % len(PROMPTS)
            result, problem = await family.request(client, k, references[k])
            tally.requests += 1
            if problem is not None:
                lost = result is None or getattr(result, "error", None) or not getattr(result, "done", True)
                if lost:
                    tally.errors += 1
                else:
                    tally.mismatches += 1
                if len(tally.problems) < 10:
                    tally.problems.append(f"prompt {k}: {problem}")

    await asyncio.gather(*(worker() for _ in range(family.clients)))


async def wait_healthy(url: str, timeout: float) -> float:
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while (await client.get("/health")).status_code != 200:
            if time.monotonic() - started > timeout:
                raise SystemExit(f"{url} was not healthy within {timeout:.0f} s")
            await asyncio.sleep(0.05)
    return time.monotonic() - started


async def kill_section(family: Family, server: LiveServer, references: list[Any], in_flight: int = 4) -> dict[str, float]:
    """SIGKILL the family's stage with `in_flight` requests running in it: seconds to each error, to
    /health 200, and to the first request answered correctly again."""
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(300.0)) as client:
        make = family.kill_request or family.request
        running = [asyncio.ensure_future(_timed(make(client, k % len(PROMPTS), references[k % len(PROMPTS)]))) for k in range(in_flight)]
        started = time.monotonic()
        while True:
            replicas = (await client.get("/health")).json()["replicas"]
            stage = next(r for r in replicas if r["stage"] == family.kill_stage)
            if stage.get("active_requests", 0) >= in_flight or time.monotonic() - started > 60:
                break
            await asyncio.sleep(0.01)
        os.kill(stage["pid"], signal.SIGKILL)
        killed = time.monotonic()
        outcomes = await asyncio.gather(*running)
        failed = [done - killed for done, (_, problem) in outcomes if problem is not None]
        await wait_healthy(server.url, 300)
        healthy = time.monotonic() - killed
        while True:
            _, problem = await family.request(client, 0, references[0])
            if problem is None:
                break
            if time.monotonic() - killed > 300:
                raise SystemExit(f"{family.name}: no correct answer within 300 s of the kill: {problem}")
        serving = time.monotonic() - killed
    return {
        "in_flight": in_flight,
        "failed": len(failed),
        "first_error_s": min(failed) if failed else float("nan"),
        "last_error_s": max(failed) if failed else float("nan"),
        "healthy_s": healthy,
        "serving_s": serving,
    }


async def _timed(work: Awaitable[tuple[Any, str | None]]) -> tuple[float, tuple[Any, str | None]]:
    result = await work
    return time.monotonic(), result


async def soak(family: Family, server: LiveServer, minutes: float, warmup: float, kill: bool) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=family.clients + 8, max_keepalive_connections=family.clients + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        references = []
        for k in range(len(PROMPTS)):
            reference, problem = await family.request(client, k, None)
            if problem is not None:
                raise SystemExit(f"{family.name}: prompt {k} alone failed: {problem}")
            references.append(reference)
        print(f"{family.name}: {len(PROMPTS)} references recorded; warming up for {warmup:.0f} s", flush=True)
        await load(family, client, references, warmup, Tally())
        names = process_names(server)
        start_rss = rss(list(names))
        tally = Tally()
        started = time.monotonic()
        print(f"{family.name}: soaking with {family.clients} clients for {minutes:g} min", flush=True)
        # Midway too: growth that stops after the first half is warm-up, growth in both halves a leak.
        await load(family, client, references, minutes * 30, tally)
        mid_rss = rss(list(names))
        await load(family, client, references, minutes * 30, tally)
        elapsed = time.monotonic() - started
        end_rss = rss(list(names))
    timings = await kill_section(family, server, references) if kill else None
    return {"tally": tally, "elapsed": elapsed, "names": names, "start": start_rss, "mid": mid_rss, "end": end_rss, "kill": timings}


def report(family: Family, minutes: float, warmup: float, outcome: dict[str, Any]) -> tuple[str, bool]:
    tally: Tally = outcome["tally"]
    lines = [
        f"### {family.model}: {family.clients} concurrent clients, {minutes:g} min (after {warmup:.0f} s of warm-up)",
        "",
        "| requests | req/s | errors | mismatches |",
        "|---:|---:|---:|---:|",
        f"| {tally.requests} | {tally.requests / outcome['elapsed']:.2f} | {tally.errors} | {tally.mismatches} |",
        "",
        "| process | RSS start (MiB) | RSS midway (MiB) | RSS end (MiB) | growth | growth in the second half |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for pid, name in sorted(outcome["names"].items(), key=lambda item: item[1]):
        start, mid, end = outcome["start"][pid], outcome["mid"][pid], outcome["end"][pid]
        growth = (end - start) / start if start else float("nan")
        second = (end - mid) / mid if mid else float("nan")
        worst = max(worst, growth if start and end else 0.0)
        lines.append(f"| {name} (pid {pid}) | {start / 2**20:.0f} | {mid / 2**20:.0f} | {end / 2**20:.0f} | {growth:+.1%} | {second:+.1%} |")
    if tally.problems:
        lines += ["", "First problems:", *(f"- {p}" for p in tally.problems)]
    timings = outcome["kill"]
    if timings is not None:
        lines += [
            "",
            f"SIGKILL of stage `{family.kill_stage}` with {timings['in_flight']} requests in it:",
            "",
            "| requests failed | kill -> first error (s) | kill -> last error (s) | kill -> /health 200 (s) | kill -> next answer (s) |",
            "|---:|---:|---:|---:|---:|",
            f"| {timings['failed']}/{timings['in_flight']} | {timings['first_error_s']:.2f} | {timings['last_error_s']:.2f} "
            f"| {timings['healthy_s']:.1f} | {timings['serving_s']:.1f} |",
        ]
    ok = tally.errors == 0 and tally.mismatches == 0 and worst <= MAX_RSS_GROWTH
    if timings is not None:
        ok = ok and timings["failed"] == timings["in_flight"] and timings["last_error_s"] <= 5.0
    lines += ["", f"Result: {'pass' if ok else 'FAIL'} (no error, no mismatch, RSS growth <= {MAX_RSS_GROWTH:.0%} per process"
              + (", every killed request failed within 5 s)" if timings is not None else ")")]
    return "\n".join(lines), ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: every family")
    parser.add_argument("--minutes", type=float, default=None, help="soak length (default: 30 for qwen3-omni, 20 for the others)")
    parser.add_argument("--clients", type=int, default=None, help="concurrent clients (default: 64 for qwen3-omni, 4 for minimax-h3, 8 for the others)")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the first RSS sample")
    parser.add_argument("--no-kill", dest="kill", action="store_false", help="skip the SIGKILL timings")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a deploy override for omni serve (e.g. code2wav.keep_freed_memory=false); repeatable")
    parser.add_argument("--out", type=Path, default=None, help="the markdown file (default: bench/results/soak-<date>[-short].md)")
    args = parser.parse_args()

    sections, passed, short = [], True, False
    for name in args.family or sorted(FAMILIES, reverse=True):
        family = FAMILIES[name]
        if args.clients:
            family = attrs.evolve(family, clients=args.clients)
        minutes = args.minutes if args.minutes is not None else family.minutes
        short = short or minutes < family.minutes
        print(f"starting omni serve {family.model} ...", flush=True)
        server = LiveServer.start(family.model, args=[arg for item in args.overrides for arg in ("--set", item)], timeout=600)
        try:
            outcome = asyncio.run(soak(family, server, minutes, args.warmup, args.kill))
        finally:
            server.close()
        section, ok = report(family, minutes, args.warmup, outcome)
        print(section, flush=True)
        sections.append(section)
        passed = passed and ok

    date = datetime.date.today().isoformat()
    out = args.out or RESULTS / f"soak-{date}{'-short' if short else ''}.md"
    header = f"## Soak, {date}{' (short run: less than the default duration)' if short else ''}\n\n`python bench/soak.py {' '.join(sys.argv[1:])}`, CPU, {os.cpu_count()} cores\n"
    out.write_text(header + "\n" + "\n\n".join(sections) + "\n")
    print(f"written to {out}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
