"""Request and response bodies of the OpenAI-compatible API (msgspec Structs: typed, fast, documented)."""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

# -- chat content parts ---------------------------------------------------------------------------


class ImageURL(msgspec.Struct):
    url: str
    detail: str | None = None


class AudioData(msgspec.Struct):
    data: str
    format: str = "wav"


class MediaURL(msgspec.Struct):
    url: str


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: ImageURL


class InputAudioPart(msgspec.Struct, tag_field="type", tag="input_audio"):
    input_audio: AudioData


class AudioURLPart(msgspec.Struct, tag_field="type", tag="audio_url"):
    audio_url: MediaURL


class VideoURLPart(msgspec.Struct, tag_field="type", tag="video_url"):
    video_url: MediaURL


ContentPart = Union[TextPart, ImagePart, InputAudioPart, AudioURLPart, VideoURLPart]


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class AudioParams(msgspec.Struct):
    voice: str | None = None
    format: Literal["wav", "pcm16", "flac", "mp3", "opus", "aac"] = "wav"


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class TextRequest(msgspec.Struct, kw_only=True):
    """What chat completions and completions share: the served model, streaming, OpenAI's sampling
    fields and vLLM's extra ones (the first AR stage's), `stage_params` (extension: parameters per
    named stage), and fields Omni does not implement, read so that a request setting one is refused
    (400) rather than answered as if it had not asked (`UNSUPPORTED_CHAT_FIELDS`,
    `UNSUPPORTED_COMPLETION_FIELDS`)."""

    model: str | None = None  # unset: the served model (as vLLM takes it)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stage_params: dict[str, dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extra sampling fields (its chat completions and completions take them top-level).
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    # not implemented (refused unless they ask for nothing)
    use_beam_search: bool | None = None
    best_of: int | None = None
    echo: bool | None = None
    prompt_logprobs: int | None = None


class ChatCompletionRequest(TextRequest, kw_only=True):
    """``POST /v1/chat/completions``. `sampling_params_list` (as in vLLM-Omni) one dict of vLLM
    sampling parameters per stage, in stage order (`omni_core.engine.sampling_params_list`;
    `stage_params` wins per key); `mm_processor_kwargs` (as in vLLM) options of the model family's
    multimodal input processing; `task` (extension) names the pipeline task of a family that declares
    tasks (else the modalities pick it).
    Media parts take base64 ``data:`` URLs, and the ``file://`` / ``http(s)://`` URLs the operator
    allowed (`omni_core.server.media_urls`, `omni_core.media_access`)."""

    messages: list[ChatMessage]
    modalities: list[Literal["text", "audio", "image", "video"]] | None = None
    audio: AudioParams | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    task: str | None = None
    sampling_params_list: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # not implemented (refused unless they ask for nothing)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(TextRequest, kw_only=True):
    """``POST /v1/completions`` (OpenAI's legacy completions, as vLLM serves them): raw text continued
    by the pipeline's text stage, no chat template. `prompt` is a string, a list of token ids, or a
    list of either (a batch: one choice per prompt). `logprobs` (0-20) asks for the sampled token's
    and that many top tokens' log-probabilities."""

    prompt: Any  # str | list[int] | list[str] | list[list[int]] (checked in `completion_requests`)
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: int | None = None
    # not implemented (refused unless they ask for nothing)
    suffix: str | None = None
    prompt_embeds: Any = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # OpenAI's ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"


class SpeechRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/audio/speech``: text to audio; `stream_format` ``sse`` streams base64 chunks."""

    model: str | None = None  # unset: the served model (as vLLM takes it)
    input: str
    voice: str | None = None
    response_format: Literal["wav", "pcm", "flac", "mp3", "opus", "aac"] = "wav"
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    speed: float | None = None  # OpenAI's; only 1.0 (the model's own pace): another is a 400
    stage_params: dict[str, dict[str, Any]] | None = None


class ImageGenerationRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/images/generations``.

    OpenAI's fields: `size` ``"WIDTHxHEIGHT"`` or ``"auto"`` (the model's choice, as no size);
    `output_format` and `output_compression` (0-100, JPEG and WebP) as gpt-image-1's; `background`
    ``"transparent"`` is refused (the images have no alpha); `quality`, `style`, `moderation` and
    `user` are accepted and change nothing. vLLM-Omni's: `seed`, and `num_inference_steps`,
    `guidance_scale`, `negative_prompt`, which go to the stage that draws (`stage_params` wins per
    key; a parameter that stage does not take is a 400 naming it). `task` (extension), as a chat
    completion's: the pipeline task of a family that declares tasks (one that does not produce
    images, or that the family lacks, is a 400).
    """

    model: str | None = None  # unset: the served model (as vLLM takes it)
    prompt: str
    n: int = 1
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"  # (``url``: a 400, the server keeps no files)
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = None
    background: Literal["auto", "opaque", "transparent"] | None = None
    quality: str | None = None
    style: str | None = None
    moderation: str | None = None
    user: str | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    stage_params: dict[str, dict[str, Any]] | None = None
    task: str | None = None


