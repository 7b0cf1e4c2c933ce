"""Cosmos3 action output (``policy``, ``inverse_dynamics``) against diffusers' `Cosmos3OmniPipeline`
run alone with a `CosmosActionCondition` on the same tiny checkpoint and seed."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from omni_core.config import resolve
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.stages.diffusion import DiffusionStageRuntime

MODEL = "omni-tiny/cosmos3"
INLINE = ("generator.placement=inline",)
DOMAIN = "bridge_orig_lerobot"  # 10 action channels, the tiny checkpoint's action_dim


@pytest.fixture(scope="module")
def pipeline():
    return resolve(MODEL, overrides=INLINE)


@pytest.fixture(scope="module")
def reference(pipeline):
    from diffusers import Cosmos3OmniPipeline

    pipe = Cosmos3OmniPipeline.from_pretrained(pipeline.model_path, enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def frames(seed: int, count: int, height: int = 24, width: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def action_request(task: str, seed: int, conditioning: np.ndarray, chunk: int = 4, steps: int = 3, guidance: float = 3.0, **params: Any) -> StageInput:
    key = "video" if conditioning.ndim == 4 else "image"
    data = {"prompt": "A robot arm picks up a blue cube", "seed": seed, "task": task, key: conditioning}
    return StageInput(
        data=data,
        params={"num_inference_steps": steps, "guidance_scale": guidance, "domain": DOMAIN, "chunk_size": chunk,
                "resolution_tier": 256, **params},
    )


def diffusers_actions(pipe, item: StageInput) -> tuple[np.ndarray, np.ndarray]:
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
    from PIL import Image

    data, params = item.data, item.params
    image = Image.fromarray(data["image"]) if "image" in data else None
    video = [Image.fromarray(f) for f in data["video"]] if "video" in data else None
    condition = CosmosActionCondition(
        mode=data["task"], chunk_size=params["chunk_size"], domain_name=params["domain"],
        resolution_tier=params["resolution_tier"], image=image, video=video,
    )
    result = pipe(
        data["prompt"], action=condition, num_inference_steps=params["num_inference_steps"],
        guidance_scale=params["guidance_scale"], generator=torch.Generator().manual_seed(data["seed"]), output_type="np",
    )
    pixels = np.clip(np.round(result.video * 255), 0, 255).astype(np.uint8)
    return result.action[0].float().numpy(), pixels


def run(runtime: DiffusionStageRuntime, requests: dict[str, StageInput]) -> dict[str, dict]:
    for rid, item in requests.items():
        runtime.add_request(rid, item)
    outputs: dict[str, dict] = {}
    while runtime.has_unfinished():
        for chunk in runtime.step():
            assert chunk.error is None, chunk.error
            if chunk.final:
                outputs[chunk.request_id] = chunk.data
    return outputs


def make_runtime(pipeline) -> DiffusionStageRuntime:
    import attrs

    stage = pipeline.stage("generator")
    stage = attrs.evolve(stage, options={**stage.options, "max_num_seqs": 8, "admission_window_ms": 0.0})
    runtime = DiffusionStageRuntime(pipeline, stage)
    runtime.load()
    return runtime


REQUESTS = {
    "policy": action_request("policy", seed=1, conditioning=frames(0, 1)[0]),
    "policy2": action_request("policy", seed=9, conditioning=frames(2, 1)[0], guidance=1.0),
    "inverse": action_request("inverse_dynamics", seed=4, conditioning=frames(3, 5)),
}


@pytest.fixture(scope="module")
def batched(pipeline):
    runtime = make_runtime(pipeline)
    return runtime, run(runtime, REQUESTS)


def test_batched_action_requests_equal_the_pipeline_run_alone(batched, reference):
    runtime, outputs = batched
    assert max(runtime.batch_sizes) >= 3, "action requests of one shape must share a forward"
    for rid, item in REQUESTS.items():
        expected_actions, expected_pixels = diffusers_actions(reference, item)
        got = outputs[rid]
        assert got["actions"].dtype == np.float32 and got["actions"].shape == (4, 10)
        np.testing.assert_allclose(got["actions"], expected_actions, atol=1e-4, rtol=1e-4, err_msg=rid)
        assert got["video"].shape == expected_pixels.shape
        assert np.abs(got["video"].astype(int) - expected_pixels.astype(int)).max() <= 1, rid
    # different prompts/seeds/frames give different actions (the comparison above can fail)
    assert not np.allclose(outputs["policy"]["actions"], outputs["policy2"]["actions"], atol=1e-2)


def test_bad_action_parameters_are_rejected_before_work(pipeline):
    runtime = make_runtime(pipeline)
    image = frames(0, 1)[0]
    bad = [
        ({"domain": "no_such_robot"}, "domain"),
        ({"domain": "hand_pose"}, "domain"),  # 57 channels: more than this checkpoint's action head has
        ({"chunk_size": 3}, "chunk_size"),  # not a multiple of the VAE's temporal compression (2)
        ({"chunk_size": 0}, "chunk_size"),
        ({"resolution_tier": 300}, "resolution_tier"),
        ({"view_point": "top"}, "view_point"),
        ({"size": (32, 32)}, "size"),
        # A string is a data URL, never a path or a URL the stage would open or fetch.
        ({"image": "/etc/passwd"}, "image"),
        ({"image": "http://127.0.0.1:9/frame.png"}, "image"),
        ({"image": None, "video": "file:///etc/passwd"}, "video"),
    ]
    for change, param in bad:
        item = action_request("policy", seed=1, conditioning=image)
        item = StageInput(data=item.data, params={**item.params, **change})
        with pytest.raises(InvalidRequestError) as info:
            runtime.add_request("bad", item)
        assert info.value.param == param, change
    with pytest.raises(InvalidRequestError) as info:
        runtime.add_request("bad", action_request("inverse_dynamics", seed=1, conditioning=image))
    assert info.value.param == "video"
    with pytest.raises(InvalidRequestError) as info:
        runtime.add_request("bad", action_request("policy", seed=1, conditioning=image.astype(np.float32)))
    assert info.value.param == "image"
    with pytest.raises(InvalidRequestError) as info:
        runtime.add_request("bad", StageInput(data={"prompt": "x", "task": "t2i"}, params={"domain": DOMAIN}))
    assert info.value.param == "domain"
    assert not runtime.has_unfinished()


def test_actions_reach_the_user_and_the_cli(tmp_path, pipeline, batched):
    from PIL import Image

    from omni_cli.main import cli
    from omni_core.engine.offline import Omni

    image = frames(0, 1)[0]
    with Omni(pipeline) as omni:
        (result,) = omni.generate(_request(image))
    _, outputs = batched
    # alone vs. batched with other requests: equal up to float rounding
    np.testing.assert_allclose(result.actions, outputs["policy"]["actions"], atol=1e-5)
    summary = result.to_json(result.save(tmp_path / "offline"))
    assert summary["actions"]["shape"] == [4, 10]
    np.testing.assert_allclose(np.load(summary["actions"]["path"]), result.actions)

    # A request's image is a base64 data URL (a string is never opened as a path).
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    params = {"generator": {**REQUESTS["policy"].params, "image": url, "seed": 1}}
    cli_out = CliRunner().invoke(
        cli, ["generate", MODEL, "--prompt", "A robot arm picks up a blue cube", "--modalities", "action", "--json",
              "--set", "generator.placement=inline", "--stage-params", json.dumps(params)],
    )
    assert cli_out.exit_code == 0, cli_out.output
    printed = json.loads(cli_out.stdout[cli_out.stdout.index("{"):])
    assert printed["actions"]["shape"] == [4, 10]
    np.testing.assert_allclose(np.array(printed["actions"]["values"]), result.actions, atol=1e-6)

    # `--image FILE`: the image part of the chat message is the first frame.
    path = tmp_path / "first.png"
    path.write_bytes(buffer.getvalue())
    del params["generator"]["image"]
    cli_out = CliRunner().invoke(
        cli, ["generate", MODEL, "--prompt", "A robot arm picks up a blue cube", "--image", str(path), "--modalities", "action",
              "--json", "--set", "generator.placement=inline", "--stage-params", json.dumps(params)],
    )
    assert cli_out.exit_code == 0, cli_out.output
    printed = json.loads(cli_out.stdout[cli_out.stdout.index("{"):])
    np.testing.assert_allclose(np.array(printed["actions"]["values"]), result.actions, atol=1e-6)


def test_a_message_image_is_the_first_frame_of_action_tasks_only(pipeline):
    """The input processor takes one image part of the last user message as ``image``; a second image,
    one for a task without a first frame, or one beside the ``image``/``video`` field is a 400-class
    error naming ``messages``."""
    from PIL import Image

    from omni_core.engine.request import OmniRequest
    from omni_core.parts import PartContext
    from omni_cosmos3.pipeline import Cosmos3InputProcessor

    processor = Cosmos3InputProcessor(PartContext(pipeline))
    buffer = io.BytesIO()
    Image.fromarray(frames(0, 1)[0]).save(buffer, format="PNG")
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()}}

    def message(*parts: dict) -> list[dict]:
        return [{"role": "user", "content": [*parts, {"type": "text", "text": "A robot arm picks up a blue cube"}]}]

    data = processor.process(OmniRequest(messages=message(part), modalities=("action",)))["generator"].data
    assert data["task"] == "policy" and np.array_equal(np.asarray(data["image"]), frames(0, 1)[0])
    for request in (
        OmniRequest(messages=message(part, part), modalities=("action",)),
        OmniRequest(messages=message(part), modalities=("image",)),
        OmniRequest(messages=message(part), modalities=("action",), extra={"image": frames(1, 1)[0]}),
    ):
        with pytest.raises(InvalidRequestError) as info:
            processor.process(request)
        assert info.value.param == "messages"


def _request(image: np.ndarray):
    from omni_core.engine.request import OmniRequest

    item = REQUESTS["policy"]
    return OmniRequest(
        prompt=item.data["prompt"], modalities=("action",), params={"generator": dict(item.params)},
        extra={"image": image, "seed": item.data["seed"]},
    )
