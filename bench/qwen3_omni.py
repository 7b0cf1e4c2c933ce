"""Qwen3-Omni serving: Omni vs the transformers reference, text in, text + audio out (not a test).

Both serve the same prompts, greedy, with fixed lengths: the thinker writes exactly
``--thinker-tokens`` tokens and the talker exactly ``--talker-tokens`` codec tokens (Omni: vLLM
``min_tokens = max_tokens``; the reference: ``min_new_tokens = max_new_tokens``), so both produce
the same amount of text and audio per request.

- Omni: `AsyncOmni` on the family's default deploy (three stage processes, shm, streaming), plus
  any ``--set STAGE.OPTION=VALUE`` overrides; `concurrency` clients in a closed loop.
- Reference: ``Qwen3OmniMoeForConditionalGeneration.generate`` in this process, one request at a
  time, the way a transformers user serves it: a single worker that the same `concurrency`
  clients queue for. It returns everything at the end, so its TTFT and TTFP equal its E2EL.
- The two run level by level, alternately and never at once (the machine may be shared).
- Before measuring, one unmeasured wave of Omni at each concurrency level (measured here, the
  first concurrency-8 wave's TTFP was 10-25% above the later ones: one-time work for a new batch
  size, presumably kernel setup for its shapes), and one request of the reference.
- `--rounds` times over (default 3): every round runs every level of both systems again. A level of
  Omni lasts a few seconds, so one slow phase of a shared machine moves a single measurement by
  20% or more; each ratio is taken within a round (both systems measured in the same minutes) and
  the median over rounds is reported, with every round's value.

Per concurrency level: TTFT (first text token), TTFP (first audio packet), E2EL (p50 over
requests, seconds, from the client's submit, queueing included), RTF (E2EL / audio seconds, mean)
and throughput (audio seconds produced per wall second), each the median over rounds, with
Omni/reference ratios. The goals checked at the end: throughput >= 10x the reference at the
highest concurrency; TTFP at concurrency 1 <= 1/10 of the reference's E2EL there; TTFP at 8 <= 2x
TTFP at 1.

    python bench/qwen3_omni.py [--size bench] [--concurrency 1 8 16] [--requests N] [--rounds 3]
                               [--thinker-tokens 64] [--talker-tokens 64] [--set code2wav.chunk_size=25]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs

PROMPTS = [
    "Hello world, what is this?",
    "Describe the picture in a few words.",
    "What is the sound you hear in this audio?",
    "Tell me about the water and the people.",
    "How many words can you find in this sentence?",
    "Listen and answer the question: who was there first?",
    "What did they make with the long little time?",
    "Say something helpful about the world.",
]


@attrs.define
class Sample:
    """One request's timings (seconds from the client's submit) and its audio length."""

    ttft: float
    ttfp: float
    e2el: float
    audio_s: float


@attrs.define
class Level:
    """One system at one concurrency level."""

    system: str
    concurrency: int
    samples: list[Sample]
    wall_s: float

    def p50(self, field: str) -> float:
        return statistics.median(getattr(s, field) for s in self.samples)

    @property
    def rtf(self) -> float:
        return statistics.mean(s.e2el / s.audio_s for s in self.samples)

    @property
    def throughput(self) -> float:
        return sum(s.audio_s for s in self.samples) / self.wall_s


@attrs.define
class Round:
    """Every level of both systems, measured once."""

    omni: list[Level]
    reference: list[Level]


async def closed_loop(concurrency: int, requests: int, one: Callable[[int], Awaitable[Sample]]) -> tuple[list[Sample], float]:
    """`concurrency` clients send `requests` requests in total, each the next when its last ends."""
    todo = list(range(requests))
    samples: list[Sample] = []

    async def client() -> None:
        while todo:
            samples.append(await one(todo.pop(0)))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


# -- Omni ------------------------------------------------------------------------------------------


def omni_client(omni: Any, args: argparse.Namespace) -> Callable[[int], Awaitable[Sample]]:
    """One Omni request (a running `AsyncOmni`), timed from the client's side."""
    from omni_core.engine.request import OmniRequest

    params = {
        "thinker": {"max_tokens": args.thinker_tokens, "min_tokens": args.thinker_tokens, "temperature": 0.0},
        "talker": {"max_tokens": args.talker_tokens, "min_tokens": args.talker_tokens, "temperature": 0.0},
    }

    async def one(i: int) -> Sample:
        request = OmniRequest(prompt=PROMPTS[i % len(PROMPTS)], modalities=("text", "audio"), params=params)
        start = time.perf_counter()
        ttft = ttfp = None
        samples, rate = 0, 24000
        async for delta in omni.generate(request):
            now = time.perf_counter() - start
            if delta.modality == "text" and delta.data.get("token_ids") and ttft is None:
                ttft = now
            audio = delta.data.get("audio")
            if delta.modality == "audio" and audio is not None and len(audio):
                ttfp = now if ttfp is None else ttfp
                samples += len(audio)
                rate = int(delta.data.get("sample_rate") or rate)
        e2el = time.perf_counter() - start
        if ttft is None or ttfp is None:
            raise RuntimeError(f"request {i} produced no {'text' if ttft is None else 'audio'}")
        return Sample(ttft, ttfp, e2el, samples / rate)

    return one


