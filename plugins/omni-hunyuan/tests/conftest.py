"""Fixtures of the HunyuanImage-3.0 tests: the tiny checkpoint (``omni-tiny/hunyuan-image3``), its
tokenizer and special tokens, and our transformer loaded once per session.

transformers is imported at the top: without it the suite fails, never skips. Its ``modeling_utils``
too, once, here: the family contract loads its two inline stages at the same time in two threads, and
both would otherwise import accelerate (through transformers' lazy modules) concurrently, where
accelerate's circular imports fail with "partially initialized module" in one of them. Stages in processes (the default placement) never race.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers
import transformers.modeling_utils

from omni_core.config.modelref import resolve_model_path
from omni_core.plugins import default_plugins

MODEL = "omni-tiny/hunyuan-image3"


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    return resolve_model_path(MODEL, default_plugins())


@pytest.fixture(scope="session")
def tokenizer(checkpoint: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="session")
def tokens(checkpoint: Path, tokenizer: Any) -> Any:
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.tokens import SpecialTokens

    return SpecialTokens.from_tokenizer(tokenizer, HunyuanConfig.from_pretrained(checkpoint).image_base_size)


@pytest.fixture(scope="session")
def model(checkpoint: Path) -> Any:
    from omni_hunyuan.weights import load_transformer

    return load_transformer(checkpoint)


@pytest.fixture(scope="session")
def vae(checkpoint: Path) -> Any:
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.vae import load_vae

    return load_vae(checkpoint, HunyuanConfig.from_pretrained(checkpoint).vae)


@pytest.fixture(scope="session")
def decoder(vae: Any) -> Any:
    """The VAE's decoder, what the dit stage decodes with (`omni_hunyuan.vae.decode_latents`)."""
    return vae.decoder


@pytest.fixture(scope="session")
def inline_dit() -> Any:
    """A factory: a checkpoint's ``dit`` stage runtime, inline, its own weights in fp32, no admission
    window, loaded (the caller closes it)."""
    import attrs

    from omni_core.config import resolve
    from omni_core.stages.diffusion import DiffusionStageRuntime

    def build(path: Path) -> Any:
        pipeline = resolve(str(path), overrides=("dit.placement=inline", "dit.share_model_with=", "dit.dtype=float32"))
        stage = pipeline.stage("dit")
        runtime = DiffusionStageRuntime(pipeline, attrs.evolve(stage, options={**stage.options, "admission_window_ms": 0.0}))
        runtime.load()
        return runtime

    return build


@pytest.fixture(scope="session")
def run_dit() -> Any:
    """A function: requests ``{id: (data, params)}`` added to a ``dit`` runtime and stepped to the end;
    each one's final chunk's data."""
    from omni_core.outputs import StageInput

    def run(runtime: Any, requests: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, dict[str, Any]]:
        for request_id, (data, params) in requests.items():
            runtime.add_request(request_id, StageInput(data=data, params=params))
        finals: dict[str, dict[str, Any]] = {}
        while runtime.has_unfinished():
            for chunk in runtime.step():
                if chunk.final:
                    finals[chunk.request_id] = chunk.data
        return finals

    return run


@pytest.fixture(scope="session")
def inline_omni() -> Any:
    """A factory: an offline engine over a checkpoint with both stages inline, the dit on the ar's
    modules (``share_model_with: ar``), a short vLLM context (a context manager)."""
    from omni_core.config import resolve
    from omni_core.engine.offline import Omni

    def build(path: Path) -> Any:
        deploy = {"stages": {"ar": {"placement": "inline", "options": {"max_model_len": 256}}, "dit": {"placement": "inline", "share_model_with": "ar"}}}
        return Omni(resolve(str(path), deploy=deploy))

    return build

