"""The Qwen3-Omni input processor: an `OmniRequest` -> the thinker's prompt and the talker's voice.

Messages come in OpenAI chat format (``content`` a string or parts ``text``, ``image_url`` with a
``data:`` URL, ``input_audio`` with base64 wav/mp3/flac, ``video_url`` with a ``data:`` URL of a video file),
or with the Qwen-Omni parts the offline API may pass directly (``{"type": "audio", "audio": <16 kHz
float array>}``, ``{"type": "image", "image": <PIL image>}``, ``{"type": "video", "video": <uint8
[T, H, W, 3] frames>, "fps": <optional>}``). The checkpoint's chat template turns them into the
prompt; the thinker stage gets its token ids (one placeholder per image/audio/video, which vLLM's
processor expands) and the decoded media as vLLM ``multi_modal_data`` (videos as their sampled
frames: `omni_qwen3.video`, no torchvision needed). The prompt's expanded length is worked out
here so that an over-long prompt fails before anything runs. Input that cannot be decoded is an
`InvalidRequestError`.

``mm_processor_kwargs`` (the request field vLLM has for this) may set ``use_audio_in_video``: each
video file's sound track is then an audio input too, and vLLM's processor interleaves it with the
video's frames by time (as transformers' processor and ``generate(use_audio_in_video=True)`` do);
the thinker's first chunk passes the flag on for the talker's positions.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
from typing import TYPE_CHECKING, Any

from omni_core.config.modelref import read_hf_config
from omni_core.engine.vllm_inputs import VLLM_PROMPT, mm_processor_flags
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.parts import InputProcessor, PartContext

if TYPE_CHECKING:
    import numpy as np

    from omni_core.engine.request import OmniRequest
    from omni_qwen3.video import DecodedVideo, QwenVideoProcessor


# Largest image accepted (pixels): far above what the processor keeps, far below a decompression bomb.
MAX_IMAGE_PIXELS = 4096 * 4096
AUDIO_SAMPLE_RATE = 16000
DEFAULT_SPEAKER = "Ethan"
SPEECH_SYSTEM_PROMPT = (
    "You are a text-to-speech voice. Repeat the user's text exactly, word for word, and say nothing else."
)
THINKER = "thinker"
TALKER = "talker"


class Qwen3OmniInputProcessor(InputProcessor):
    """Turns requests into stage inputs for the ``thinker`` (and the voice for the ``talker``).

    Built once per engine from the resolved pipeline (the tokenizer loads with the engine, `load`;
    media processor settings on first use); called in a worker thread per request.
    """

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        pipeline = context.pipeline
        self.pipeline = pipeline
        self.model_path = pipeline.model_path
        self.config = read_hf_config(pipeline.model_path)
        thinker = self.config.get("thinker_config", self.config)
        self.thinker_config: dict[str, Any] = thinker
        self.text_config: dict[str, Any] = thinker.get("text_config", {})
        talker = self.config.get("talker_config") or {}
        self.speakers: dict[str, int] = dict(talker.get("speaker_id") or {})
        self.stage_names = {stage.name for stage in pipeline.stages}
        options = pipeline.stage(THINKER).options if THINKER in self.stage_names else {}
        self.max_model_len = int(options.get("max_model_len") or self.text_config.get("max_position_embeddings") or 32768)

    # -- the request -----------------------------------------------------------------------------

    def process(self, request: OmniRequest) -> dict[str, StageInput]:
        modalities = tuple(request.modalities or self.pipeline.default_modalities)
        audio_in_video = _use_audio_in_video(request)
        vllm_prompt = request.extra.get(VLLM_PROMPT)
        if vllm_prompt is not None:
            if audio_in_video:
                raise InvalidRequestError(
                    "use_audio_in_video with a vLLM prompt dict is not supported: send chat messages with a video_url part",
                    param="mm_processor_kwargs",
                )
            token_ids, audios, images, videos = self._vllm_prompt(vllm_prompt)
        else:
            token_ids, audios, images, videos, audio_in_video = self._chat_prompt(request, audio_in_video)
        frames = [self.video_processor.sample(video) for video in videos]
        self._check_length(token_ids, audios, images, frames, audio_in_video)
        data: dict[str, Any] = {"prompt_token_ids": token_ids, "capture_hidden": "audio" in modalities}
        if audio_in_video:
            data["mm_processor_kwargs"] = {"use_audio_in_video": True}
        media: dict[str, Any] = {}
        if audios:
            media["audio"] = [(audio, AUDIO_SAMPLE_RATE) for audio in audios]
        if images:
            media["image"] = images
        if frames:
            media["video"] = frames
        if media:
            data["multi_modal_data"] = media
        inputs = {THINKER: StageInput(data=data)}
        # The voice (``voice``, else the default) sets the talker's speaker, unless the request
        # chose a speaker in the talker's own parameters and no voice.
        chosen = (request.params or {}).get(TALKER) or {}
        if TALKER in self.stage_names and (request.extra.get("voice") is not None or chosen.get("speaker") is None):
            inputs[TALKER] = StageInput(params={"speaker": self._speaker(request)})
        return inputs

    def _chat_prompt(self, request: OmniRequest, audio_in_video: bool) -> tuple[list[int], list[Any], list[Any], list[DecodedVideo], bool]:
        """The prompt's token ids (through the chat template) and media, from a prompt or messages."""
        template_messages, audios, images, videos = self._parse(self._messages(request), audio_in_video)
        audio_in_video = audio_in_video and bool(videos)
        if audio_in_video and "audio_end_token_id" not in self.thinker_config:
            raise InvalidRequestError(
                "use_audio_in_video needs thinker_config.audio_end_token_id, which this checkpoint's "
                "config.json lacks (a tiny checkpoint written by an omni-qwen3 older than tiny format 2?)",
                param="mm_processor_kwargs",
            )
        if audio_in_video and len(audios) != len(videos):
            raise InvalidRequestError(
                "with use_audio_in_video every audio input is a video's sound track: send audio parts "
                "in a request without it (vLLM pairs each audio with one video)",
                param="mm_processor_kwargs",
            )
        tokenizer = self.tokenizer
        text = tokenizer.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"], audios, images, videos, audio_in_video

    def _vllm_prompt(self, prompt: dict[str, Any]) -> tuple[list[int], list[Any], list[Any], list[DecodedVideo]]:
        """A vLLM prompt dict (`omni_core.engine.vllm_inputs`): its text is the model's final text
        (tokenized as it is, as vLLM does), with one placeholder per item of ``multi_modal_data``
        (``audio``: ``(samples, rate)``; ``image``: a PIL image; ``video``: ``[T, H, W, 3]`` frames;
        or lists of them)."""
        token_ids = prompt["prompt_token_ids"]
        if token_ids is None:
            token_ids = self.tokenizer(prompt["prompt"], add_special_tokens=False)["input_ids"]
        media = prompt["multi_modal_data"]
        unknown = sorted(set(media) - {"audio", "image", "video"})
        if unknown:
            raise InvalidRequestError(f"multi_modal_data: Qwen3-Omni takes audio, image and video, not {unknown}", param="multi_modal_data")
        try:
            audios = [_as_mono_16k(*_audio_item(item, f"multi_modal_data.audio[{i}]"), f"multi_modal_data.audio[{i}]") for i, item in enumerate(_items(media.get("audio"), tuple))]
            images = [_as_image(item, f"multi_modal_data.image[{i}]") for i, item in enumerate(_items(media.get("image"), None))]
            videos = [_as_video({"video": item}, f"multi_modal_data.video[{i}]") for i, item in enumerate(_items(media.get("video"), None, frames=True))]
        except InvalidRequestError as exc:  # the checks shared with chat parts name `messages`
            raise InvalidRequestError(str(exc), param="multi_modal_data") from None
        for kind, items in (("audio", audios), ("image", images), ("video", videos)):
            placeholder = self.thinker_config.get(f"{kind}_token_id")
            count = sum(1 for t in token_ids if t == placeholder)
            if count != len(items):
                raise InvalidRequestError(
                    f"the prompt has {count} {kind} placeholder(s) but multi_modal_data has {len(items)} {kind} item(s): "
                    "one placeholder per item (e.g. <|audio_start|><|audio_pad|><|audio_end|> for an audio)",
                    param="multi_modal_data",
                )
        return list(token_ids), audios, images, videos

    def _messages(self, request: OmniRequest) -> list[dict[str, Any]]:
        if request.extra.get("task") == "speech":
            text = request.prompt if request.prompt is not None else _plain_text(request.messages or [])
            if not isinstance(text, str) or not text.strip():
                raise InvalidRequestError("text to speech needs non-empty input text", param="input")
            return [{"role": "system", "content": SPEECH_SYSTEM_PROMPT}, {"role": "user", "content": text}]
        if request.messages is not None:
            if not isinstance(request.messages, list) or not request.messages:
                raise InvalidRequestError("messages must be a non-empty list", param="messages")
            return request.messages
        if isinstance(request.prompt, str):
            return [{"role": "user", "content": request.prompt}]
        raise InvalidRequestError("a request needs a prompt (string) or messages", param="prompt")

    def _speaker(self, request: OmniRequest) -> str:
        voice = request.extra.get("voice")
        if voice is None:
            default = DEFAULT_SPEAKER if DEFAULT_SPEAKER.lower() in self.speakers else None
            return default or (sorted(self.speakers)[0] if self.speakers else DEFAULT_SPEAKER)
        if not isinstance(voice, str) or (self.speakers and voice.lower() not in self.speakers):
            raise InvalidRequestError(
                f"unknown voice {voice!r}; this model's voices are {sorted(self.speakers)}", param="voice"
            )
        return voice

    # -- messages --------------------------------------------------------------------------------

    def _parse(
        self, messages: list[dict[str, Any]], audio_in_video: bool = False
    ) -> tuple[list[dict[str, Any]], list[Any], list[Any], list[DecodedVideo]]:
        """Messages -> chat-template messages (Qwen parts), audio arrays, images and videos, in order.

        `audio_in_video`: each video's sound track is an audio input too, in the video's place.
        """
        out: list[dict[str, Any]] = []
        audios: list[Any] = []
        images: list[Any] = []
        videos: list[DecodedVideo] = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequestError(f"messages[{i}] must be an object with a 'role'", param="messages")
            content = message.get("content")
            if content is None or isinstance(content, str):
                out.append({"role": message["role"], "content": content or ""})
                continue
            if not isinstance(content, list):
                raise InvalidRequestError(f"messages[{i}].content must be a string or a list of parts", param="messages")
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image_url":
                    images.append(_decode_image_url(part.get("image_url"), where))
                    parts.append({"type": "image"})
                elif kind == "image" and part.get("image") is not None:
                    images.append(_as_image(part["image"], where))
                    parts.append({"type": "image"})
                elif kind == "input_audio":
                    audios.append(_decode_input_audio(part.get("input_audio"), where))
                    parts.append({"type": "audio"})
                elif kind == "audio" and part.get("audio") is not None:
                    audios.append(_as_mono_16k(part["audio"], AUDIO_SAMPLE_RATE, where))
                    parts.append({"type": "audio"})
                elif kind == "video_url":
                    video = _decode_video_url(part.get("video_url"), where, audio_in_video)
                    videos.append(video)
                    if video.audio is not None:
                        audios.append(video.audio)
                    parts.append({"type": "video"})
                elif kind == "video" and part.get("video") is not None:
                    if audio_in_video:
                        raise InvalidRequestError(
                            f"{where}: use_audio_in_video reads the sound track of a video file: send the "
                            "video as a video_url (data: URL) rather than frames",
                            param="messages",
                        )
                    videos.append(_as_video(part, where))
                    parts.append({"type": "video"})
                else:
                    raise InvalidRequestError(
                        f"{where}: unsupported content part {kind!r}; use text, image_url (data: URL), "
                        "input_audio (base64 wav/mp3/flac) or video_url (data: URL of an MP4/WebM/...)",
                        param="messages",
                    )
            out.append({"role": message["role"], "content": parts})
        return out, audios, images, videos

    # -- lengths ---------------------------------------------------------------------------------

    def _check_length(
        self, token_ids: list[int], audios: list[Any], images: list[Any], videos: list[Any], audio_in_video: bool = False
    ) -> None:
        """Reject a prompt whose expanded length (`expanded_length`) leaves no room."""
        length = self.expanded_length(token_ids, audios, images, videos, audio_in_video)
        if length >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt is {length} tokens (with its audio, images and videos) but the thinker's context is "
                f"{self.max_model_len}: shorten the input or raise the thinker's max_model_len",
                param="messages",
            )

    def expanded_length(
        self, token_ids: list[int], audios: list[Any], images: list[Any], videos: list[Any], audio_in_video: bool = False
    ) -> int:
        """The prompt's length once vLLM's processor replaced each placeholder by one token per
        encoder output. With `audio_in_video` a video's one placeholder becomes its frames' and its
        sound track's tokens between an audio start and an audio end token."""
        length = len(token_ids) + sum(self._audio_tokens(a) - 1 for a in audios)
        length += sum(self._image_tokens(im) - 1 for im in images)
        length += sum(self._video_tokens(frames) - 1 for frames in videos)
        if audio_in_video:  # each sound track's placeholder is its video's: + audio start and end
            length += 3 * len(videos)
        return length

    def _audio_tokens(self, audio: np.ndarray) -> int:
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

        frames = len(audio) // self.hop_length  # the Whisper extractor drops the last STFT frame
        return int(_get_feat_extract_output_lengths(_np().asarray(frames)))

    def _image_tokens(self, image: Any) -> int:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        processor = self.image_processor
        patch, merge = processor.patch_size, processor.merge_size
        height, width = smart_resize(
            image.height, image.width, factor=patch * merge,
            min_pixels=processor.size["shortest_edge"], max_pixels=processor.size["longest_edge"],
        )
        return (height // patch) * (width // patch) // (merge * merge)

    def _video_tokens(self, frames: np.ndarray) -> int:
        from omni_qwen3.video import processor_video_kwargs

        count, height, width = frames.shape[:3]
        return self.video_processor.num_tokens(count, height, width, **processor_video_kwargs())

    # -- lazily loaded parts ---------------------------------------------------------------------

    def load(self) -> None:
        """Load the tokenizer now (seconds: transformers' tokenization stack), which every request
        needs; the engine calls this while its stages start. The media processors stay lazy."""
        self.tokenizer  # noqa: B018 - a cached property: reading it loads it

    @functools.cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    @functools.cached_property
    def image_processor(self) -> Any:
        from transformers import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(self.model_path)

    @functools.cached_property
    def video_processor(self) -> QwenVideoProcessor:
        from omni_qwen3.video import QwenVideoProcessor

        return QwenVideoProcessor.from_pretrained(self.model_path)

    @functools.cached_property
    def hop_length(self) -> int:
        from transformers import WhisperFeatureExtractor

        return int(WhisperFeatureExtractor.from_pretrained(self.model_path).hop_length)


# -- decoding -------------------------------------------------------------------------------------


def _np() -> Any:
    import numpy

    return numpy


def _plain_text(messages: list[dict[str, Any]]) -> str:
    texts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(texts)


def undecodable(where: str, what: str, exc: BaseException) -> InvalidRequestError:
    """The error for a part the decoder refused, with the decoder's reason minus the Python object
    reprs some decoders put in it (``<_io.BytesIO object at 0x...>``)."""
    import re

    reason = re.sub(r"\s*<[^<>]* object at 0x[0-9a-f]+>", "", str(exc)).strip() or type(exc).__name__
    return InvalidRequestError(f"{where}: cannot decode {what} ({reason})", param="messages")


def _b64decode(data: Any, where: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise InvalidRequestError(f"{where}: expected base64 data", param="messages")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"{where}: invalid base64 data ({exc})", param="messages") from None


def _decode_image_url(value: Any, where: str) -> Any:
    from omni_core.media_decode import open_image

    raw = _data_url_bytes(value, where, "image", "data:image/png;base64,...")
    # The header gives the size: huge images are refused before decoding (the processor resizes
    # them to at most ~0.8 megapixels anyway).
    return open_image(raw, where, "messages", MAX_IMAGE_PIXELS)


def _as_image(image: Any, where: str) -> Any:
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise InvalidRequestError(f"{where}: 'image' must be a PIL image", param="messages")
    return image.convert("RGB")


def _decode_video_url(value: Any, where: str, with_audio: bool = False) -> DecodedVideo:
    from omni_qwen3.video import decode_video

    return decode_video(_data_url_bytes(value, where, "video", "data:video/mp4;base64,..."), where, with_audio)


def _items(value: Any, single: type | None, frames: bool = False) -> list[Any]:
    """`multi_modal_data`'s value for one modality as a list of items: vLLM takes one item or a list."""
    if value is None:
        return []
    if isinstance(value, list):
        return value
    if single is not None and isinstance(value, single):
        return [value]
    if frames and getattr(value, "ndim", 0) == 5:  # a batch of videos [N, T, H, W, 3]
        return list(value)
    return [value]


def _audio_item(item: Any, where: str) -> tuple[Any, int]:
    """vLLM's audio item: ``(samples, sample rate)``."""
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], (int, float)) and item[1] > 0):
        raise InvalidRequestError(f"{where}: an audio is a (samples, sample rate) tuple, as vLLM takes it", param="multi_modal_data")
    return item[0], int(item[1])