def reference_client(model_dir: Path, args: argparse.Namespace) -> Callable[[int], Awaitable[Sample]]:
    """One request to the transformers reference: a single worker, one generate at a time."""
    import torch

    from omni_qwen3.reference import load_model, prepare_inputs

    model = load_model(model_dir)
    config = model.config
    gate = asyncio.Lock()  # one generate at a time: the way transformers serves

    def generate(prompt: str) -> float:
        inputs = prepare_inputs(model_dir, [{"role": "user", "content": prompt}])
        with torch.inference_mode():
            _, waveform = model.generate(
                **inputs,
                return_audio=True,
                speaker="Ethan",
                thinker_max_new_tokens=args.thinker_tokens,
                thinker_min_new_tokens=args.thinker_tokens,
                thinker_do_sample=False,
                thinker_repetition_penalty=1.0,
                thinker_eos_token_id=config.im_end_token_id,
                talker_max_new_tokens=args.talker_tokens,
                talker_min_new_tokens=args.talker_tokens,
                talker_do_sample=False,
                talker_repetition_penalty=1.0,
            )
        return waveform.numel() / 24000

    async def one(i: int) -> Sample:
        start = time.perf_counter()
        async with gate:
            audio_s = await asyncio.to_thread(generate, PROMPTS[i % len(PROMPTS)])
        e2el = time.perf_counter() - start
        return Sample(e2el, e2el, e2el, audio_s)  # everything arrives at the end

    return one


async def bench(model_dir: Path, args: argparse.Namespace) -> list[Round]:
    """Both systems, level by level, one after the other (never at the same time), `args.rounds` times.

    Alternating per level keeps the comparison fair on a shared machine whose load drifts; the
    Omni engine stays up (idle) while the reference runs.
    """
    from omni_core.engine.offline import AsyncOmni

    rounds: list[Round] = []
    async with AsyncOmni(str(model_dir), overrides=tuple(args.set)) as omni:
        systems = {"omni": omni_client(omni, args), "transformers": reference_client(model_dir, args)}
        for one in systems.values():
            await one(0)  # warm up (first-request work, lazy loads)
        for concurrency in args.concurrency:
            # Omni's first batch of each size is slower (one-time work for its shapes): one
            # unmeasured wave per level, as serving benchmarks warm up. (The reference runs one
            # request at a time: its shapes never change.)
            await closed_loop(concurrency, concurrency, systems["omni"])
        for number in range(1, args.rounds + 1):
            current = Round([], [])
            for concurrency in args.concurrency:
                for system, one in systems.items():
                    samples, wall = await closed_loop(concurrency, requests_for(concurrency, args), one)
                    (current.omni if system == "omni" else current.reference).append(Level(system, concurrency, samples, wall))
                    print(f"round {number}/{args.rounds}, {system} c={concurrency}: {len(samples)} requests in {wall:.1f} s", flush=True)
            rounds.append(current)
    return rounds


def requests_for(concurrency: int, args: argparse.Namespace) -> int:
    return args.requests or max(concurrency, 4)


# -- report ----------------------------------------------------------------------------------------


def median_level(levels: list[Level]) -> dict[str, float]:
    """A level's figures, each the median over rounds."""
    figures = {field: statistics.median(level.p50(field) for level in levels) for field in ("ttft", "ttfp", "e2el")}
    figures["rtf"] = statistics.median(level.rtf for level in levels)
    figures["throughput"] = statistics.median(level.throughput for level in levels)
    return figures


