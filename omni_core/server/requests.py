"""Turning OpenAI request bodies into `OmniRequest`s (per-stage parameters, modalities, voice)."""

from __future__ import annotations

from typing import Any, Mapping

from omni_core.config.resolved import ResolvedPipeline
from omni_core.engine.request import OmniRequest, new_request_id
from omni_core.engine.vllm_inputs import request_from_vllm_prompt
from omni_core.media_access import MediaAccess
from omni_core.server.errors import APIError, to_api_error
from omni_core.server.media_urls import chat_messages, data_url
from omni_core.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageEditRequest,
    ImageGenerationRequest,
    SpeechRequest,
    TextRequest,
    VideoRequest,
)
from omni_core.engine.sampling_params_list import stage_params_from_list

# vLLM-Omni's top-level fields of /v1/images/generations and /v1/videos that go to the stage that
# draws (`drawing_params`) under the same names.
IMAGE_DRAWING_FIELDS = ("num_inference_steps", "guidance_scale", "negative_prompt")
VIDEO_DRAWING_FIELDS = (*IMAGE_DRAWING_FIELDS, "num_frames", "fps")

# OpenAI's sampling fields, and vLLM's extra ones, that go to the pipeline's first AR stage under
# the same names (vLLM's `SamplingParams`).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "allowed_token_ids", "bad_words",
)

MAX_TOP_LOGPROBS = 20  # OpenAI's bound (and vLLM's default max_logprobs)

# OpenAI's and vLLM's fields of chat completions and completions that Omni does not implement, each
# with what a request may still send (the values that ask for nothing): any other value is a 400
# naming the field, never silently dropped.
_UNSUPPORTED_TEXT_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "best_of": (None, 1),
    "echo": (None, False),
    "prompt_logprobs": (None,),
}
UNSUPPORTED_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_TEXT_FIELDS,
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    # vLLM's
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
}
UNSUPPORTED_COMPLETION_FIELDS: dict[str, tuple[Any, ...]] = {**_UNSUPPORTED_TEXT_FIELDS, "suffix": (None, ""), "prompt_embeds": (None,)}

# A prompt's text is refused before it is tokenized when it is longer than this many characters per
# token of the first AR stage's context: no tokenizer packs that much text into one token, so such a
# prompt cannot fit, and tokenizing megabytes costs seconds of CPU for nothing.
PROMPT_CHARS_PER_TOKEN = 32
# The limit of a pipeline without an AR stage (or whose AR stage names no max_model_len).
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
# The modalities a chat completion message carries (`message.content`, `message.audio`).
CHAT_MODALITIES = ("text", "audio", "image")  # what a chat answer carries (images as content parts)


def check_model(pipeline_model: str, served_name: str, requested: str | None) -> None:
    """A request names the served model (its served name or path), or none (as vLLM takes it)."""
    if requested is not None and requested not in (served_name, pipeline_model):
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served_name!r}", param="model", code="model_not_found")


def first_ar_stage(pipeline: ResolvedPipeline) -> str | None:
    return next((s.name for s in pipeline.stages if s.kind == "ar"), None)


def drawing_stage(pipeline: ResolvedPipeline) -> str | None:
    """The stage that draws a pipeline's images and videos: its last ``diffusion`` stage."""
    return next((s.name for s in reversed(pipeline.stages) if s.kind == "diffusion"), None)


def drawing_params(
    pipeline: ResolvedPipeline, body: Any, fields: tuple[str, ...], takes: Mapping[str, frozenset[str]] | None = None
) -> dict[str, dict[str, Any]]:
    """vLLM-Omni's top-level diffusion fields of a media request (`fields` of `body`, those set), as
    per-stage parameters of the stage that draws (`drawing_stage`). One that stage does not take
    (`takes`: the engine's `param_names`, where its model declares them) is a 400 naming the field."""
    values = {name: getattr(body, name) for name in fields if getattr(body, name) is not None}
    if not values:
        return {}
    target = drawing_stage(pipeline)
    known = (takes or {}).get(target) if target is not None else frozenset()
    for name in values:
        if known is not None and name not in known:
            where = f"this model's {target!r} stage does not take it (it takes: {', '.join(sorted(known))})" if target is not None else "this model has no diffusion stage"
            raise APIError(400, f"{name} is not supported here: {where}", param=name)
    return {target: values}


def max_model_len(pipeline: ResolvedPipeline) -> int | None:
    """The first AR stage's context (its ``max_model_len`` option), or None."""
    name = first_ar_stage(pipeline)
    length = pipeline.stage(name).options.get("max_model_len") if name is not None else None
    return int(length) if length else None