def _use_audio_in_video(request: OmniRequest) -> bool:
    """The request's ``mm_processor_kwargs`` (vLLM's request field): only ``use_audio_in_video``
    (a video's sound track as audio input, interleaved with its frames by time) is understood."""
    return mm_processor_flags(request, ("use_audio_in_video",), "Qwen3-Omni").get("use_audio_in_video", False)


def _data_url_bytes(value: Any, where: str, kind: str, example: str) -> bytes:
    """The bytes of an ``{kind}_url`` part: a base64 ``data:`` URL (remote URLs are not fetched)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url.startswith("data:"):
        raise InvalidRequestError(
            f"{where}: {kind}_url must be a data: URL ({example}); remote URLs are not fetched", param="messages"
        )
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise InvalidRequestError(f"{where}: {kind} data URLs must be base64 encoded", param="messages")
    return _b64decode(payload, where)


def _as_video(part: dict[str, Any], where: str) -> DecodedVideo:
    from omni_qwen3.video import DecodedVideo, as_frames

    fps = part.get("fps")
    if fps is not None and (not isinstance(fps, (int, float)) or not fps > 0):
        raise InvalidRequestError(f"{where}: 'fps' must be a positive number", param="messages")
    return DecodedVideo(frames=as_frames(part["video"], where), fps=None if fps is None else float(fps))


def _decode_input_audio(value: Any, where: str) -> np.ndarray:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where}: input_audio must be an object with 'data' and 'format'", param="messages")
    raw = _b64decode(value.get("data"), where)
    from omni_core.media_decode import read_audio

    samples, rate = read_audio(raw, where, "messages")  # its length checked from the header first
    if samples.shape[0] == 0:
        raise InvalidRequestError(f"{where}: the audio is empty", param="messages")
    return _as_mono_16k(samples.mean(axis=1), int(rate), where)


def _as_mono_16k(audio: Any, rate: int, where: str) -> np.ndarray:
    np = _np()
    array = np.asarray(audio, dtype=np.float32)
    if array.ndim != 1 or array.size == 0 or not np.isfinite(array).all():
        raise InvalidRequestError(f"{where}: audio must be a non-empty 1-D array of finite samples", param="messages")
    if rate == AUDIO_SAMPLE_RATE:
        return array
    return resample(array, rate, AUDIO_SAMPLE_RATE)


def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited (FFT) resampling of a 1-D signal from `rate` to `target` Hz (no scipy needed)."""
    np = _np()
    n_out = max(1, int(math.ceil(len(audio) * target / rate)))
    spectrum = np.fft.rfft(audio.astype(np.float64))
    bins = n_out // 2 + 1
    if bins <= spectrum.shape[0]:
        spectrum = spectrum[:bins]
    else:
        spectrum = np.concatenate([spectrum, np.zeros(bins - spectrum.shape[0], dtype=spectrum.dtype)])
    return (np.fft.irfft(spectrum, n=n_out) * (n_out / len(audio))).astype(np.float32)