def table(rounds: list[Round]) -> str:
    rows = [
        "| concurrency | system | TTFT p50 s | TTFP p50 s | E2EL p50 s | RTF | audio s/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for i, level in enumerate(rounds[0].omni):
        mine = median_level([r.omni[i] for r in rounds])
        ref = median_level([r.reference[i] for r in rounds])
        for system, figures in (("omni", mine), ("transformers", ref)):
            rows.append(
                f"| {level.concurrency} | {system} | {figures['ttft']:.2f} | {figures['ttfp']:.2f} | "
                f"{figures['e2el']:.2f} | {figures['rtf']:.2f} | {figures['throughput']:.2f} |"
            )
        rows.append(
            f"| {level.concurrency} | ratio omni/ref | {mine['ttft'] / ref['ttft']:.3f} | {mine['ttfp'] / ref['ttfp']:.3f} | "
            f"{mine['e2el'] / ref['e2el']:.3f} | {mine['rtf'] / ref['rtf']:.3f} | {mine['throughput'] / ref['throughput']:.2f}x |"
        )
    return "\n".join(rows)


def goals(rounds: list[Round]) -> list[str]:
    """Each goal's ratio within every round (both systems in the same minutes), then the median."""

    def verdict(name: str, values: list[float], goal: str, met: Callable[[float], bool], unit: str = "", digits: int = 2) -> str:
        median = statistics.median(values)
        each = ", ".join(f"{v:.{digits}f}{unit}" for v in values)
        return f"{name}: {median:.{digits}f}{unit} (rounds: {each}; goal {goal}): {'met' if met(median) else 'NOT met'}"

    def by_c(levels: list[Level]) -> dict[int, Level]:
        return {level.concurrency: level for level in levels}

    measured = by_c(rounds[0].omni)  # the same concurrencies in every round
    top, low = max(measured), min(measured)
    out = [
        verdict(
            f"throughput at concurrency {top} / the reference",
            [by_c(r.omni)[top].throughput / by_c(r.reference)[top].throughput for r in rounds],
            ">= 10x", lambda v: v >= 10, "x",
        ),
        verdict(
            f"TTFP at concurrency {low} / reference E2EL",
            [by_c(r.omni)[low].p50("ttfp") / by_c(r.reference)[low].p50("e2el") for r in rounds],
            "<= 0.1", lambda v: v <= 0.1, digits=3,
        ),
    ]
    if 1 in measured and 8 in measured:
        out.append(
            verdict(
                "TTFP at concurrency 8 / at 1",
                [by_c(r.omni)[8].p50("ttfp") / by_c(r.omni)[1].p50("ttfp") for r in rounds],
                "<= 2", lambda v: v <= 2,
            )
        )
    return out


def checkpoint(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from omni_qwen3.tiny import make_tiny

    directory = Path(args.cache) / f"qwen3-omni-{args.size}"
    if not (directory / "config.json").exists():
        print(f"writing a {args.size}-size random-weight checkpoint to {directory}", flush=True)
        make_tiny(directory, args.size)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="bench", help="make_tiny size of the random checkpoint (bench or tiny)")
    parser.add_argument("--model", default=None, help="an existing Qwen3-Omni checkpoint directory instead")
    parser.add_argument("--cache", default="/tmp/omni-bench-qwen3-omni", help="where the random checkpoint is written")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--requests", type=int, default=None, help="requests per level (default: max(concurrency, 4))")
    parser.add_argument("--rounds", type=int, default=3, help="times every level of both systems is measured (medians are reported)")
    parser.add_argument("--thinker-tokens", type=int, default=64)
    parser.add_argument("--talker-tokens", type=int, default=64, help="codec tokens (frames + 1; 12.5 frames a second)")
    parser.add_argument("--set", action="append", default=[], metavar="STAGE.OPTION=VALUE", help="Omni deploy overrides")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    model_dir = checkpoint(args)
    started = time.perf_counter()
    rounds = asyncio.run(bench(model_dir, args))
    print()
    print(f"Qwen3-Omni ({args.size}, {model_dir}); thinker {args.thinker_tokens} tokens, talker {args.talker_tokens} "
          f"codec tokens, greedy; overrides {args.set or 'none'}; {args.rounds} rounds; {time.perf_counter() - started:.0f} s in all")
    print("The reference returns everything at the end: its TTFT and TTFP are its E2EL. Figures: medians over rounds.")
    print()
    print(table(rounds))
    print()
    for line in goals(rounds):
        print("- " + line)


if __name__ == "__main__":
    main()
