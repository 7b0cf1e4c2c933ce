"""Qwen3-Omni on two simulated Ray nodes over Mooncake vs the single-host run (not a test).

One machine, a Ray cluster of two raylets (`omni_core.testing.ray_cluster`): the shipped
``omni_qwen3:deploy/two-nodes.yaml`` puts the thinker on node a and the talker + code2wav on node
b, with thinker -> talker and the output over a Mooncake connector (``--connectors``, each its own
system). The baseline is the family's default deploy on the same machine: three stage processes,
shared memory. All systems stay up together and run level by level, one after the other, never
at once; each round measures every system again and ratios are taken within a round (the median
and the spread over rounds are reported). Requests as in ``bench/qwen3_omni.py`` (whose client
and closed loop this reuses): greedy, fixed lengths, text + audio.

Goal: throughput (audio seconds per wall second) at concurrency 16 on two nodes >= 0.8x the
single-host run. The nodes share this machine's cores, so this measures what the placement and
the connectors cost, not what a second machine would add.

    python bench/qwen3_omni_nodes.py [--size bench] [--concurrency 16] [--rounds 3] [--connectors mooncake-store mooncake-te]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path

from qwen3_omni import Level, checkpoint, closed_loop, omni_client, requests_for

DEPLOY = "omni_qwen3:deploy/two-nodes.yaml"
GOAL = 0.8


async def bench(model_dir: Path, args: argparse.Namespace, address: str) -> dict[str, list[Level]]:
    from omni_core.engine.offline import AsyncOmni

    systems = {"single host (shm)": dict(overrides=tuple(args.set))}
    for connector in args.connectors:
        overrides = (
            *args.set,
            f"ray.address={address}",
            f"edge.thinker->talker.connector={connector}",
            f"output_connector.connector={connector}",
            *(f"{stage}.ray.num_cpus=0" for stage in ("thinker", "talker", "code2wav")),  # the nodes share the cores
        )
        systems[f"two nodes ({connector})"] = dict(deploy=DEPLOY, overrides=overrides)
    levels: dict[str, list[Level]] = {name: [] for name in systems}
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for name, settings in systems.items():
            omni = await stack.enter_async_context(AsyncOmni(str(model_dir), **settings))
            clients[name] = omni_client(omni, args)
            await clients[name](0)
            for concurrency in args.concurrency:  # one unmeasured wave per level (see qwen3_omni.py)
                await closed_loop(concurrency, concurrency, clients[name])
        for number in range(1, args.rounds + 1):
            for concurrency in args.concurrency:
                for name, one in clients.items():
                    samples, wall = await closed_loop(concurrency, requests_for(concurrency, args), one)
                    levels[name].append(Level(name, concurrency, samples, wall))
                    print(f"round {number}/{args.rounds}, {name} c={concurrency}: {len(samples)} requests in {wall:.1f} s", flush=True)
    return levels


def report(levels: dict[str, list[Level]], args: argparse.Namespace) -> list[str]:
    baseline = next(iter(levels))
    lines = [
        "| concurrency | system | audio s/s (median) | TTFP p50 s | E2EL p50 s | throughput / single host: median (per round) |",
        "|---:|---|---:|---:|---:|---|",
    ]
    verdicts = []
    for concurrency in args.concurrency:
        base = [lv for lv in levels[baseline] if lv.concurrency == concurrency]
        for name, runs in levels.items():
            mine = [lv for lv in runs if lv.concurrency == concurrency]
            ratios = [m.throughput / b.throughput for m, b in zip(mine, base)]
            ratio = statistics.median(ratios)
            lines.append(
                f"| {concurrency} | {name} | {statistics.median(lv.throughput for lv in mine):.2f} | "
                f"{statistics.median(lv.p50('ttfp') for lv in mine):.3f} | {statistics.median(lv.p50('e2el') for lv in mine):.2f} | "
                f"{ratio:.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) |"
            )
            if name != baseline and concurrency == max(args.concurrency):
                met = "met" if ratio >= GOAL else "NOT met"
                verdicts.append(f"{name}: throughput at concurrency {concurrency} {ratio:.2f}x the single host (goal >= {GOAL}x): {met}")
    return lines + [""] + [f"- {v}" for v in verdicts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="bench", help="make_tiny size of the random checkpoint (bench or tiny)")
    parser.add_argument("--model", default=None, help="an existing Qwen3-Omni checkpoint directory instead")
    parser.add_argument("--cache", default="/tmp/omni-bench-qwen3-omni")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16])
    parser.add_argument("--requests", type=int, default=None, help="requests per level (default: max(concurrency, 4))")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--thinker-tokens", type=int, default=64)
    parser.add_argument("--talker-tokens", type=int, default=64)
    parser.add_argument("--connectors", nargs="+", default=["mooncake-store", "mooncake-te"])
    parser.add_argument("--set", action="append", default=[], metavar="STAGE.OPTION=VALUE", help="deploy overrides for every system")
    args = parser.parse_args()
    from omni_core.testing.ray_cluster import simulated_cluster

    model_dir = checkpoint(args)
    started = time.perf_counter()
    with simulated_cluster(("a", "b")) as cluster:
        levels = asyncio.run(bench(model_dir, args, cluster.address))
    print()
    print(f"Qwen3-Omni ({args.size}, {model_dir}) on two simulated Ray nodes of one machine vs one host; thinker "
          f"{args.thinker_tokens} tokens, talker {args.talker_tokens} codec tokens, greedy; {args.rounds} rounds; "
          f"{time.perf_counter() - started:.0f} s in all")
    print()
    print("\n".join(report(levels, args)))


if __name__ == "__main__":
    main()
