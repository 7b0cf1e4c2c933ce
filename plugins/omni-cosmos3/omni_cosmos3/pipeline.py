"""The Cosmos3 family's pipeline: ONE diffusion stage holding both towers, and its input processor.

Stage ``generator`` (kind ``diffusion``, `omni_cosmos3.model.Cosmos3Model`) produces images,
videos, the videos' audio and, on checkpoints trained with ``action_gen``, robot actions. Its stage
parameters: ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``fps``,
``num_frames``, ``task`` (``t2i``, ``t2v``, ``t2va``, ``policy``, ``inverse_dynamics``), ``cache``
and, for the action tasks, ``domain``, ``chunk_size``, ``resolution_tier``, ``view_point``,
``image``/``video`` (conditioning frames: arrays, PIL images or base64 ``data:`` URLs, or for
``image`` an image part of the chat message, as ``omni generate --image`` sends it; the stage
never opens a string as a path; over HTTP the server also reads the ``file://``/``http(s)://`` URLs its
operator allowed into data URLs: `Cosmos3Model.media_params`).
Request fields (`OmniRequest.extra`: ``size`` as (width, height), ``seconds``, ``seed``, ``n``, and
the action fields above) and the wanted modalities become the stage's input: asking for
``action`` picks ``inverse_dynamics`` when a ``video`` is given, else ``policy``; the actions
arrive as the output key ``actions`` (a ``[chunk_size, action width]`` float32 array).
"""

from __future__ import annotations

from typing import Any

from omni_core.config.pipeline import PipelineConfig, StageSpec
from omni_core.engine.inputs import last_user_images, last_user_text
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.parts import InputProcessor
from omni_cosmos3.tasks import ACTION_TASKS

STAGE = "generator"
DEFAULT_DEPLOY = "omni_cosmos3:deploy/default.yaml"
EXTRA_FIELDS = ("size", "seconds", "seed", "n", "domain", "chunk_size", "resolution_tier", "view_point", "image", "video")
# Request fields of /v1/videos (and `omni generate --image/--reference`) that Cosmos3 has no use for.
UNTAKEN_FIELDS = {"last_image": "last frame (last_image; /v1/videos' last_frame)", "references": "references (references; omni generate --reference)"}


def build_pipeline(model_path: str, hf_config: dict[str, Any]) -> PipelineConfig:
    """The pipeline of a diffusers ``Cosmos3OmniPipeline`` checkpoint."""
    return PipelineConfig(
        family="cosmos3",
        stages=(
            StageSpec(
                name=STAGE,
                kind="diffusion",
                model="omni_cosmos3.model:Cosmos3Model",
                output="video",
                extra_outputs=("image", "audio", "action"),
                final=True,
            ),
        ),
        input_processor="omni_cosmos3.pipeline:Cosmos3InputProcessor",
        default_deploy=DEFAULT_DEPLOY,
        default_modalities=("image",),
    )


def task_for(modalities: tuple[str, ...], has_video: bool = False) -> str:
    """The task the wanted modalities ask for: actions beat video (+ audio), which beats image."""
    if "action" in modalities:
        return "inverse_dynamics" if has_video else "policy"
    if "video" in modalities or "audio" in modalities:
        return "t2va" if "audio" in modalities else "t2v"
    return "t2i"


class Cosmos3InputProcessor(InputProcessor):
    """Request -> the ``generator`` stage's input: the prompt, the task and the request fields."""

    def process(self, request: Any) -> dict[str, StageInput]:
        prompt, images = request.prompt, []
        if prompt is None and request.messages:
            prompt = last_user_text(request.messages, reads=("image_url", "image"))
            # An image in the message is the action tasks' first frame (``image``), as `omni generate --image` sends it.
            images = last_user_images(request.messages, 1, "Cosmos3")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError("Cosmos3 needs a text prompt", param="prompt")
        for key, what in UNTAKEN_FIELDS.items():  # (a video request's fields of other families: refused, not dropped)
            if request.extra.get(key) is not None:
                raise InvalidRequestError(f"Cosmos3 takes no {what}; it generates from the prompt (the action tasks: from a first frame, `image`, or a `video`)", param=key)
        modalities = tuple(request.modalities or self.context.pipeline.default_modalities)
        data: dict[str, Any] = {"prompt": prompt, "task": task_for(modalities, request.extra.get("video") is not None)}
        for key in EXTRA_FIELDS:
            if request.extra.get(key) is not None:
                data[key] = request.extra[key]
        if images:
            if "image" in data or "video" in data:
                raise InvalidRequestError("give the first frame once: an image in the message or the image/video field", param="messages")
            if data["task"] not in ACTION_TASKS:
                raise InvalidRequestError(
                    f"an image is a first frame for the action tasks (modalities [\"action\"]); task {data['task']!r} takes none",
                    param="messages",
                )
            data["image"] = images[0]
        if "size" in data:
            data["size"] = tuple(data["size"])
        return {STAGE: StageInput(data=data, final=True)}