def max_prompt_chars(pipeline: ResolvedPipeline) -> int:
    """The longest prompt text (characters) this pipeline's requests may carry: the first AR
    stage's ``max_model_len`` x `PROMPT_CHARS_PER_TOKEN`, else `DEFAULT_MAX_PROMPT_CHARS`."""
    length = max_model_len(pipeline)
    return length * PROMPT_CHARS_PER_TOKEN if length else DEFAULT_MAX_PROMPT_CHARS


def check_prompt_size(chars: int, limit: int | None, param: str) -> None:
    """A 400 for a prompt longer than `limit` characters (``None``: no limit), before any tokenizing."""
    if limit is not None and chars > limit:
        raise APIError(
            400,
            f"the prompt is {chars} characters; this server takes at most {limit} (--max-prompt-chars; by default "
            f"{PROMPT_CHARS_PER_TOKEN} characters per token of the model's context): shorten it",
            param=param,
            code="prompt_too_long",
        )


def message_chars(messages: list[Any]) -> int:
    """The characters of text in chat messages (string contents and text parts)."""
    total = 0
    for message in messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.text) for part in content if getattr(part, "text", None) is not None)
    return total


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
    (-> the first AR stage), then `listed` (vLLM-Omni's per-stage fields, already mapped to stage
    names: its ``sampling_params_list``, its media routes' diffusion fields), then `stage_params`
    (extension) per named stage."""
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


def chat_default_modalities(pipeline: ResolvedPipeline) -> tuple[str, ...]:
    """What a chat completion naming no `modalities` returns: the family's defaults (as vLLM-Omni,
    every final output of the model: text and audio for Qwen3-Omni; an image for a text-to-image
    family) when a chat message carries them all (text, audio, images as content parts); else
    ``("text",)``: a family whose defaults are videos is asked for text here (its media route is
    /v1/videos)."""
    defaults = pipeline.default_modalities
    return tuple(defaults) if defaults and all(m in CHAT_MODALITIES for m in defaults) else ("text",)


def chat_request(body: ChatCompletionRequest, pipeline: ResolvedPipeline, media: MediaAccess = MediaAccess(), max_chars: int | None = None) -> OmniRequest:
    """The request a chat completion body makes. Blocking (an allowed media URL is read, `media`):
    call it in a thread."""
    if body.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    for field, harmless in UNSUPPORTED_CHAT_FIELDS.items():
        if getattr(body, field) not in harmless:
            raise APIError(400, f"{field} is not supported by Omni's chat completions: leave it out", param=field)
    if not body.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    check_prompt_size(message_chars(body.messages), max_chars, "messages")
    listed = stage_params_from_list(pipeline, body.sampling_params_list) if body.sampling_params_list is not None else None
    # A named task without modalities gets its own (`TaskSpec.modalities`), not the chat defaults.
    if body.modalities is not None and not body.modalities:
        raise APIError(400, 'modalities must name at least one of text, audio, image (or be left out: the model\'s defaults)', param="modalities")
    modalities = tuple(body.modalities) if body.modalities else (() if body.task else chat_default_modalities(pipeline))
    for modality in modalities:
        if modality not in pipeline.modalities:
            elsewhere = " (its videos come from /v1/videos)" if "video" in pipeline.modalities else ""
            raise APIError(
                400, f"this model does not produce {modality}; it produces {', '.join(pipeline.modalities)}{elsewhere}",
                param="modalities", code="unsupported_modality",
            )
        if modality not in CHAT_MODALITIES:
            raise APIError(
                400, f"a chat completion carries {', '.join(CHAT_MODALITIES)}, not {modality}: ask /v1/videos for videos",
                param="modalities", code="unsupported_modality",
            )
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = _sampling(body, top, "top_logprobs", max_tokens)
    extra: dict[str, Any] = {}
    if body.audio is not None and body.audio.voice:
        extra["voice"] = body.audio.voice
    if body.mm_processor_kwargs:
        extra["mm_processor_kwargs"] = dict(body.mm_processor_kwargs)
    return OmniRequest(
        messages=chat_messages(body.messages, media),
        modalities=modalities or None,
        params=stage_params(pipeline, sampling, body.stage_params, listed),
        task=body.task,
        extra=extra,
        request_id=f"chatcmpl-{new_request_id()[4:]}",
    )


def _sampling(body: TextRequest, top: int | None, top_param: str, max_tokens: int | None) -> dict[str, Any]:
    """The first AR stage's parameters from a chat or completion body's sampling fields: `top` the
    count of top log-probabilities asked for (None: none; named `top_param` in the body)."""
    sampling = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"{top_param} must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", param=top_param)
        sampling["logprobs"] = top  # (vLLM's: the sampled token's, and this many top ones)
    if body.response_format is not None:
        structured = structured_outputs(body.response_format)
        if structured is not None:
            if body.structured_outputs is not None:
                raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
            sampling["structured_outputs"] = structured
    if body.structured_outputs is not None:  # vLLM's own form (json, regex, choice, grammar, ...)
        sampling["structured_outputs"] = body.structured_outputs
    if max_tokens is not None:
        if max_tokens < 1:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
        sampling["max_tokens"] = max_tokens
    return sampling


def completion_requests(body: CompletionRequest, pipeline: ResolvedPipeline, max_chars: int | None = None) -> list[OmniRequest]:
    """The requests a completion body makes, one per prompt of its batch: each prompt as vLLM takes
    one (`request_from_vllm_prompt`: text tokenized as it is, or token ids), text out."""
    check_produces(pipeline, "text", "/v1/completions")
    if body.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    for field, harmless in UNSUPPORTED_COMPLETION_FIELDS.items():
        if getattr(body, field) not in harmless:
            raise APIError(400, f"{field} is not supported by Omni's completions: leave it out", param=field)
    prompts = _completion_prompts(body.prompt)
    check_prompt_size(sum(len(p) for p in prompts if isinstance(p, str)), max_chars, "prompt")
    params = stage_params(pipeline, _sampling(body, body.logprobs, "logprobs", body.max_tokens), body.stage_params)
    batch = new_request_id()[4:]
    requests = []
    for index, prompt in enumerate(prompts):
        request = request_from_vllm_prompt({"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}, params)
        request.modalities = ("text",)
        request.request_id = f"cmpl-{batch}" + (f"-{index}" if len(prompts) > 1 else "")
        requests.append(request)
    return requests


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's `prompt`: a string, token ids, or a non-empty list of either."""

    def token_ids(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)

    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError(400, "prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompts


def structured_outputs(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as vLLM's ``structured_outputs`` (the text stage decodes under its
    grammar): ``json_object`` any JSON object, ``json_schema`` its ``schema``; ``text`` nothing."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema (a JSON schema object)", param="response_format")
        return {"json": spec["schema"]}
    raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}", param="response_format")


