"""diffusers' own MiniMax-H3 pipeline on a checkpoint, and helpers that run Omni's stages beside it:
what the equality tests (and benchmarks) compare against.

`load_reference` gives the library's `MiniMaxH3ModularPipeline` with every component but the
processor loaded from the checkpoint; the processor is `ProcessorStandIn` where torchvision is
missing (`Qwen3VLProcessor` cannot be built there: its video processor needs torchvision).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.processing_utils import ProcessorMixin

from omni_core.engine.request import OmniRequest
from omni_core.outputs import StageInput
from omni_core.stages.diffusion import DiffusionStageRuntime
from omni_core.stages.generation import GenerationStageRuntime

SIZE = (32, 32)
FRAMES = 124  # the shortest legal video: 17 * 7 + 5


class ProcessorStandIn:
    """What diffusers' blocks use of a `Qwen3VLProcessor` (`image_processor`, `create_mm_token_type_ids`),
    from the checkpoint's own ``processor/`` files: the processor class itself cannot be built where
    torchvision is missing (its video processor needs it). `create_mm_token_type_ids` is the library's."""

    create_mm_token_type_ids = ProcessorMixin.create_mm_token_type_ids

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        from omni_minimax_h3.presentation import load_image_processor

        self.tokenizer = AutoTokenizer.from_pretrained(f"{model_path}/processor")
        self.image_processor = load_image_processor(f"{model_path}/processor")
        self.image_token_ids = [self.tokenizer.convert_tokens_to_ids("<|image_pad|>")]
        self.video_token_ids = [self.tokenizer.convert_tokens_to_ids("<|video_pad|>")]
        self.audio_token_ids: list[int] = []


def load_reference(model_path: str) -> Any:
    """diffusers' `MiniMaxH3ModularPipeline` on `model_path`, float32, processor stood in where needed."""
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(model_path)
    names = [name for name in pipe.pretrained_component_names if name != "processor"]
    pipe.load_components(names=names, dtype=torch.float32)
    try:
        from transformers import Qwen3VLProcessor

        processor = Qwen3VLProcessor.from_pretrained(f"{model_path}/processor")
    except (ImportError, AttributeError, OSError, ValueError):
        processor = ProcessorStandIn(model_path)
    pipe.update_components(processor=processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def request(prompt: str, seed: int = 0, steps: int = 3, **extra: Any) -> OmniRequest:
    extra = {"size": SIZE, "num_frames": FRAMES, "seed": seed, **extra}
    return OmniRequest(prompt=prompt, params={"dit": {"num_inference_steps": steps}}, extra=extra)


def stage_inputs(processor: Any, encoder: GenerationStageRuntime, requests: dict[str, OmniRequest]) -> dict[str, StageInput]:
    """Each request through the input processor and the encoder stage (one batched step): the dit's inputs."""
    inputs = {rid: processor.process(item) for rid, item in requests.items()}
    for rid, parts in inputs.items():
        encoder.add_request(rid, parts["encoder"])
    embeds: dict[str, Any] = {}
    while encoder.has_unfinished():
        for chunk in encoder.step():
            assert chunk.error is None, chunk.error
            embeds[chunk.request_id] = chunk.data
    return {
        rid: StageInput(data=embeds[rid], params={**parts["dit"].params, **requests[rid].params["dit"]})
        for rid, parts in inputs.items()
    }


def run_dit(dit: DiffusionStageRuntime, inputs: dict[str, StageInput]) -> dict[str, dict]:
    for rid, item in inputs.items():
        dit.add_request(rid, item)
    outputs: dict[str, dict] = {}
    while dit.has_unfinished():
        for chunk in dit.step():
            assert chunk.error is None, chunk.error
            if chunk.final:
                outputs[chunk.request_id] = chunk.data
    return outputs


def diffusers_run(reference: Any, prompt: str, seed: int | None = 0, steps: int = 3, **kwargs: Any) -> dict[str, Any]:
    """The library's pipeline on one request (the outputs and the intermediates the tests compare)."""
    kwargs.setdefault("height", SIZE[1])
    kwargs.setdefault("width", SIZE[0])
    kwargs.setdefault("num_frames", FRAMES)
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    return reference(prompt=prompt, num_inference_steps=steps, output_type="pt",
                     output=["videos", "audio", "sampling_rate", "prompt_embeds", "text_token_tags"], **kwargs)


def to_uint8(videos: torch.Tensor) -> Any:
    return (videos[0].permute(0, 2, 3, 1) * 255.0).round().clamp(0, 255).to(torch.uint8).numpy()
