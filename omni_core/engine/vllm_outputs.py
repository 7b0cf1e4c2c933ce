"""Omni's results in vLLM-Omni's output shape, for code written against vLLM-Omni's ``Omni.generate``.

vLLM-Omni returns one `OmniRequestOutput` per request and final stage (``stage_id``,
``final_output_type``, ``request_output``: vLLM ``RequestOutput`` objects whose ``outputs[0].text``
is the text and ``multimodal_output["audio"]`` the waveform, a torch tensor). Omni returns one
`OmniResult` per prompt (``text``, ``audio``, ``sample_rate``, ...). `vllm_omni_outputs` gives the
former from the latter, so that the loop of vLLM-Omni's Qwen3-Omni example runs unchanged::

    for stage_outputs in vllm_omni_outputs(omni.generate(prompts, sampling_params_list), omni.pipeline):
        if stage_outputs.final_output_type == "text":
            for output in stage_outputs.request_output:
                print(output.request_id, output.outputs[0].text)
        elif stage_outputs.final_output_type == "audio":
            for output in stage_outputs.request_output:
                audio = output.multimodal_output["audio"].float().detach().cpu().numpy()

Only the fields those examples read are there; ``prompt`` is None (Omni's results do not keep it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from omni_core.config.resolved import ResolvedPipeline
from omni_core.engine.result import OmniResult


@attrs.frozen
class CompletionView:
    """``RequestOutput.outputs[i]``: the text and its token ids."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    index: int = 0


@attrs.frozen
class RequestOutputView:
    """vLLM's ``RequestOutput`` as vLLM-Omni's examples read it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionView]
    multimodal_output: dict[str, Any] = attrs.field(factory=dict)
    finished: bool = True


@attrs.frozen
class StageOutputView:
    """vLLM-Omni's ``OmniRequestOutput``: one final stage's output for one request."""

    request_id: str
    stage_id: int
    final_output_type: str
    request_output: list[RequestOutputView]
    finished: bool = True


def vllm_omni_outputs(results: Sequence[OmniResult], pipeline: ResolvedPipeline) -> list[StageOutputView]:
    """Each result's text and audio as vLLM-Omni's outputs: per request, one per final output, in
    stage order (``stage_id``: the index of the stage that produced it in `pipeline`)."""
    stage_of = {}
    for index, stage in enumerate(pipeline.stages):
        for modality in stage.outputs:
            stage_of.setdefault(modality, index)
    views: list[StageOutputView] = []
    for result in results:
        found: list[tuple[int, str, RequestOutputView]] = []
        if result.token_ids or result.text:
            completion = CompletionView(result.text, list(result.token_ids), result.finish_reason)
            found.append((stage_of.get("text", 0), "text", RequestOutputView(result.request_id, None, result.prompt_token_ids, [completion])))
        if result.audio is not None:
            import torch

            audio = {"audio": torch.from_numpy(result.audio), "sr": result.sample_rate}
            found.append((stage_of.get("audio", 0), "audio", RequestOutputView(result.request_id, None, result.prompt_token_ids, [], audio)))
        for stage_id, kind, output in sorted(found, key=lambda item: item[0]):
            views.append(StageOutputView(result.request_id, stage_id, kind, [output]))
    return views