def speech_request(body: SpeechRequest, pipeline: ResolvedPipeline, max_chars: int | None = None) -> OmniRequest:
    check_produces(pipeline, "audio", "/v1/audio/speech")
    check_prompt_size(len(body.input) + len(body.instructions or ""), max_chars, "input")
    if not body.input.strip():
        raise APIError(400, "input must not be empty", param="input")
    if body.speed is not None and body.speed != 1.0:
        raise APIError(400, f"speed {body.speed} is not supported: the audio comes at the model's own pace (1.0)", param="speed")
    extra: dict[str, Any] = {"task": "speech"}
    if body.voice:
        extra["voice"] = body.voice
    if body.instructions:
        extra["instructions"] = body.instructions
    return OmniRequest(prompt=body.input, modalities=("audio",), params=stage_params(pipeline, {}, body.stage_params), extra=extra, request_id=f"speech-{new_request_id()[4:]}")


def image_request(
    body: ImageGenerationRequest, pipeline: ResolvedPipeline, max_chars: int | None = None, takes: Mapping[str, frozenset[str]] | None = None,
    route: str = "/v1/images/generations",
) -> OmniRequest:
    check_produces(pipeline, "image", route)
    check_prompt_size(len(body.prompt), max_chars, "prompt")
    if not 1 <= body.n <= 8:
        raise APIError(400, "n must be between 1 and 8", param="n")
    if body.response_format == "url":
        raise APIError(400, "response_format 'url' is not supported: the server keeps no image files; ask for 'b64_json'", param="response_format")
    if body.output_compression is not None and not 0 <= body.output_compression <= 100:
        raise APIError(400, f"output_compression must be between 0 and 100, got {body.output_compression}", param="output_compression")
    if body.background == "transparent":
        raise APIError(400, "background 'transparent' is not supported: the images have no alpha channel ('auto' or 'opaque')", param="background")
    extra: dict[str, Any] = {"n": body.n}
    if body.size and body.size.lower() != "auto":
        extra["size"] = parse_size(body.size)
    if body.seed is not None:
        extra["seed"] = body.seed
    drawing = drawing_params(pipeline, body, IMAGE_DRAWING_FIELDS, takes)
    return OmniRequest(
        prompt=body.prompt, modalities=("image",), params=stage_params(pipeline, {}, body.stage_params, drawing), extra=extra,
        task=body.task, request_id=f"img-{new_request_id()[4:]}",
    )


MAX_EDIT_IMAGES = 16  # images one edit request may carry (a family takes fewer: its input processor says how many)


