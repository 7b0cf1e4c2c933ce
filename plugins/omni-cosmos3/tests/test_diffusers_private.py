"""The private diffusers names omni-cosmos3 relies on (`omni_cosmos3.diffusers_private`) are still
there and still mean what the plugin assumes: each is checked by signature and by behaviour, so a
diffusers release that changes one fails here, by name, rather than changing Cosmos3 outputs. And
no other module of the plugin touches a private name of diffusers."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from omni_cosmos3 import diffusers_private

MODEL = "omni-tiny/cosmos3"


def parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pipe():
    from diffusers import Cosmos3OmniPipeline

    from omni_core.config import resolve

    return Cosmos3OmniPipeline.from_pretrained(resolve(MODEL).model_path, enable_safety_checker=False)


def unipc(**config: object):
    from diffusers import UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler(num_train_timesteps=1000, **config)
    scheduler.set_timesteps(6)
    return scheduler


def test_prepare_action_video_conditioning(pipe) -> None:
    from diffusers import Cosmos3OmniPipeline

    assert parameters(Cosmos3OmniPipeline._prepare_action_video_conditioning) == [
        "self", "conditioning_clip", "resolution_tier", "num_frames", "device", "dtype",
    ]
    from PIL import Image

    clip = [Image.new("RGB", (32, 24), (40 * i, 90, 200)) for i in range(2)]  # two 24x32 frames, as requests give them
    pixels, image_size, height, width = diffusers_private.prepare_action_video_conditioning(
        pipe, clip, 256, 3, device="cpu", dtype=torch.float32
    )
    assert pixels.shape == (1, 3, 3, height, width)  # repeated to num_frames, on the tier's canvas
    assert (height, width) == (256, 320)  # the 256 tier's canvas nearest to 24:32
    canvas_h, canvas_w, content_h, content_w = image_size.tolist()
    assert (canvas_h, canvas_w) == (height, width) and content_h <= height and content_w <= width


def test_embodiment_domain_id() -> None:
    from diffusers.pipelines.cosmos import pipeline_cosmos3_omni as module

    table = module._EMBODIMENT_TO_DOMAIN_ID
    assert isinstance(table, dict) and all(isinstance(k, str) and isinstance(v, int) for k, v in table.items())
    # Every embodiment an action request may name (it has an action width) has a domain id.
    assert set(module._EMBODIMENT_TO_RAW_ACTION_DIM) <= set(table)
    assert diffusers_private.embodiment_domain_id("bridge_orig_lerobot") == table["bridge_orig_lerobot"]


def test_step_index() -> None:
    from diffusers import UniPCMultistepScheduler

    assert parameters(UniPCMultistepScheduler._init_step_index) == ["self", "timestep"]
    scheduler = unipc()
    assert scheduler.step_index is None
    diffusers_private.init_step_index(scheduler, scheduler.timesteps[2])
    assert scheduler.step_index == 2
    diffusers_private.advance_step_index(scheduler)
    assert scheduler.step_index == 3


@pytest.mark.parametrize("flow", [True, False])
def test_sigma_to_alpha_sigma_t(flow: bool) -> None:
    from diffusers import UniPCMultistepScheduler

    assert parameters(UniPCMultistepScheduler._sigma_to_alpha_sigma_t) == ["self", "sigma"]
    config = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0} if flow else {}
    sigma = torch.tensor(0.4)
    alpha_t, sigma_t = diffusers_private.sigma_to_alpha_sigma_t(unipc(**config), sigma)
    if flow:  # flow matching: x_t = (1 - sigma) x0 + sigma noise
        expected = (1 - sigma, sigma)
    else:  # variance preserving, from the Karras sigma
        alpha = 1 / torch.sqrt(sigma**2 + 1)
        expected = (alpha, sigma * alpha)
    torch.testing.assert_close((alpha_t, sigma_t), expected)


def test_causal_conv_padding() -> None:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    conv = WanCausalConv3d(2, 2, kernel_size=3, padding=1)
    assert tuple(conv.padding) == (0, 0, 0)  # the public padding is zeroed: the causal one is private
    assert diffusers_private.causal_conv_padding(conv) == (1, 1, 1, 1, 2, 0)


def test_has_offload_hook() -> None:
    from accelerate.hooks import ModelHook, add_hook_to_module

    module = torch.nn.Linear(2, 2)
    assert not diffusers_private.has_offload_hook(module)
    add_hook_to_module(module, ModelHook())
    assert diffusers_private.has_offload_hook(module)


def test_no_other_module_touches_private_names() -> None:
    """Outside `diffusers_private`, the plugin reads no underscore name of anything but itself."""
    package = Path(diffusers_private.__file__).parent
    offences = []
    for path in sorted(package.glob("*.py")):
        if path.name == "diffusers_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diffusers"):
                offences += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    offences.append(f"{path.name}:{node.lineno} reads .{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr"):
                name = node.args[1] if len(node.args) > 1 else None
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                    offences.append(f"{path.name}:{node.lineno} {node.func.id}(..., {name.value!r})")
    assert offences == [], "move these into omni_cosmos3/diffusers_private.py (with a test here)"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_diffusers_is_pinned_to_the_checked_range() -> None:
    """The plugin's pin, the install hint in its errors and the installed diffusers agree."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    from packaging.requirements import Requirement
    from packaging.version import Version

    import diffusers
    from omni_cosmos3.model import DIFFUSERS_REQUIREMENT

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    pins = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "diffusers"]
    assert [str(p) for p in pins] == [str(Requirement(DIFFUSERS_REQUIREMENT))]
    assert any(s.operator == "<" for s in pins[0].specifier), "an upper bound: the private names may change"
    assert Version(diffusers.__version__) in pins[0].specifier
