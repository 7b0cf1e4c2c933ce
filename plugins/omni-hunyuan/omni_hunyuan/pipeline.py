"""The HunyuanImage-3.0 family's pipeline (first part of issue 25): two independent stages.

- ``ar`` (kind ``ar``, `omni_hunyuan.ar.HunyuanAR`): text out on vLLM (``t2t``), an out-of-tree vLLM
  model class of our own; modalities ``["text"]``.
- ``dit`` (kind ``diffusion``, `omni_hunyuan.dit.HunyuanDiT`): text -> image (``t2i``); stage
  parameters ``seed``, ``size`` ([width, height]), ``num_inference_steps``, ``guidance_scale``, with
  defaults and prompt template from the checkpoint's generation_config; modalities ``["image"]``.

A request runs only the stage whose modality it asks for (the core's active-stage selection), so
``t2t`` never touches the DiT and ``t2i`` never the AR stage. What is not here yet (issue 25):
``think_t2i`` (ar -> dit, with the ratio picked by the AR stage), the ``task`` parameter, and one copy
of the weights for both stages (each stage loads its own until the core has shared-model stages).
"""

from __future__ import annotations

from typing import Any

from omni_core.config.pipeline import PipelineConfig, StageSpec
from omni_core.engine.inputs import last_user_text
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.parts import InputProcessor

STAGE = "dit"
AR_STAGE = "ar"
DEFAULT_DEPLOY = "omni_hunyuan:deploy/default.yaml"
EXTRA_FIELDS = ("size", "seed")


def build_pipeline(model_path: str, hf_config: dict[str, Any]) -> PipelineConfig:
    """The pipeline of a ``HunyuanImage3ForCausalMM`` checkpoint (declarations only: no torch, no I/O)."""
    return PipelineConfig(
        family="hunyuan-image3",
        stages=(
            StageSpec(name=AR_STAGE, kind="ar", model="omni_hunyuan.ar:HunyuanAR", output="text", final=True, params={"temperature": 0.0}),
            StageSpec(name=STAGE, kind="diffusion", model="omni_hunyuan.dit:HunyuanDiT", output="image", final=True),
        ),
        input_processor="omni_hunyuan.pipeline:HunyuanInputProcessor",
        default_deploy=DEFAULT_DEPLOY,
        default_modalities=("image",),
    )


class HunyuanInputProcessor(InputProcessor):
    """Request -> each stage's input: the prompt (``ar``), plus ``size`` and ``seed`` (``dit``); the
    engine hands each only to the stages the request's modalities make active."""

    def process(self, request: Any) -> dict[str, StageInput]:
        prompt = request.prompt
        if prompt is None and request.messages:
            prompt = last_user_text(request.messages)
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError("HunyuanImage-3.0 needs a text prompt", param="prompt")
        modalities = tuple(request.modalities or self.context.pipeline.default_modalities)
        if "text" in modalities and "image" in modalities:
            raise InvalidRequestError(
                "text and image together (think-then-draw, ar -> dit) is not implemented yet: ask for one",
                param="modalities",
            )
        data: dict[str, Any] = {"prompt": prompt}
        for key in EXTRA_FIELDS:
            if request.extra.get(key) is not None:
                data[key] = tuple(request.extra[key]) if key == "size" else request.extra[key]
        return {AR_STAGE: StageInput(data={"prompt": prompt}, final=True), STAGE: StageInput(data=data, final=True)}