class ImageEditRequest(ImageGenerationRequest, kw_only=True):
    """``POST /v1/images/edits``: `ImageGenerationRequest`'s fields plus the images to edit.

    `image`: one image or a list, each a URL (a base64 ``data:`` URL, or a URL the operator allowed)
    or OpenAI's ``{"image_url": URL}``; in a ``multipart/form-data`` body, as OpenAI's client sends
    it, file uploads (``image``, or ``image[]`` for several). `images`: OpenAI's JSON field, a list of
    the same. The images go before the prompt in one user message, as a chat request's ``image_url``
    parts: the model family reads them (HunyuanImage-3.0 Instruct: ``it2i``) or refuses them with a
    400. `mask` (inpainting) and ``file_id`` references are refused; `input_fidelity` changes nothing.
    """

    image: str | dict[str, Any] | list[str | dict[str, Any]] | None = None
    images: list[str | dict[str, Any]] | None = None
    mask: str | dict[str, Any] | None = None
    input_fidelity: str | None = None


class VideoRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/videos``.

    `input_reference` is OpenAI's field for the first frame (a URL, or OpenAI's ``{"image_url": URL}``;
    in a ``multipart/form-data`` body, as OpenAI's client sends it, also a file upload:
    `omni_core.server.forms`); `last_frame` and `references` are Omni's extensions: the last frame,
    and reference media in the order the model reads them (``{"type": "image", "image": URL}``,
    ``{"type": "audio", "audio": URL}``). vLLM-Omni's `num_frames`, `fps`, `num_inference_steps`,
    `guidance_scale` and `negative_prompt` go to the stage that draws, as on the images route.
    Every medium is a base64 ``data:``
    URL, or a ``file://`` / ``http(s)://`` URL the operator allowed (`omni_core.media_access`), which
    the server reads into one; it reads no other path and fetches no other URL for a client. A family
    that cannot take one answers 400.
    """

    model: str | None = None  # unset: the served model (as vLLM takes it)
    prompt: str
    seconds: str | None = None
    size: str | None = None
    seed: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    input_reference: str | dict[str, Any] | None = None
    last_frame: str | dict[str, Any] | None = None
    references: list[dict[str, Any]] | None = None
    stage_params: dict[str, dict[str, Any]] | None = None


# -- responses --------------------------------------------------------------------------------------


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AudioOutput(msgspec.Struct):
    id: str
    data: str
    expires_at: int
    transcript: str


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    """A chat completion's message. `role` and `content` are always in the body (``content`` null
    when there is no text), as OpenAI sends them; `audio` only when audio was produced. When the
    request asked for images (``"modalities": ["text", "image"]``, e.g. HunyuanImage-3.0's
    think-then-draw), `content` is a list of parts, as a user message's: a ``text`` part, then one
    ``image_url`` part per image with a base64 PNG ``data:`` URL."""

    role: Literal["assistant"]
    content: Union[str, list[dict[str, Any]], None]
    audio: AudioOutput | None = None


class Choice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # OpenAI's ``{"content": [...]}`` when asked for


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"


class ModelCard(msgspec.Struct):
    """OpenAI's model object, with vLLM's `root` (the checkpoint it was loaded from) and
    `max_model_len` (the first AR stage's context; null for a pipeline without one)."""

    id: str
    created: int
    owned_by: str = "omni"
    object: str = "model"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ImageData(msgspec.Struct):
    b64_json: str


class ImagesResponse(msgspec.Struct):
    created: int
    data: list[ImageData]
    output_format: str = "png"
    size: str | None = None  # "WIDTHxHEIGHT" of the images (of the first, were they to differ)


class VideoJob(msgspec.Struct):
    """OpenAI's video object. `progress` (0-100) follows the denoising steps; `seconds` and `size` are
    what the request asked until the job completes, then what was produced (frame counts snap to
    what the model generates)."""

    id: str
    created_at: int
    status: Literal["queued", "in_progress", "completed", "failed"]
    model: str
    prompt: str
    progress: int = 0
    seconds: str | None = None
    size: str | None = None
    completed_at: int | None = None
    error: ErrorDetail | None = None
    object: str = "video"


class VideoList(msgspec.Struct):
    """``GET /v1/videos``: the server's jobs, a page at a time (OpenAI's cursor list)."""

    data: list[VideoJob]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


class VideoDeleted(msgspec.Struct):
    id: str
    deleted: bool = True
    object: str = "video.deleted"


class SSEEvent(msgspec.Struct):
    """Documents an SSE stream in the OpenAPI schema (each event's `data` is a JSON string)."""

    data: str
    event: str | None = None
    id: str | None = None
