"""Turning OpenAI request bodies into `OmniRequest`s (per-stage parameters, modalities, voice)."""

from __future__ import annotations

from typing import Any

from omni_core.config.resolved import ResolvedPipeline
from omni_core.engine.request import OmniRequest, new_request_id
from omni_core.server.errors import APIError
from omni_core.server.media_urls import chat_messages
from omni_core.server.protocol import (
    ChatCompletionRequest,
    ImageGenerationRequest,
    SpeechRequest,
    VideoRequest,
)
from omni_core.server.sampling_params_list import stage_params_from_list

# OpenAI sampling fields that go to the pipeline's first AR stage under the same names.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty")


def check_model(pipeline_model: str, served_name: str, requested: str) -> None:
    if requested not in (served_name, pipeline_model):
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served_name!r}", param="model", code="model_not_found")


def first_ar_stage(pipeline: ResolvedPipeline) -> str | None:
    return next((s.name for s in pipeline.stages if s.kind == "ar"), None)


def check_produces(pipeline: ResolvedPipeline, modality: str, route: str) -> None:
    if modality not in pipeline.modalities:
        produced = ", ".join(pipeline.modalities) or "nothing"
        raise APIError(400, f"{route} needs a model that produces {modality}; this model produces {produced}", code="unsupported_modality")


def stage_params(
    pipeline: ResolvedPipeline,
    sampling: dict[str, Any],
    extension: dict[str, dict[str, Any]] | None,
    listed: dict[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per-stage parameters, the more specific source winning per key: top-level sampling fields
    (-> the first AR stage), then `listed` (vLLM-Omni's ``sampling_params_list``, already mapped to
    stage names), then `stage_params` (extension) per named stage."""
    params: dict[str, dict[str, Any]] = {}
    target = first_ar_stage(pipeline)
    if sampling:
        if target is None:
            raise APIError(400, f"this model has no language-model stage for {', '.join(sampling)}; use stage_params", param=next(iter(sampling)))
        params[target] = dict(sampling)
    for name, values in (listed or {}).items():
        params[name] = {**params.get(name, {}), **values}
    names = [s.name for s in pipeline.stages]
    for name, values in (extension or {}).items():
        if name not in names:
            raise APIError(400, f"unknown stage {name!r} in stage_params; this pipeline's stages are {', '.join(names)}", param=f"stage_params.{name}")
        params[name] = {**params.get(name, {}), **values}
    return params


def chat_request(body: ChatCompletionRequest, pipeline: ResolvedPipeline) -> OmniRequest:
    if body.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if not body.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    listed = stage_params_from_list(pipeline, body.sampling_params_list) if body.sampling_params_list is not None else None
    # A vLLM-Omni client that sends parameters for every stage expects every stage to run (its
    # Qwen3-Omni example names no modalities and reads text and audio): without `modalities` it
    # gets all the pipeline produces. Plain OpenAI requests keep OpenAI's default, text.
    default = pipeline.modalities if listed is not None else ("text",)
    modalities = tuple(body.modalities or default)
    for modality in modalities:
        if modality not in pipeline.modalities:
            raise APIError(400, f"this model does not produce {modality}; it produces {', '.join(pipeline.modalities)}", param="modalities", code="unsupported_modality")
    sampling = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
        sampling["max_tokens"] = max_tokens
    extra: dict[str, Any] = {}
    if body.audio is not None and body.audio.voice:
        extra["voice"] = body.audio.voice
    if body.mm_processor_kwargs:
        extra["mm_processor_kwargs"] = dict(body.mm_processor_kwargs)
    return OmniRequest(
        messages=chat_messages(body.messages),
        modalities=modalities,
        params=stage_params(pipeline, sampling, body.stage_params, listed),
        extra=extra,
        request_id=f"chatcmpl-{new_request_id()[4:]}",
    )


def speech_request(body: SpeechRequest, pipeline: ResolvedPipeline) -> OmniRequest:
    check_produces(pipeline, "audio", "/v1/audio/speech")
    if not body.input.strip():
        raise APIError(400, "input must not be empty", param="input")
    extra: dict[str, Any] = {"task": "speech"}
    if body.voice:
        extra["voice"] = body.voice
    if body.instructions:
        extra["instructions"] = body.instructions
    return OmniRequest(prompt=body.input, modalities=("audio",), params=stage_params(pipeline, {}, body.stage_params), extra=extra, request_id=f"speech-{new_request_id()[4:]}")


def image_request(body: ImageGenerationRequest, pipeline: ResolvedPipeline) -> OmniRequest:
    check_produces(pipeline, "image", "/v1/images/generations")
    if not 1 <= body.n <= 8:
        raise APIError(400, "n must be between 1 and 8", param="n")
    extra: dict[str, Any] = {"n": body.n}
    if body.size:
        extra["size"] = parse_size(body.size)
    if body.seed is not None:
        extra["seed"] = body.seed
    return OmniRequest(prompt=body.prompt, modalities=("image",), params=stage_params(pipeline, {}, body.stage_params), extra=extra, request_id=f"img-{new_request_id()[4:]}")


def video_request(body: VideoRequest, pipeline: ResolvedPipeline) -> OmniRequest:
    check_produces(pipeline, "video", "/v1/videos")
    extra: dict[str, Any] = {}
    if body.size:
        extra["size"] = parse_size(body.size)
    if body.seconds:
        try:
            extra["seconds"] = float(body.seconds)
        except ValueError:
            raise APIError(400, f"seconds must be a number, got {body.seconds!r}", param="seconds") from None
    if body.seed is not None:
        extra["seed"] = body.seed
    for field, key in (("input_reference", "image"), ("last_frame", "last_image")):
        value = getattr(body, field)
        if value is not None:
            if not value.startswith("data:image/"):
                raise APIError(400, f"{field} must be a base64 data URL (data:image/png;base64,...); paths and URLs are not fetched", param=field)
            extra[key] = value
    if body.references is not None:
        for index, reference in enumerate(body.references):
            media = {k: v for k, v in reference.items() if k not in ("type", "sample_rate")}
            if not all(isinstance(v, str) and v.startswith("data:") for v in media.values()):
                raise APIError(400, f"references[{index}]: media must be base64 data URLs; paths and URLs are not fetched", param="references")
        extra["references"] = body.references
    return OmniRequest(prompt=body.prompt, modalities=("video",), params=stage_params(pipeline, {}, body.stage_params), extra=extra, request_id=f"video_{new_request_id()[4:]}")


def parse_size(size: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` -> (width, height)."""
    width, sep, height = size.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
        raise APIError(400, f"size must look like '512x512', got {size!r}", param="size")
    return int(width), int(height)
