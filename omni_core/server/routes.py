"""The OpenAI-compatible routes, one controller per resource."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Literal

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.enums import RequestEncodingType
from litestar.openapi import ResponseSpec
from litestar.di import NamedDependency
from litestar.params import Body, FromPath, FromQuery
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage
from typing_extensions import Annotated

from omni_core.engine.request import OmniRequest
from omni_core.errors import InvalidRequestError
from omni_core.outputs import OutputDelta
from omni_core.server.encoding import b64, encode_audio, encode_image, encode_png, image_size, pcm16
from omni_core.server.errors import APIError, to_api_error
from omni_core.server.forms import FormRequest
from omni_core.server.generation import Tracked, run_while_connected
from omni_core.server.media_urls import inline_media_params
from omni_core.server.protocol import (
    AssistantMessage,
    AudioOutput,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
    SpeechRequest,
    SSEEvent,
    Usage,
    VideoDeleted,
    VideoJob,
    VideoList,
    VideoRequest,
)
from omni_core.server.requests import (
    chat_request,
    check_model,
    completion_requests,
    image_edit_request,
    image_request,
    max_model_len,
    speech_request,
    video_field_error,
    video_request,
)
from omni_core.server.state import ServerState
from omni_core.server.videos import VARIANT_MEDIA_TYPES, VideoVariant

logger = logging.getLogger(__name__)


async def _omni_request(server: ServerState, build: Any, data: Any, *args: Any, request: Request | None = None) -> Any:
    """``build(data, pipeline, *args)`` (an `OmniRequest`, or a list of them), then their media stage parameters inlined
    (`inline_media_params`): in a thread, as an allowed media URL is read or fetched there.
    With the HTTP `request`, the fields of its body (JSON, or a form: `FormRequest`) that `data`'s
    type does not read are logged (once a field: as vLLM does, they are ignored; OpenAI's clients
    add fields of their own)."""
    body: Any = None
    if request is not None:
        # A form was parsed for `data` (`FormRequest` keeps it); a JSON body's keys are scanned in the
        # thread (a large body's, with its values left raw, takes milliseconds).
        body = await request.json() if request.content_type[0] == RequestEncodingType.MULTI_PART else await request.body()

    def run() -> OmniRequest | list[OmniRequest]:
        if request is not None:
            _note_ignored_fields(server, body, type(data), request.url.path)
        built: OmniRequest | list[OmniRequest] = build(data, server.engine.pipeline, *args)
        for omni_request in built if isinstance(built, list) else [built]:
            inline_media_params(omni_request.params, server.engine.media_params, server.media)
        return built

    return await asyncio.to_thread(run)


def _note_ignored_fields(server: ServerState, body: bytes | dict[str, Any], body_type: type, path: str) -> None:
    if isinstance(body, bytes):
        try:
            body = msgspec.json.decode(body, type=dict[str, msgspec.Raw])  # (the keys only: values stay raw)
        except msgspec.DecodeError:
            return
    ignored = sorted(set(body) - set(body_type.__struct_fields__) - server.ignored_fields)
    if ignored:
        server.ignored_fields.update(ignored)
        logger.warning("%s: request field%s %s ignored: not part of Omni's API (said once a field)", path, "s" * (len(ignored) > 1), ", ".join(ignored))


# Every error leaves as an OpenAI error body (see errors.py): document that, not Litestar's own shape.
ERROR_RESPONSES = {
    status: ResponseSpec(data_container=ErrorResponse, description=description)
    for status, description in (
        (400, "Invalid request"),
        (401, "Missing or invalid API key (when the server has one)"),
        (404, "Unknown model or resource"),
        (413, "Request body too large"),
        (415, "A body that is not JSON (nor, where the route takes one, a form)"),
        (500, "A stage failed"),
    )
}
SSE_RESPONSE = {
    200: ResponseSpec(data_container=SSEEvent, media_type="text/event-stream", description="Server-sent events when stream is true"),
    **ERROR_RESPONSES,
}


def _sse(events: AsyncIterator[str]) -> ServerSentEvent:
    """A stream of ``data: EVENT`` messages, each ended by a blank line of ``\n`` as vLLM's server
    ends them: clients that split the stream on ``"\n\n"`` (vLLM's own ``vllm bench serve``) miss
    events under Litestar's default ``\r\n`` when several arrive in one read."""

    async def messages() -> AsyncIterator[ServerSentEventMessage]:
        try:
            async for event in events:
                yield ServerSentEventMessage(data=event, sep="\n")
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return ServerSentEvent(messages())


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _usage(tracked: Tracked) -> Usage:
    prompt = len(tracked.result.prompt_token_ids or [])
    completion = len(tracked.result.token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _error_event(exc: BaseException) -> str:
    api = to_api_error(exc)
    return _json({"error": ErrorDetail(message=str(api), type=api.type, param=api.param, code=api.code)})


class ChatController(Controller):
    path = "/v1/chat/completions"
    tags = ["chat"]

    @post(status_code=200, responses=SSE_RESPONSE, summary="Create a chat completion (text, or text + audio)")
    async def create(self, data: Annotated[ChatCompletionRequest, Body()], server: NamedDependency[ServerState], request: Request) -> Response[Any]:
        check_model(server.engine.pipeline.model, server.model_name, data.model)
        omni_request = await _omni_request(server, chat_request, data, server.media, server.max_prompt_chars, request=request)
        audio_format = data.audio.format if data.audio else "wav"
        tracked = await Tracked.start_request(server.engine, omni_request, server.metrics)
        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            logprobs = (data.top_logprobs or 0) if data.logprobs else None
            return _sse(_chat_events(tracked, await tracked.open_stream(), server.model_name, include_usage, logprobs))
        result = await tracked.run_while_connected(request.receive)
        audio = None
        if result.audio is not None:
            encoded, _ = await asyncio.to_thread(encode_audio, result.audio, result.sample_rate or 24000, audio_format)
            audio = AudioOutput(id=f"audio_{uuid.uuid4().hex[:16]}", data=b64(encoded), expires_at=int(time.time()) + 3600, transcript=result.text)
        content: str | list[dict[str, Any]] | None = result.text
        if result.images:  # (image parts alone where no text stage answered, as vLLM-Omni answers an image request)
            text_part = [{"type": "text", "text": result.text}] if result.text or result.finish_reason is not None else []
            content = [*text_part, *await asyncio.to_thread(_image_parts, result.images)]
        message = AssistantMessage(role="assistant", content=content, audio=audio)
        body = ChatCompletion(
            id=omni_request.request_id,
            created=int(time.time()),
            model=server.model_name,
            choices=[
                Choice(
                    index=0, message=message, finish_reason=result.reported_finish_reason,
                    logprobs={"content": _logprob_entries(result.token_ids, result.logprobs, data.top_logprobs or 0)} if data.logprobs else None,
                )
            ],
            usage=_usage(tracked),
        )
        return Response(msgspec.json.encode(body), media_type="application/json")


def _image_parts(images: list[Any]) -> list[dict[str, Any]]:
    """Output images as chat content parts: ``image_url`` with a base64 PNG ``data:`` URL (PNG
    encoding takes a while for a large image: call it off the event loop)."""
    return [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(encode_png(image))}"}} for image in images]


def _logprob_entries(token_ids: list[int], positions: list[Any], top: int) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: per generated token its text, logprob and UTF-8 bytes, with the
    `top` likeliest tokens (`positions`: the ``ar`` stage's ``(token_id, logprob, rank, text)`` per
    token; vLLM's -inf becomes -9999.0, as in vLLM's server, since JSON has no infinity)."""

    def entry(token: str | None, logprob: float) -> dict[str, Any]:
        text = token or ""
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, candidates in zip(token_ids, positions):
        sampled = next((c for c in candidates if c[0] == token_id), None)
        if sampled is None:
            continue
        ranked = sorted((c for c in candidates if c[2] is not None and c[2] <= top), key=lambda c: c[2])
        content.append({**entry(sampled[3], sampled[1]), "top_logprobs": [entry(c[3], c[1]) for c in ranked[:top]]})
    return content


async def _chat_events(
    tracked: Tracked, deltas: AsyncIterator[OutputDelta], model: str, include_usage: bool, logprobs: int | None = None
) -> AsyncIterator[str]:
    """The chat completion's SSE events; `logprobs` (the top count) adds each text chunk's tokens'."""
    created = int(time.time())
    base = {"id": tracked.request.request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    audio_id = f"audio_{uuid.uuid4().hex[:16]}"
    pending: list[dict[str, Any]] = []  # logprobs of tokens not yet sent (a token may add no text)

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        if logprobs is not None and ("content" in delta or finish_reason is not None):
            choice["logprobs"] = {"content": pending[:]}
            pending.clear()
        return json.dumps({**base, "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for delta in deltas:
            if delta.modality == "text" and logprobs is not None:
                pending += _logprob_entries(delta.data.get("token_ids") or [], delta.data.get("logprobs") or [], logprobs)
            if delta.modality == "text" and delta.data.get("text"):
                yield chunk({"content": delta.data["text"]})
            elif delta.modality == "audio" and delta.data.get("audio") is not None and len(delta.data["audio"]):
                yield chunk({"audio": {"id": audio_id, "data": b64(pcm16(delta.data["audio"])), "sample_rate": delta.data.get("sample_rate")}})
            elif delta.modality == "image" and delta.data.get("image") is not None:
                images = delta.data["image"] if isinstance(delta.data["image"], list) else [delta.data["image"]]
                yield chunk({"content": await asyncio.to_thread(_image_parts, images)})
    except Exception as exc:  # the stream has started: report in-band, then end it
        yield _error_event(exc)
        yield "[DONE]"
        return
    yield chunk({}, tracked.result.reported_finish_reason)
    if include_usage:
        yield json.dumps({**base, "choices": [], "usage": msgspec.to_builtins(_usage(tracked))})
    yield "[DONE]"


class CompletionsController(Controller):
    path = "/v1/completions"
    tags = ["completions"]

    @post(status_code=200, responses=SSE_RESPONSE, summary="Create a completion (the prompt's text continued as it is, no chat template)")
    async def create(self, data: Annotated[CompletionRequest, Body()], server: NamedDependency[ServerState], request: Request) -> Response[Any]:
        check_model(server.engine.pipeline.model, server.model_name, data.model)
        batch = await _start_all(server, await _omni_request(server, completion_requests, data, server.max_prompt_chars, request=request))
        if data.stream:
            streams: list[AsyncIterator[OutputDelta]] = []
            try:
                for tracked in batch:
                    streams.append(await tracked.open_stream())
            except BaseException:
                await _close_all(batch, streams)
                raise
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            return _sse(_completion_events(batch, streams, server.model_name, include_usage, data.logprobs))
        results = await run_while_connected(batch, request.receive)
        choices = [
            CompletionChoice(
                index=index, text=result.text, finish_reason=result.reported_finish_reason,
                logprobs=_completion_logprobs(_logprob_entries(result.token_ids, result.logprobs, data.logprobs)) if data.logprobs is not None else None,
            )
            for index, result in enumerate(results)
        ]
        body = Completion(id=_completion_id(batch), created=int(time.time()), model=server.model_name, choices=choices, usage=_batch_usage(batch))
        return Response(msgspec.json.encode(body), media_type="application/json")


async def _start_all(server: ServerState, requests: list[OmniRequest]) -> list[Tracked]:
    """Submit every request of a batch, or none: one the engine refuses aborts those already in."""
    batch: list[Tracked] = []
    try:
        for omni_request in requests:
            batch.append(await Tracked.start_request(server.engine, omni_request, server.metrics))
    except BaseException:
        await _close_all(batch, [])
        raise
    return batch


async def _close_all(batch: list[Tracked], streams: list[AsyncIterator[OutputDelta]]) -> None:
    """Abort a batch's requests in every stage (their opened streams first)."""
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]
    for tracked in batch:
        await tracked.stream.aclose()  # type: ignore[attr-defined]


def _completion_id(batch: list[Tracked]) -> str:
    """The completion's id: its requests' (``cmpl-X``; a batch's are ``cmpl-X-0``, ``cmpl-X-1``, ...)."""
    return batch[0].request.request_id.removesuffix("-0")


def _batch_usage(batch: list[Tracked]) -> Usage:
    usages = [_usage(tracked) for tracked in batch]
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _completion_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """Chat's per-token entries (`_logprob_entries`) as OpenAI's completions lay them out; `offset`
    is the first token's place in the completion's text."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": [entry["token"] for entry in entries],
        "token_logprobs": [entry["logprob"] for entry in entries],
        "top_logprobs": [{top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in entries],
        "text_offset": offsets,
    }


async def _merged(streams: list[AsyncIterator[OutputDelta]]) -> AsyncIterator[tuple[int, OutputDelta | None]]:
    """The deltas of several streams as they come, each tagged with its stream's index; ``(i, None)``
    when stream i has ended. Closing this early closes them all (their requests are aborted)."""
    queue: asyncio.Queue[tuple[int, OutputDelta | None, Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[OutputDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta, None))
            queue.put_nowait((index, None, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))

    pumps = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while True:
                index, delta, exc = await queue.get()
                if exc is not None:
                    raise exc
                yield index, delta
                if delta is None:
                    break
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def _completion_events(
    batch: list[Tracked], streams: list[AsyncIterator[OutputDelta]], model: str, include_usage: bool, logprobs: int | None
) -> AsyncIterator[str]:
    """A completion's SSE events: each prompt's text as it comes (its choice's `index`), then each
    one's end with its finish reason; `logprobs` (the top count) adds the tokens' log-probabilities."""
    base = {"id": _completion_id(batch), "object": "text_completion", "created": int(time.time()), "model": model}
    offsets = [0] * len(batch)

    def chunk(index: int, text: str, finish_reason: str | None, entries: list[dict[str, Any]] | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if entries is not None:
            choice["logprobs"] = _completion_logprobs(entries, offsets[index])
            offsets[index] += sum(len(entry["token"]) for entry in entries)
        return json.dumps({**base, "choices": [choice]})

    try:
        async for index, delta in _merged(streams):
            if delta is None:
                yield chunk(index, "", batch[index].result.reported_finish_reason, [] if logprobs is not None else None)
            elif delta.modality == "text" and (delta.data.get("text") or (logprobs is not None and delta.data.get("token_ids"))):
                entries = _logprob_entries(delta.data.get("token_ids") or [], delta.data.get("logprobs") or [], logprobs) if logprobs is not None else None
                yield chunk(index, delta.data.get("text") or "", None, entries)
    except Exception as exc:  # the stream has started: report in-band, then end it
        yield _error_event(exc)
        yield "[DONE]"
        return
    if include_usage:
        yield json.dumps({**base, "choices": [], "usage": msgspec.to_builtins(_batch_usage(batch))})
    yield "[DONE]"


class AudioController(Controller):
    path = "/v1/audio"
    tags = ["audio"]

    @post("/speech", status_code=200, responses={200: ResponseSpec(data_container=bytes, media_type="audio/wav", description="The audio file, or server-sent events with stream_format sse"), **ERROR_RESPONSES}, summary="Text to speech")
    async def speech(self, data: Annotated[SpeechRequest, Body()], server: NamedDependency[ServerState], request: Request) -> Response[Any]:
        check_model(server.engine.pipeline.model, server.model_name, data.model)
        omni_request = await _omni_request(server, speech_request, data, server.max_prompt_chars, request=request)
        tracked = await Tracked.start_request(server.engine, omni_request, server.metrics)
        if data.stream_format == "sse":
            return _sse(_speech_events(tracked, await tracked.open_stream()))
        result = await tracked.run_while_connected(request.receive)
        if result.audio is None:
            raise APIError(500, "the pipeline produced no audio", type="server_error")
        encoded, media_type = await asyncio.to_thread(encode_audio, result.audio, result.sample_rate or 24000, data.response_format)
        return Response(encoded, media_type=media_type)


async def _speech_events(tracked: Tracked, deltas: AsyncIterator[OutputDelta]) -> AsyncIterator[str]:
    try:
        async for delta in deltas:
            if delta.modality == "audio" and delta.data.get("audio") is not None and len(delta.data["audio"]):
                yield json.dumps({"type": "speech.audio.delta", "audio": b64(pcm16(delta.data["audio"])), "sample_rate": delta.data.get("sample_rate")})
    except Exception as exc:
        yield _error_event(exc)
        return
    yield json.dumps({"type": "speech.audio.done", "duration_s": tracked.result.audio_duration})


class _ImageEditForm(FormRequest):
    """``POST /v1/images/edits`` also as a form, as OpenAI's client sends it (the images as file uploads)."""

    json_fields = frozenset({"n", "seed", "num_inference_steps", "guidance_scale", "output_compression", "stage_params"})


class ImagesController(Controller):
    path = "/v1/images"
    tags = ["images"]

    @post("/generations", status_code=200, responses=ERROR_RESPONSES, summary="Generate images from a prompt")
    async def generations(self, data: Annotated[ImageGenerationRequest, Body()], server: NamedDependency[ServerState], request: Request) -> ImagesResponse:
        check_model(server.engine.pipeline.model, server.model_name, data.model)
        omni_request = await _omni_request(server, image_request, data, server.max_prompt_chars, server.engine.param_names, request=request)
        tracked = await Tracked.start_request(server.engine, omni_request, server.metrics)
        result = await tracked.run_while_connected(request.receive)
        return _images_response(result, data)

    @post("/edits", status_code=200, responses=ERROR_RESPONSES, summary="Edit images from a prompt", request_class=_ImageEditForm)
    async def edits(self, data: Annotated[ImageEditRequest, Body()], server: NamedDependency[ServerState], request: Request) -> ImagesResponse:
        check_model(server.engine.pipeline.model, server.model_name, data.model)
        omni_request = await _omni_request(server, image_edit_request, data, server.media, server.max_prompt_chars, server.engine.param_names, request=request)
        tracked = await Tracked.start_request(server.engine, omni_request, server.metrics)
        result = await tracked.run_while_connected(request.receive)
        return _images_response(result, data)


def _images_response(result: Any, data: ImageGenerationRequest) -> ImagesResponse:
    images = [encode_image(image, data.output_format, data.output_compression) for image in result.images]
    size = image_size(result.images[0]) if result.images else None
    return ImagesResponse(created=int(time.time()), data=[ImageData(b64_json=b64(image)) for image in images], output_format=data.output_format, size=size)


class _VideoForm(FormRequest):
    """``POST /v1/videos`` also as a form, as OpenAI's client sends it (`omni_core.server.forms`)."""

    json_fields = frozenset({"seed", "num_frames", "fps", "num_inference_steps", "guidance_scale", "stage_params", "references"})


class VideosController(Controller):
    path = "/v1/videos"
    tags = ["videos"]

    @post(status_code=200, responses=ERROR_RESPONSES, summary="Start a video generation job", request_class=_VideoForm)
    async def create(self, data: Annotated[VideoRequest, Body()], server: NamedDependency[ServerState], request: Request) -> VideoJob:
        check_model(server.engine.pipeline.model, server.model_name, data.model)
        omni_request = await _omni_request(server, video_request, data, server.media, server.max_prompt_chars, server.engine.param_names, request=request)
        try:
            tracked = await Tracked.start_request(server.engine, omni_request, server.metrics)
        except InvalidRequestError as exc:  # (an input processor names its request field: named as sent)
            raise video_field_error(exc) from None
        return server.videos.start(tracked, server.model_name, data.prompt, data.seconds, data.size)

    @get(responses={400: ERROR_RESPONSES[400], 404: ERROR_RESPONSES[404], 401: ERROR_RESPONSES[401]}, summary="The video jobs, a page at a time")
    async def list_videos(
        self, server: NamedDependency[ServerState], limit: FromQuery[int] = 20, after: FromQuery[str | None] = None,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
    ) -> VideoList:
        return server.videos.list(limit, after, order)

    @delete("/{video_id:str}", status_code=200, responses={404: ERROR_RESPONSES[404], 401: ERROR_RESPONSES[401]}, summary="Cancel a video job and forget it")
    async def delete_video(self, video_id: FromPath[str], server: NamedDependency[ServerState]) -> VideoDeleted:
        return await server.videos.delete(video_id)

    @get("/{video_id:str}", responses={404: ERROR_RESPONSES[404], 401: ERROR_RESPONSES[401]}, summary="A video job's status")
    async def retrieve(self, video_id: FromPath[str], server: NamedDependency[ServerState]) -> VideoJob:
        return server.videos.job(video_id)

    @get(
        "/{video_id:str}/content", responses={**ERROR_RESPONSES, 409: ResponseSpec(data_container=ErrorResponse, description="The video is not finished yet")},
        summary="The finished video (MP4), or its thumbnail (WebP) or spritesheet (JPEG)", media_type="video/mp4",
    )
    async def content(self, video_id: FromPath[str], server: NamedDependency[ServerState], variant: FromQuery[VideoVariant] = "video") -> Response[bytes]:
        return Response(server.videos.content(video_id, variant), media_type=VARIANT_MEDIA_TYPES[variant])


@get("/v1/models", tags=["models"], responses={401: ERROR_RESPONSES[401]}, summary="The served model")
async def list_models(server: NamedDependency[ServerState]) -> ModelList:
    pipeline = server.engine.pipeline
    card = ModelCard(id=server.model_name, created=server.created, root=str(pipeline.model_path) or None, max_model_len=max_model_len(pipeline))
    return ModelList(data=[card])


@get("/health", tags=["health"], summary="Liveness and readiness of every stage replica")
async def health(server: NamedDependency[ServerState]) -> Response[Any]:
    replicas = await server.engine.health()
    healthy = bool(replicas) and all(r.get("healthy") for r in replicas)
    body: dict[str, Any] = {"status": "ok" if healthy else "unhealthy", "replicas": replicas}
    if not healthy:
        # What a probe's log shows: one line per replica that is down, naming its stage and why.
        body["errors"] = [r.get("error") or f"stage {r['stage']!r} replica {r['replica']} is {r.get('state', 'not ready')}" for r in replicas if not r.get("healthy")]
    return Response(body, status_code=200 if healthy else 503)


@get("/metrics", tags=["metrics"], summary="Prometheus metrics", media_type="text/plain; version=0.0.4")
async def metrics(server: NamedDependency[ServerState]) -> Response[bytes]:
    return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")


ROUTES = [ChatController, CompletionsController, AudioController, ImagesController, VideosController, list_models, health, metrics]
