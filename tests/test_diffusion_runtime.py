"""The diffusion runtime's own logic (admission, step batching, grouping, progress, n samples, abort),
the cache-parameter resolution and the quantization resolvers.

The runtime's scheduling is tested with a counting model part (no weights: the logic is the core's);
equality with diffusers on a real checkpoint is in ``plugins/omni-cosmos3/tests``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import pytest
import torch

from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.errors import ConfigError, InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.parts import PartContext
from omni_core.quantization import _fp8_supported, quantize_linears, resolve_fp8, resolve_int8
from omni_core.stages.diffusion import DiffusionStageRuntime
from omni_core.stages.diffusion_cache import CacheConfig, resolve_cache
from omni_core.stages.diffusion_model import DiffusionModel, DiffusionSample, LoadSpec


class CountingModel(DiffusionModel):
    """Each sample's state counts the steps it got; `calls` records every forward's (key, steps)."""

    max_steps = 50
    load_options = frozenset({"quantization"})  # (declared, not applied: what resolve() checks)

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.calls: list[tuple[Any, list[int]]] = []
        self.started: list[str] = []

    def load(self, spec: LoadSpec) -> None:
        self.spec = spec

    def prepare(self, request_id: str, data: dict[str, Any], params: dict[str, Any]) -> list[DiffusionSample]:
        if data.get("size") == "bad":
            raise InvalidRequestError("bad size", param="size")
        steps = params.get("num_inference_steps", 3)
        return [
            DiffusionSample(request_id, i, steps, data.get("size", 1), state={"steps": 0}, tokens=data.get("tokens", 0))
            for i in range(data.get("n", 1))
        ]

    def start(self, samples: list[DiffusionSample]) -> None:
        self.started += [s.request_id for s in samples]

    def denoise(self, samples: list[DiffusionSample]) -> None:
        assert len({s.batch_key for s in samples}) == 1
        self.calls.append((samples[0].batch_key, [s.step for s in samples]))
        for s in samples:
            s.state["steps"] += 1

    def decode(self, samples: list[DiffusionSample]) -> list[dict[str, Any]]:
        return [{"image": torch.full((2, 2, 3), s.state["steps"] * 10 + s.index, dtype=torch.uint8).numpy()} for s in samples]


def make_runtime(streaming: bool = True, **options: Any) -> DiffusionStageRuntime:
    stage = ResolvedStage(
        name="gen", kind="diffusion", runtime_ref="omni_core.stages.diffusion:DiffusionStageRuntime",
        model="tests:CountingModel", output="image", final=True,
        placement="inline", options={"admission_window_ms": 0.0, **options},
    )
    pipeline = ResolvedPipeline(model="m", model_path="/nonexistent", family="test", stages=(stage,), streaming=streaming)
    runtime = DiffusionStageRuntime(pipeline, stage)
    # This test module is not importable by reference (pytest's importlib mode): attach the part
    # as `load()` would after building it. `load()` itself runs in the Cosmos3 plugin's tests.
    runtime.model = CountingModel(PartContext(pipeline, stage))
    return runtime


def drain(runtime: DiffusionStageRuntime, limit: int = 100) -> list:
    chunks = []
    for _ in range(limit):
        if not runtime.has_unfinished():
            break
        chunks += runtime.step()
    return chunks


def test_requests_share_steps_grouped_by_key_and_new_ones_join_at_their_own_step():
    runtime = make_runtime()
    model: CountingModel = runtime.model  # type: ignore[assignment]
    runtime.add_request("a", StageInput({"size": 1}, params={"num_inference_steps": 4}))
    runtime.add_request("b", StageInput({"size": 2}, params={"num_inference_steps": 2}))
    runtime.step()
    runtime.add_request("c", StageInput({"size": 1}, params={"num_inference_steps": 2}))
    chunks = drain(runtime)
    assert model.calls[:2] == [(1, [0]), (2, [0])]  # different keys: separate forwards
    assert (1, [1, 0]) in model.calls  # "c" joined "a" at its step 0 while "a" was at step 1
    finals = {c.request_id: c.data["image"][0, 0, 0] for c in chunks if c.final}
    assert finals == {"a": 40, "b": 20, "c": 20}


def test_progress_chunks_then_one_final_chunk_with_consistent_indexes():
    runtime = make_runtime()
    runtime.add_request("a", StageInput({}, params={"num_inference_steps": 3}))
    chunks = drain(runtime)
    assert [c.data.get("progress") for c in chunks[:-1]] == [{"step": 1, "total": 3}, {"step": 2, "total": 3}]
    assert [c.index for c in chunks] == [0, 1, 2] and chunks[-1].final and "image" in chunks[-1].data
    quiet = make_runtime(streaming=False)
    quiet.add_request("a", StageInput({}, params={"num_inference_steps": 3}))
    assert [c.final for c in drain(quiet)] == [True]
    terse = make_runtime(progress=False)  # one progress chunk only: the request started
    terse.add_request("a", StageInput({}, params={"num_inference_steps": 3}))
    assert [(c.data.get("progress"), c.final) for c in drain(terse)] == [({"step": 1, "total": 3}, False), (None, True)]


def test_n_samples_become_one_final_chunk_with_a_list():
    runtime = make_runtime(max_num_seqs=2)
    runtime.add_request("a", StageInput({"n": 3}, params={"num_inference_steps": 2}))
    finals = [c for c in drain(runtime) if c.final]
    assert len(finals) == 1 and [int(im[0, 0, 0]) for im in finals[0].data["image"]] == [20, 21, 22]
    assert max(len(steps) for _, steps in runtime.model.calls) == 2  # never more than max_num_seqs


def test_a_token_budget_starts_requests_in_arrival_order_while_they_fit():
    runtime = make_runtime(max_batch_tokens=100)
    model: CountingModel = runtime.model  # type: ignore[assignment]
    for name, tokens in (("a", 80), ("b", 80), ("c", 20), ("d", 500), ("e", 10)):
        runtime.add_request(name, StageInput({"tokens": tokens}, params={"num_inference_steps": 2}))
    finished = [c.request_id for c in drain(runtime) if c.final]
    # a alone (c fits beside it, but does not pass b); then b with c; d, over the budget, alone; then e
    assert model.started == ["a", "b", "c", "d", "e"] and finished == ["a", "b", "c", "d", "e"]
    assert [len(steps) for _, steps in model.calls] == [1, 1, 2, 2, 1, 1, 1, 1]
    waiting = make_runtime(max_batch_tokens=100, admission_window_ms=10_000.0)
    waiting.add_request("f", StageInput({"tokens": 100}, params={"num_inference_steps": 1}))
    assert [c.request_id for c in waiting.step()] == ["f"]  # it fills the budget: no waiting for company
    unlimited = make_runtime()
    for name in "abc":
        unlimited.add_request(name, StageInput({"tokens": 80}, params={"num_inference_steps": 2}))
    drain(unlimited)
    assert [len(steps) for _, steps in unlimited.model.calls] == [3, 3]


def test_admission_window_lets_requests_arriving_together_start_together():
    runtime = make_runtime(admission_window_ms=50.0)
    runtime.add_request("a", StageInput({}, params={"num_inference_steps": 1}))
    assert runtime.step() == [] and runtime.num_running == 0  # waiting for company
    runtime.add_request("b", StageInput({}, params={"num_inference_steps": 1}))
    deadline = time.monotonic() + 2
    while runtime.num_running == 0 and time.monotonic() < deadline and runtime.has_unfinished():
        chunks = runtime.step()
    assert runtime.model.calls[0] == (1, [0, 0]) and {c.request_id for c in chunks} == {"a", "b"}


def test_abort_frees_slots_and_bad_requests_start_nothing():
    runtime = make_runtime(max_num_seqs=1)
    runtime.add_request("a", StageInput({}, params={"num_inference_steps": 10}))
    runtime.add_request("b", StageInput({}, params={"num_inference_steps": 1}))
    runtime.step()
    runtime.abort_request("a")
    runtime.abort_request("unknown")  # ignored
    assert [c.request_id for c in drain(runtime) if c.final] == ["b"]
    with pytest.raises(InvalidRequestError) as info:
        runtime.add_request("c", StageInput({"size": "bad"}))
    assert info.value.param == "size"
    with pytest.raises(InvalidRequestError) as info:
        runtime.add_request("d", StageInput({}, params={"num_inference_steps": 51}))
    assert info.value.param == "num_inference_steps" and not runtime.has_unfinished()


def test_cache_parameter_resolution():
    default = CacheConfig(mode="none", threshold=0.2, warmup_steps=2)
    assert resolve_cache(default, None) == default
    assert resolve_cache(default, "first_block") == CacheConfig("first_block", 0.2, 2)
    assert resolve_cache(default, 0.5) == CacheConfig("first_block", 0.5, 2)
    assert resolve_cache(attrs.evolve(default, mode="first_block"), "off").mode == "none"
    assert resolve_cache(default, {"threshold": 0.05, "warmup_steps": 0}) == CacheConfig("first_block", 0.05, 0)
    for bad in ("sometimes", {"mode": "x"}, {"speed": 1}, -1.0, float("nan")):
        with pytest.raises(InvalidRequestError):
            resolve_cache(default, bad)
    # Typed: a string threshold or a fractional warmup is refused, naming the key (not truncated).
    for bad, param in (({"threshold": "0.5"}, "cache.threshold"), ({"warmup_steps": 1.5}, "cache.warmup_steps"), (float("inf"), "cache")):
        with pytest.raises(InvalidRequestError) as info:
            resolve_cache(default, bad)
        assert info.value.param == param


def test_quantization_resolvers_and_int8_linears_match_float(caplog):
    assert resolve_fp8("ar", {}) == {"quantization": "fp8"}
    assert resolve_fp8("diffusion", {})["method"] == "fp8"
    assert resolve_int8("diffusion", {})["method"] == "int8_weight_only"
    with pytest.raises(ConfigError):
        resolve_int8("ar", {})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128), torch.nn.Linear(128, 8))
    x = torch.randn(4, 128)
    expected = net(x)
    with caplog.at_level(logging.INFO, logger="omni_core.quantization"):
        assert quantize_linears(net, resolve_int8("diffusion", {})) == 2  # the 8-wide head stays float
    # The load says what was replaced and why the rest was not (a tiny model may have nothing to quantize).
    assert "int8_weight_only: 2 of 3 linear layers replaced (kept: 1 narrower than 64 features)" in caplog.text
    assert type(net[0]).__name__ == "Int8WeightOnlyLinear" and net[0].weight_int8.dtype == torch.int8
    got = net(x)
    assert torch.allclose(got, expected, atol=0.02 * expected.abs().max().item())
    assert not torch.equal(got, expected)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="int8"):
            quantize_linears(net, resolve_fp8("diffusion", {}))


def test_fp8_linear_scales_each_row_and_channel():
    # The layer's arithmetic, on an FP8 GPU or else torch's CPU _scaled_mm (quantize_linears itself
    # refuses fp8 without an FP8 GPU): a token row and an output channel 1e5x larger than the others must not cost the
    # others their precision. With one scale per tensor they do (measured: 35% and 51% of the
    # blocks' range); with a scale per row and per channel each block is within FP8's ~5%.
    from omni_core.quantization import _fp8_class

    device = "cuda" if _fp8_supported() else "cpu"
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64, device=device)
    with torch.no_grad():
        linear.weight[3] *= 1e5
    layer = _fp8_class().from_linear(linear)
    assert layer.weight_fp8.dtype == torch.float8_e4m3fn and layer.scale.shape == (1, 64)
    x = torch.randn(2, 8, 256, device=device)
    x[0, 5] *= 1e5
    with torch.no_grad():
        expected, got = linear(x).reshape(16, 64), layer(x)
    assert got.shape == x.shape[:-1] + (64,) and got.dtype == x.dtype
    got = got.reshape(16, 64)
    rows, cols = [r for r in range(16) if r != 5], [c for c in range(64) if c != 3]
    for block_rows, block_cols in ((rows, cols), ([5], cols), (rows, [3])):
        e, g = expected[block_rows][:, block_cols], got[block_rows][:, block_cols]
        assert ((g - e).abs().max() / e.abs().max()).item() < 0.08, (block_rows, block_cols)


@pytest.mark.skipif(not _fp8_supported(), reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)")
def test_fp8_linears_match_bf16_on_gpu():
    torch.manual_seed(0)
    L = torch.nn.Linear
    net = torch.nn.Sequential(L(1024, 4096), torch.nn.GELU(), L(4096, 1024), torch.nn.GELU(), L(1024, 8)).to("cuda", torch.bfloat16)
    x2, x3 = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16), torch.randn(2, 77, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = [net(x2), net(x3)]
        assert quantize_linears(net, resolve_fp8("diffusion", {})) == 2  # the 8-wide head stays bf16
        assert type(net[0]).__name__ == "FP8Linear" and net[0].weight_fp8.dtype == torch.float8_e4m3fn
        assert type(net[4]) is torch.nn.Linear
        got = [net(x2), net(x3)]
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == torch.bfloat16
        rel = ((g.float() - e.float()).abs().max() / e.float().abs().max()).item()
        print(f"fp8 vs bf16 {tuple(g.shape)}: max abs error / max abs output = {rel:.4f}")
        assert rel <= 0.08 and not torch.equal(g, e)  # two FP8 layers in a row
    # A column-major view (a transposed activation) must work too: _scaled_mm wants a row-major input.
    x = torch.randn(1, 1024, 32, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    with torch.no_grad():
        assert net(x).shape == (1, 32, 8)


def test_unknown_quantization_is_a_config_error():
    from omni_core.config.resolve import resolve_pipeline
    from omni_core.config.pipeline import PipelineConfig, StageSpec
    from omni_core.plugins import default_plugins

    pipeline = PipelineConfig(family="t", stages=(StageSpec("gen", "diffusion", f"{__name__}:CountingModel", output="image", extra_outputs=("video",), final=True),))
    resolved = resolve_pipeline(pipeline, model="m", model_path="/x", plugins=default_plugins(), deploy={"stages": {"gen": {"options": {"quantization": "int8", "cache": "first_block"}}}})
    assert resolved.modalities == ("image", "video")
    with pytest.raises(ConfigError, match="quantization"):
        resolve_pipeline(pipeline, model="m", model_path="/x", plugins=default_plugins(), deploy={"stages": {"gen": {"options": {"quantization": "int3"}}}})
    with pytest.raises(ConfigError, match="cache"):
        resolve_pipeline(pipeline, model="m", model_path="/x", plugins=default_plugins(), deploy={"stages": {"gen": {"options": {"cache": "teacache2"}}}})


def test_a_load_option_the_model_part_does_not_implement_is_refused():
    """`DiffusionModel.load_options`: a stage option that reaches `load` (quantization, compile,
    cuda_graphs, vae_tiling/vae_tile) and that the model part does not declare is a ConfigError at
    resolve naming the key, instead of an option silently ignored."""
    from omni_core.config.resolve import resolve_pipeline
    from omni_core.config.pipeline import PipelineConfig, StageSpec
    from omni_core.plugins import default_plugins

    pipeline = PipelineConfig(family="t", stages=(StageSpec("gen", "diffusion", f"{__name__}:CountingModel", output="image", final=True),))
    for option, value in (("compile", True), ("cuda_graphs", True), ("vae_tiling", True), ("vae_tile", 256)):
        with pytest.raises(ConfigError, match="does not implement") as refused:
            resolve_pipeline(pipeline, model="m", model_path="/x", plugins=default_plugins(), deploy={"stages": {"gen": {"options": {option: value}}}})
        assert refused.value.key == f"stages.gen.options.{'vae_tiling' if option == 'vae_tile' else option}"
        assert "(it applies quantization)" in str(refused.value)


def test_the_forward_record_stays_bounded_however_long_the_server_runs():
    from omni_core.stages.diffusion import BATCH_SIZES_KEPT

    runtime = make_runtime()
    for number in range(2 * BATCH_SIZES_KEPT // 20 + 2):  # one request after another, 20 forwards each
        runtime.add_request(f"r{number}", StageInput({"size": 1}, params={"num_inference_steps": 20}))
        drain(runtime)
    assert not runtime.has_unfinished()
    assert BATCH_SIZES_KEPT <= len(runtime.batch_sizes) <= 2 * BATCH_SIZES_KEPT and set(runtime.batch_sizes) == {1}


def test_a_model_part_that_loads_its_own_weights_refuses_share_model_with():
    """``share_model_with`` is refused at resolve, before anything loads: on a diffusion stage whose
    model part does not declare `DiffusionModel.takes_shared_model` (it would load its own copy
    anyway), and towards a stage whose runtime offers no model (`StageRuntime.shared_model`)."""
    from omni_core.config.pipeline import EdgeSpec, PipelineConfig, StageSpec
    from omni_core.config.resolve import resolve_pipeline
    from omni_core.plugins import default_plugins

    pipeline = PipelineConfig(family="t", stages=(
        StageSpec("first", "diffusion", f"{__name__}:CountingModel", output="image"),
        StageSpec("gen", "diffusion", f"{__name__}:CountingModel", inputs=(EdgeSpec("first"),), output="image", final=True),
    ))
    inline = {"first": {"placement": "inline"}, "gen": {"placement": "inline", "share_model_with": "first"}}
    with pytest.raises(ConfigError, match="'diffusion' runtime has no loaded model to share"):
        resolve_pipeline(pipeline, model="m", model_path="/x", plugins=default_plugins(), deploy={"stages": inline})
    text_first = attrs.evolve(pipeline, stages=(
        StageSpec("first", "ar", "omni_core.stages.ar_model:ARModel", output="text"), pipeline.stages[1],
    ))
    with pytest.raises(ConfigError, match="CountingModel.* loads its own weights") as info:
        resolve_pipeline(text_first, model="m", model_path="/x", plugins=default_plugins(), deploy={"stages": inline})
    assert info.value.key == "stages.gen.share_model_with"
