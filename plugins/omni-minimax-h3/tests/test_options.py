"""The diffusion stage's deploy options on MiniMax-H3: int8 weight-only DiT linears, bfloat16 weights."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from omni_core.config import resolve
from omni_core.stages.diffusion import DiffusionStageRuntime
from omni_minimax_h3.reference import request, run_dit, stage_inputs

MODEL = "omni-tiny/minimax-h3"
INLINE = ("encoder.placement=inline", "dit.placement=inline", "dit.admission_window_ms=0")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.parametrize(("overrides", "layer_type", "min_psnr"), [(("dit.quantization=int8",), "Int8WeightOnlyLinear", 30.0), (("dit.dtype=bfloat16",), None, 20.0)])
def test_dit_options_stay_close_to_fp32(dit, processor, encoder, overrides: tuple, layer_type: str | None, min_psnr: float) -> None:
    item = request("a red apple on a wooden table", seed=2, steps=4)
    plain = run_dit(dit, stage_inputs(processor, encoder, {"plain": item}))["plain"]
    pipeline = resolve(MODEL, overrides=[*INLINE, *overrides])
    stage = pipeline.stage("dit")
    if stage.quantization is not None:  # the resolver skips layers under 64 features: the tiny DiT has none that big
        stage = attrs.evolve(stage, quantization={**stage.quantization, "min_features": 16})
    runtime = DiffusionStageRuntime(pipeline, stage)
    runtime.load()
    transformer = runtime.model.pipe.transformer
    if layer_type is not None:
        assert layer_type in {type(m).__name__ for m in transformer.transformer_blocks.modules()}
        assert type(transformer.proj_in).__name__ == "Linear"  # the fp32-kept projections stay as they are
    else:
        assert str(transformer.transformer_blocks[0].attn.to_q.weight.dtype) == "torch.bfloat16"
        assert str(transformer.proj_in.weight.dtype) == "torch.float32"  # the library keeps them in fp32
    other = run_dit(runtime, stage_inputs(processor, encoder, {"other": item}))["other"]
    assert other["video"].shape == plain["video"].shape and other["audio"].shape == plain["audio"].shape
    assert psnr(other["video"], plain["video"]) >= min_psnr


def test_vae_tiling_reaches_the_vae_and_unimplemented_options_are_refused() -> None:
    """``vae_tiling``/``vae_tile`` set the video VAE's tiles; ``cuda_graphs``, which this dit does not
    implement, and the encoder's ``compile`` are refused at resolve (naming the key) instead of
    being ignored."""
    from omni_core.errors import ConfigError

    pipeline = resolve(MODEL, overrides=[*INLINE, "dit.vae_tiling=true", "dit.vae_tile=128"])
    runtime = DiffusionStageRuntime(pipeline, pipeline.stage("dit"))
    runtime.load()
    try:
        vae = runtime.model.pipe.vae
        assert vae.use_tiling and (vae.tile_sample_min_height, vae.tile_sample_min_overlap_width) == (128, 32)
    finally:
        runtime.close()
    with pytest.raises(ConfigError, match="does not implement cuda_graphs") as refused:
        resolve(MODEL, overrides=[*INLINE, "dit.cuda_graphs=true"])
    assert refused.value.key == "stages.dit.options.cuda_graphs"
    with pytest.raises(ConfigError, match="does not implement compile") as encoder:  # (a generation stage's compile)
        resolve(MODEL, overrides=[*INLINE, "encoder.compile=true"])
    assert encoder.value.key == "stages.encoder.options.compile"


def test_compile_runs_the_compiled_blocks_and_gives_the_same_video(dit, processor, encoder) -> None:
    """``compile: true``: the dit stage's blocks run compiled (`BlockKernels.compiled`), the video and
    soundtrack those of the eager stage (the velocities within 1e-5: `test_equality`)."""
    from omni_minimax_h3.packed import EAGER

    item = request("a red apple on a wooden table", seed=2, steps=3)
    plain = run_dit(dit, stage_inputs(processor, encoder, {"plain": item}))["plain"]
    pipeline = resolve(MODEL, overrides=[*INLINE, "dit.compile=true"])
    runtime = DiffusionStageRuntime(pipeline, pipeline.stage("dit"))
    runtime.load()
    try:
        assert runtime.model.kernels is not EAGER and hasattr(runtime.model.kernels.before, "_torchdynamo_orig_callable")
        compiled = run_dit(runtime, stage_inputs(processor, encoder, {"compiled": item}))["compiled"]
    finally:
        runtime.close()
    assert np.abs(compiled["video"].astype(int) - plain["video"].astype(int)).max() <= 1
    np.testing.assert_allclose(compiled["audio"], plain["audio"], rtol=1e-4, atol=1e-5)