def image_edit_request(
    body: ImageEditRequest, pipeline: ResolvedPipeline, media: MediaAccess = MediaAccess(), max_chars: int | None = None,
    takes: Mapping[str, frozenset[str]] | None = None,
) -> OmniRequest:
    """The request an edit body makes: `image_request`'s, with the images before the prompt in one
    user message (``image_url`` parts, each a checked ``data:`` URL). Blocking (an allowed media URL
    is read, `media`): call it in a thread."""
    request = image_request(body, pipeline, max_chars, takes, route="/v1/images/edits")
    if body.mask is not None:
        raise APIError(400, "mask (inpainting) is not supported: the model edits the whole image from the prompt", param="mask")
    if body.image is not None and body.images is not None:
        raise APIError(400, "give the images once: image or images", param="images")
    field = "images" if body.images is not None else "image"
    given = body.images if body.images is not None else body.image
    items = given if isinstance(given, list) else [] if given is None else [given]
    if not items:
        raise APIError(400, "an edit needs an image (image: a file upload or a data URL)", param=field)
    if len(items) > MAX_EDIT_IMAGES:
        raise APIError(400, f"{field}: {len(items)} images; at most {MAX_EDIT_IMAGES}", param=field)
    content: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"{field}[{index}]" if isinstance(given, list) else field
        if isinstance(item, dict):
            if item.get("file_id") is not None:
                raise APIError(400, f"{where}: file_id is not supported (the server keeps no files); send image_url", param=where)
            item = item.get("image_url")
            item = item.get("url") if isinstance(item, dict) else item
        if not isinstance(item, str):
            raise APIError(400, f"{where} must be an image URL (a base64 data: URL), a file upload or {{\"image_url\": URL}}", param=where)
        content.append({"type": "image_url", "image_url": {"url": data_url(item, media, where, image=True)}})
    content.append({"type": "text", "text": body.prompt})
    request.messages, request.prompt = [{"role": "user", "content": content}], None
    request.request_id = f"imgedit-{new_request_id()[4:]}"
    return request


VIDEO_FRAME_FIELDS = {"input_reference": "image", "last_frame": "last_image"}
"""``/v1/videos``' frame fields -> the request fields (`OmniRequest.extra`) input processors read."""


def video_field_error(exc: BaseException) -> APIError:
    """`to_api_error` of a video request's failure, a refused field named as ``/v1/videos`` names it
    (``last_frame``, not the request field ``last_image`` an input processor names)."""
    api = to_api_error(exc)
    names = {key: field for field, key in VIDEO_FRAME_FIELDS.items()}
    api.param = names.get(api.param, api.param) if api.param else None
    return api


def video_request(
    body: VideoRequest, pipeline: ResolvedPipeline, media: MediaAccess = MediaAccess(), max_chars: int | None = None,
    takes: Mapping[str, frozenset[str]] | None = None,
) -> OmniRequest:
    """The request a video body makes. Blocking (an allowed media URL is read, `media`): call it
    in a thread."""
    check_produces(pipeline, "video", "/v1/videos")
    check_prompt_size(len(body.prompt), max_chars, "prompt")
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
    for field, key in VIDEO_FRAME_FIELDS.items():
        value = getattr(body, field)
        if isinstance(value, dict):  # OpenAI's image reference object
            if set(value) != {"image_url"} or not isinstance(value["image_url"], str):
                raise APIError(400, f"{field} as an object takes only image_url (file ids are not supported: send the image)", param=field)
            value = value["image_url"]
        if value is not None:
            value = data_url(value, media, field, image=True)
            if not value.startswith("data:image/"):
                raise APIError(400, f"{field} must be an image (data:image/png;base64,...)", param=field)
            extra[key] = value
    if body.references is not None:
        references = []
        for index, reference in enumerate(body.references):
            resolved = dict(reference)
            for name, value in reference.items():
                if name in ("type", "sample_rate"):
                    continue
                if not isinstance(value, str):
                    raise APIError(400, f"references[{index}].{name} must be a base64 data: URL", param=f"references[{index}].{name}")
                resolved[name] = data_url(value, media, f"references[{index}].{name}", image=name == "image")
            references.append(resolved)
        extra["references"] = references
    drawing = drawing_params(pipeline, body, VIDEO_DRAWING_FIELDS, takes)
    return OmniRequest(
        prompt=body.prompt, modalities=("video",), params=stage_params(pipeline, {}, body.stage_params, drawing), extra=extra,
        request_id=f"video_{new_request_id()[4:]}",
    )


def parse_size(size: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` -> (width, height)."""
    width, sep, height = size.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
        raise APIError(400, f"size must look like '512x512', got {size!r}", param="size")
    return int(width), int(height)
