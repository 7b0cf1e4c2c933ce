"""The native partition layout (``FL2VA/``, ``Ref2VA/``): the tiny checkpoint written in it by the inverse
transform (`write_native`), read back through the qkv reorder and the gate/value swap, gives what the
diffusers layout gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omni_minimax_h3 import native
from PIL import Image

from omni_core import Omni
from omni_core.config import resolve
from omni_core.engine.request import OmniRequest
from omni_core.errors import UnknownModelError

from .conftest import INLINE


@pytest.fixture(scope="module")
def native_root(pipeline: Any, tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: Any) -> Path:
    root = tmp_path_factory.mktemp("native")
    native.write_native(pipeline.model_path, root)
    return root


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The conversion cache (``$OMNI_CACHE``) in a temporary folder, for this module's tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield patch


def test_the_transforms_invert() -> None:
    heads, head_dim, width = 3, 4, 5
    q, k, v = (torch.randn(heads * head_dim, width) for _ in range(3))
    fused = native.interleave_qkv(q, k, v, heads)
    # the native rows: head by head, q then k then v
    assert torch.equal(fused[:head_dim], q[:head_dim]) and torch.equal(fused[head_dim : 2 * head_dim], k[:head_dim])
    assert torch.equal(fused[2 * head_dim : 3 * head_dim], v[:head_dim]) and torch.equal(fused[3 * head_dim : 4 * head_dim], q[head_dim : 2 * head_dim])
    for ours, theirs in zip(native.split_interleaved_qkv(fused, heads, head_dim), (q, k, v)):
        assert torch.equal(ours, theirs)
    gate_value = torch.randn(8, 3)
    assert torch.equal(native.swap_halves(gate_value)[:4], gate_value[4:])
    assert torch.equal(native.swap_halves(native.swap_halves(gate_value)), gate_value)


def test_the_native_layout_holds_fused_native_tensors(native_root: Path) -> None:
    from safetensors import safe_open

    index = json.loads((native_root / "FL2VA" / "model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3Pipeline" and index["_minimax_h3"]["partition"] == "FL2VA"
    assert (native_root / "Ref2VA" / "transformer").is_dir()
    with safe_open(str(native_root / "FL2VA" / "transformer" / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "blocks.0.attn.qkv_proj.weight" in keys and "blocks.0.mlp.fc1.weight" in keys and "video_patch_proj.weight" in keys
    assert not any("to_q" in key or "ff.net" in key for key in keys)
    with safe_open(str(native_root / "FL2VA" / "video_vae" / "source" / "model.safetensors"), "pt") as handle:
        assert any(".attn.to_qkv." in key for key in handle.keys())


def test_each_converted_component_equals_the_diffusers_one(pipeline: Any, native_root: Path) -> None:
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Transformer3DModel,
    )

    view = Path(native.diffusers_layout(native_root / "FL2VA"))
    original = Path(pipeline.model_path)
    for cls, name in ((MiniMaxH3Transformer3DModel, "transformer"), (MiniMaxH3Transformer3DModel, "transformer_ref"),
                      (AutoencoderKLMiniMaxH3, "vae"), (AutoencoderKLMiniMaxH3Audio, "audio_vae")):
        ours, theirs = cls.from_pretrained(str(view / name)), cls.from_pretrained(str(original / name))
        config = {k: v for k, v in ours.config.items() if k != "_name_or_path"}
        assert config == {k: v for k, v in theirs.config.items() if k != "_name_or_path"}, name
        a, b = ours.state_dict(), theirs.state_dict()
        assert a.keys() == b.keys(), name
        assert all(torch.equal(a[key], b[key]) for key in a), name
    # read again: the conversion is cached
    assert native.diffusers_layout(native_root / "FL2VA") == str(view)


def test_a_native_partition_resolves_to_the_family(native_root: Path) -> None:
    for partition in ("FL2VA", "Ref2VA"):
        assert resolve(str(native_root / partition), overrides=INLINE).family == "minimax-h3"
    # The release's root holds only the partitions: the error says which folder to serve.
    with pytest.raises(UnknownModelError) as info:
        resolve(str(native_root), overrides=INLINE)
    assert str(info.value).endswith(f"serve one of {native_root / 'FL2VA'}, {native_root / 'Ref2VA'}")


def _generate(model: str, requests: list[OmniRequest]) -> list[Any]:
    """Each request alone (requests batched together match to float rounding only, and which share a
    step depends on timing): the two layouts' outputs can then be compared bit for bit."""
    with Omni(resolve(model, overrides=(*INLINE, "streaming=false"))) as omni:
        return [omni.generate(item)[0] for item in requests]


def test_native_outputs_equal_the_diffusers_layout(pipeline: Any, native_root: Path) -> None:
    rng = np.random.default_rng(3)
    keyframe = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))

    def requests() -> list[OmniRequest]:
        common = {"size": (32, 32), "num_frames": 124}
        return [
            OmniRequest(prompt="a cat sleeps on a sofa", params={"dit": {"num_inference_steps": 3}}, extra={**common, "seed": 1}),
            OmniRequest(prompt="waves crash on the rocks", params={"dit": {"num_inference_steps": 3}},
                        extra={**common, "seed": 2, "image": keyframe}),
            OmniRequest(prompt="a dog runs on the beach", params={"dit": {"num_inference_steps": 3}},
                        extra={**common, "seed": 3, "references": [{"type": "image", "image": keyframe}]}),
        ]

    ours = _generate(str(native_root / "FL2VA"), requests())
    theirs = _generate(pipeline.model_path, requests())
    for a, b in zip(ours, theirs):
        assert np.array_equal(a.video, b.video)
        np.testing.assert_array_equal(a.audio, b.audio)
        assert a.sample_rate == b.sample_rate
