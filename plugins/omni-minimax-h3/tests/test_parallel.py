"""The MiniMax-H3 dit stage over two gloo ranks on CPU (the ``parallel`` option): Ulysses gives the
video and sound one process gives, for a request alone, for three together (one from a keyframe)
whose rows do not all split evenly, joined midway by a fourth, and with the first-block cache,
whose decisions must be the single process's even where a threshold sits next to the measured
change; ``cfg`` is refused, as the checkpoint is guidance-distilled (no unconditional branch to
put on a second rank)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from omni_core.config import resolve
from omni_core.errors import ConfigError
from omni_core.outputs import StageInput
from omni_core.stages.diffusion import DiffusionStageRuntime
from omni_core.stages.diffusion_cache import CacheConfig, CacheState
from omni_minimax_h3.reference import request, stage_inputs

from .test_equality import keyframe

pytestmark = pytest.mark.timeout(600)

MODEL = "omni-tiny/minimax-h3"

ALONE = {"apple": request("a red apple on a wooden table", seed=1, steps=3)}
TOGETHER = {
    "dog": request("a dog runs on the beach while seagulls fly over the sea", seed=2, steps=5),
    "rain": request("rain", seed=3, steps=3),
    "drums": request("a drummer plays a fast beat", seed=4, steps=4, image=keyframe(48, 32, 1)),  # fl2va: conditioning rows
}
LATER = {"late": request("a boat on a lake", seed=5, steps=3)}  # joins the running batch at its second step
# The same cached request twice, its threshold just under and just over its first measured change
# (`inputs`): one computes that step, the other skips it; beside a request without the cache. The
# ranks measure the change within 2e-7 of one process; counting their padding would be 2e-5 off.
PROBE = request("a cat sleeps on a sofa", seed=6, steps=8)
CACHED = {"below": 1 - 5e-6, "above": 1 + 5e-6}
PLAIN = {"plain": request("a bird sings", seed=7, steps=3)}


@pytest.fixture(scope="module")
def inputs(processor, encoder, dit) -> dict[str, StageInput]:
    items = stage_inputs(processor, encoder, {**ALONE, **TOGETHER, **LATER, **PLAIN, "probe": PROBE})
    probe = items.pop("probe")
    change = first_change(dit, probe)
    for rid, factor in CACHED.items():
        items[rid] = StageInput(data=probe.data, params={**probe.params, "cache": {"mode": "first_block", "threshold": change * factor}})
    return items


def first_change(dit: DiffusionStageRuntime, item: StageInput) -> float:
    """The first relative change of the request's first-block output the cache weighs, in one process."""
    (sample,) = dit.model.prepare("probe", dict(item.data), dict(item.params))
    sample.cache = CacheState(CacheConfig(mode="first_block", threshold=float("inf")))
    dit.model.start([sample])
    while not sample.cache.skipped_steps:  # no threshold: the first step that may skip does
        dit.model.denoise([sample])
        sample.step += 1
    return sample.cache.accumulated[0]


def make_runtime(pipeline, **options: Any) -> DiffusionStageRuntime:
    stage = pipeline.stage("dit")
    runtime = DiffusionStageRuntime(pipeline, attrs.evolve(stage, options={**stage.options, "admission_window_ms": 0.0, **options}))
    runtime.load()
    return runtime


def run(runtime: DiffusionStageRuntime, inputs: dict[str, StageInput], rids: Any, joins: dict[int, Any] | None = None) -> dict[str, dict]:
    """Add `rids`' inputs, step until done (adding `joins[k]`' before step k), return the final payloads."""
    for rid in rids:
        runtime.add_request(rid, inputs[rid])
    outputs: dict[str, dict] = {}
    step = 0
    while runtime.has_unfinished() or (joins and any(k >= step for k in joins)):
        for rid in (joins or {}).get(step, ()):
            runtime.add_request(rid, inputs[rid])
        for chunk in runtime.step():
            assert chunk.error is None, chunk.error
            if chunk.final:
                outputs[chunk.request_id] = chunk.data
        step += 1
    return outputs


def run_all(runtime: DiffusionStageRuntime, inputs: dict[str, StageInput]) -> dict[str, dict]:
    outputs = run(runtime, inputs, ALONE)
    outputs |= run(runtime, inputs, TOGETHER, joins={1: LATER})
    outputs |= run(runtime, inputs, [*CACHED, *PLAIN])
    return outputs


@pytest.fixture(scope="module")
def single(dit, inputs) -> dict[str, dict]:
    return run_all(dit, inputs)


def packed_rows(dit: DiffusionStageRuntime, item: StageInput) -> int:
    """A request's rows in the packed sequence (text, video and audio): what Ulysses splits."""
    params = {name: value for name, value in item.params.items() if name != "cache"}  # the runtime's, not the model's
    (sample,) = dit.model.prepare("rows", dict(item.data), params)
    dit.model.start([sample])
    return int(sample.state.values["position_ids"].shape[0])


def test_ulysses_over_two_ranks_gives_the_outputs_of_one_process(pipeline, dit, inputs, single) -> None:
    rows = {rid: packed_rows(dit, inputs[rid]) for rid in (*TOGETHER, "below")}
    # Shares of different sizes in one forward, padded ones among them, and a padded share in the cache.
    together = [rows[rid] for rid in TOGETHER]
    assert any(n % 2 for n in together) and len(set(together)) == len(together) and rows["below"] % 2, rows
    runtime = make_runtime(pipeline, parallel={"ulysses": 2})
    try:
        assert [r["device"] for r in runtime.health_stats()["ranks"]] == ["cpu", "cpu"]
        assert runtime.model.parallel.ulysses == 2
        outputs = run_all(runtime, inputs)
        assert runtime.batch_sizes[:4] == [1, 1, 3, 4]  # alone (two steps), then the three, then with the one that joined
    finally:
        runtime.close()
    assert set(outputs) == set(single)
    for rid, expected in single.items():
        got = outputs[rid]
        assert got["video"].shape == expected["video"].shape, rid
        assert np.abs(got["video"].astype(int) - expected["video"].astype(int)).max() <= 1, rid
        np.testing.assert_allclose(got["audio"], expected["audio"], atol=1e-4, err_msg=rid)
    # The two thresholds took different decisions, and the ranks took the single process's.
    assert single["above"]["cache"]["skipped_steps"] > 0 and not np.array_equal(single["above"]["video"], single["below"]["video"])
    for rid in CACHED:
        assert outputs[rid]["cache"] == single[rid]["cache"], rid


def test_cfg_parallel_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"does not support cfg parallelism \(it supports: ulysses\)") as info:
        resolve(MODEL, overrides=["dit.options.parallel.cfg=2"])
    assert info.value.key == "stages.dit.options.parallel"


def test_ulysses_the_heads_do_not_split_over_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"ulysses 4 does not divide the 2 attention heads of transformer/config.json") as info:
        resolve(MODEL, overrides=["dit.options.parallel.ulysses=4"])
    assert info.value.key == "stages.dit.options.parallel"
