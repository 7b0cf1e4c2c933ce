"""A generation model part that copies its input frames to its output: a stage with no compute.

Used by the ``toy-passthrough`` family (fast engine tests without vLLM) and by benchmarks that
measure the framework's own overhead (scheduling, connectors, routing) with a zero-cost stage.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from omni_core.parts import InputProcessor, PartContext
from omni_core.stages.generation_model import DecodeBatch, DecodeItem, GenerationModel
from omni_toy import fail_hook

SAMPLE_RATE = 16000


class PassThroughModel(GenerationModel):
    """Frames in (``codes``, any shape ``[T, ...]``), the same values out as float32 ``audio``.

    The deploy option ``chunk_size`` of the stage overrides the default chunk of 16 frames. It
    honours the test hook of `omni_toy.fail_hook` (stage parameter ``fail``).
    """

    input_key = "codes"
    output_key = "audio"
    request_params = fail_hook.PARAMS
    chunk_size = 16
    left_context = 0
    samples_per_frame = 1
    extra_outputs = types.MappingProxyType({"sample_rate": SAMPLE_RATE})

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.device = torch.device("cpu")

    def load(self, device: str, dtype: str) -> None:
        self.device = torch.device(device)

    def check_params(self, params: dict[str, Any]) -> None:
        fail_hook.check_params(params)

    def check(self, item: DecodeItem) -> None:
        fail_hook.check_item(item)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        fail_hook.before_decode(batch)
        frames, _lengths = batch.padded(device=self.device)
        return frames.to(torch.float32)


class PromptBytesProcessor(InputProcessor):
    """Input processor of ``toy-passthrough``: the prompt's UTF-8 bytes as frames.

    ``request.extra["codes"]`` (a tensor or list, ``[T, ...]``) is used instead when given, so a
    benchmark can send payloads of any size.
    """

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.entry_stages = [stage.name for stage in context.pipeline.stages if not stage.inputs]

    def process(self, request: Any) -> dict[str, Any]:
        from omni_core.errors import InvalidRequestError
        from omni_core.outputs import StageInput

        extra = getattr(request, "extra", None) or {}
        if "codes" in extra:
            codes = extra["codes"]
        elif isinstance(getattr(request, "prompt", None), str):
            codes = torch.tensor(list(request.prompt.encode("utf-8")), dtype=torch.long)
        else:
            raise InvalidRequestError("toy-passthrough needs a text prompt or extra['codes']", param="prompt")
        return {name: StageInput(data={"codes": codes}, final=True) for name in self.entry_stages}
