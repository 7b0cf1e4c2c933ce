"""Reference outputs of Qwen3-Omni from transformers, to check Omni's stages against.

`reference_generate` runs ``Qwen3OmniMoeForConditionalGeneration.generate`` greedily (thinker and
talker) and returns the prompt ids, the thinker's new ids, the talker's codec codes and the waveform.
``generate`` itself returns only the thinker sequences and the waveform; the codes are read from the
talker's own outputs with a forward hook (a public torch API), exactly as ``generate`` collects them,
and `decode_codes` turns them back into the waveform the same way ``generate`` does.

Inputs are chat messages in the Qwen-Omni style: ``content`` is a string or a list of parts
``{"type": "text", "text": ...}``, ``{"type": "audio", "audio": <1-D float array at 16 kHz>}``,
``{"type": "image", "image": <PIL image>}``, ``{"type": "video", "video": <uint8 [T, H, W, 3] frames>}``
(optionally with ``"fps"``: the frame rate, used only where the video processor samples by fps, and
``"audio"``: its sound track at 16 kHz, the video's audio input with ``use_audio_in_video``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from omni_core.errors import InvalidRequestError

if TYPE_CHECKING:
    import numpy as np
    import torch

AUDIO_SAMPLING_RATE = 16000
# chunked_decode arguments generate() uses for code2wav.
CODE2WAV_CHUNK_SIZE = 300
CODE2WAV_LEFT_CONTEXT = 25

Messages = list[dict[str, Any]]


@attrs.frozen
class ReferenceOutput:
    """What one greedy transformers generation produced for one request.

    - `prompt_ids`: the processed prompt (multimodal placeholders expanded).
    - `thinker_ids`: the thinker's new tokens (ends with ``<|im_end|>`` unless cut by max tokens).
    - `codes`: talker codec codes, ``[num_code_groups, num_frames]`` (None without audio).
    - `waveform`: float32 samples at 24 kHz (None without audio).
    """

    prompt_ids: list[int]
    thinker_ids: list[int]
    codes: np.ndarray | None = None
    waveform: np.ndarray | None = None
    sample_rate: int = 24000


def load_model(model_dir: str | Path) -> Any:
    """Load the full model (thinker, talker, code2wav) in float32, eval mode, on CPU."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def prepare_inputs(model_dir: str | Path, messages: Messages | str, use_audio_in_video: bool = False) -> dict[str, Any]:
    """Turn messages (or a ready prompt string) into the model's keyword inputs.

    Does what ``Qwen3OmniMoeProcessor.__call__`` does for text, audio and images: chat template,
    Whisper features (renamed ``feature_attention_mask``), image patches, and expansion of each
    ``<|audio_pad|>``/``<|image_pad|>``/``<|video_pad|>`` to one token per encoder output. The
    processor class itself cannot be built where torchvision is missing (its video processor needs
    it), so its parts are loaded one by one, and videos go through `omni_qwen3.video`'s
    torchvision-free video processor (with the size bounds and ``video_second_per_grid`` the
    processor passes). `use_audio_in_video`: each video's ``audio`` is an audio input in the
    video's place, and the video's placeholder becomes its frames and audio interleaved by time
    (the processor's own ``replace_multimodal_special_tokens`` does that expansion).
    """
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if isinstance(messages, str):
        text, audios, images, videos = messages, [], [], []
    else:
        # A video's sound track is not a part of its own: the chat template would take a part with
        # an ``audio`` key for an audio part.
        template = [
            {**m, "content": [_without_sound_track(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages
        ]
        text = tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
        audios, images, videos = _collect_media(messages, use_audio_in_video)

    features: dict[str, Any] = {}
    audio_lengths: list[int] = []
    if audios:
        extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        audio_inputs = extractor(
            audios,
            sampling_rate=AUDIO_SAMPLING_RATE,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        features["input_features"] = audio_inputs["input_features"]
        features["feature_attention_mask"] = audio_inputs["attention_mask"]
        audio_lengths = _get_feat_extract_output_lengths(audio_inputs["attention_mask"].sum(-1)).tolist()
    image_lengths: list[int] = []
    if images:
        image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
        image_inputs = image_processor(images=images, return_tensors="pt")
        features["pixel_values"] = image_inputs["pixel_values"]
        features["image_grid_thw"] = image_inputs["image_grid_thw"]
        merge = image_processor.merge_size**2
        image_lengths = [int(grid.prod()) // merge for grid in image_inputs["image_grid_thw"]]

    video_lengths: list[int] = []
    if videos:
        from omni_qwen3.video import PROCESSOR_FPS, QwenVideoProcessor, processor_video_kwargs

        video_processor = QwenVideoProcessor.from_pretrained(model_dir)
        video_inputs = video_processor(videos=[video_processor.sample(v) for v in videos], **processor_video_kwargs())
        features["pixel_values_videos"] = video_inputs["pixel_values_videos"]
        features["video_grid_thw"] = video_inputs["video_grid_thw"]
        features["video_second_per_grid"] = torch.tensor(
            [video_processor.temporal_patch_size / PROCESSOR_FPS] * len(videos), dtype=torch.float32
        )
        merge = video_processor.merge_size**2
        video_lengths = [int(grid.prod()) // merge for grid in video_inputs["video_grid_thw"]]

    if use_audio_in_video and videos:
        text = _interleave_audio_in_video(tokenizer, text, audio_lengths, features, video_processor.merge_size)
    else:
        text = _expand_placeholders(
            text,
            {tokenizer.audio_token: audio_lengths, tokenizer.image_token: image_lengths, tokenizer.video_token: video_lengths},
        )
    encoded = tokenizer(text, return_tensors="pt", padding=False)
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], **features}


def _is_video(part: dict[str, Any]) -> bool:
    """A video part (``type`` video, or untyped with a ``video``): it may carry an ``audio`` too."""
    return part.get("type") == "video" or (part.get("type") is None and "video" in part)


def _without_sound_track(part: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in part.items() if k != "audio"} if _is_video(part) else part


def _interleave_audio_in_video(
    tokenizer: Any, text: str, audio_lengths: list[int], features: dict[str, Any], merge_size: int
) -> str:
    """``Qwen3OmniMoeProcessor.replace_multimodal_special_tokens`` with ``use_audio_in_video``,
    called on the parts it reads (the processor itself cannot be built without torchvision).
    `merge_size`: the vision processors' (image and video share the vision encoder's)."""
    import types

    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        Qwen3OmniMoeProcessor,
        Qwen3OmniMoeProcessorKwargs,
    )

    defaults = Qwen3OmniMoeProcessorKwargs._defaults["videos_kwargs"]
    holder = types.SimpleNamespace(
        **{name: getattr(tokenizer, name) for name in (
            "audio_token", "image_token", "video_token", "vision_bos_token", "vision_eos_token", "audio_bos_token", "audio_eos_token",
        )},
        image_processor=types.SimpleNamespace(merge_size=merge_size),
        video_processor=types.SimpleNamespace(merge_size=merge_size),
    )
    (expanded,) = Qwen3OmniMoeProcessor.replace_multimodal_special_tokens(
        holder,
        [text],
        iter(audio_lengths),
        iter(features.get("image_grid_thw", [])),
        iter(features["video_grid_thw"]),
        video_second_per_grid=iter(features["video_second_per_grid"].tolist()),
        use_audio_in_video=True,
        position_id_per_seconds=defaults["position_id_per_seconds"],
        seconds_per_chunk=defaults["seconds_per_chunk"],
    )
    return expanded


def reference_generate(
    model_dir: str | Path,
    messages: Messages | str,
    *,
    return_audio: bool = True,
    speaker: str = "Ethan",
    max_new_tokens: int = 16,
    talker_max_new_tokens: int = 64,
    model: Any = None,
    use_audio_in_video: bool = False,
) -> ReferenceOutput:
    """Run transformers' ``generate`` greedily and return ids, codec codes and waveform.

    Greedy everywhere: thinker and talker ``do_sample=False``, repetition penalties 1.0 (the
    talker's default is 1.05). `model` reuses an already loaded `load_model` result.
    """
    import torch

    if model is None:
        model = load_model(model_dir)
    inputs = prepare_inputs(model_dir, messages, use_audio_in_video)
    config = model.config
    kwargs: dict[str, Any] = {
        "use_audio_in_video": use_audio_in_video,
        "return_audio": return_audio,
        "thinker_max_new_tokens": max_new_tokens,
        "thinker_do_sample": False,
        "thinker_repetition_penalty": 1.0,
        # generate()'s default is the real vocabulary's <|im_end|> id (151645).
        "thinker_eos_token_id": config.im_end_token_id,
    }
    if return_audio and inputs.get("feature_attention_mask") is not None and getattr(model.talker.config, "audio_config", None) is None:
        # Audio beside an image or video: the talker's get_rope_index reads the audio encoder's
        # n_window from config.audio_config, which only the thinker's config has (without it
        # transformers raises AttributeError); the talker's config gets the thinker's.
        model.talker.config.audio_config = config.thinker_config.audio_config
    if return_audio and use_audio_in_video:
        # generate() hands the talker the image/video grids but not this flag, so its positions
        # would take the interleaved video for plain audio; the talker_ prefix passes it on.
        kwargs["talker_use_audio_in_video"] = True
    if return_audio:
        if speaker.lower() not in (config.talker_config.speaker_id or {}):
            raise InvalidRequestError(
                f"unknown speaker {speaker!r}; this checkpoint has {sorted(config.talker_config.speaker_id)}",
                param="speaker",
            )
        kwargs.update(
            speaker=speaker,
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
            talker_max_new_tokens=talker_max_new_tokens,
        )

    captured: list[torch.Tensor] = []

    def capture_codes(_module: Any, _args: Any, output: Any) -> None:
        # The talker returns (hidden_states, residual_codes) in `hidden_states`; residual_codes
        # are the previous step's frame (codebook 0 + predicted residuals), None at prefill.
        codes = output.hidden_states[-1]
        if codes is not None:
            captured.append(codes.detach().clone())

    handle = model.talker.register_forward_hook(capture_codes) if return_audio else None
    try:
        with torch.inference_mode():
            result = model.generate(**inputs, **kwargs)
    finally:
        if handle is not None:
            handle.remove()

    prompt_len = inputs["input_ids"].shape[1]
    if return_audio:
        sequences, waveform = result
    else:
        sequences, waveform = result, None
    prompt_ids = inputs["input_ids"][0].tolist()
    thinker_ids = sequences[0, prompt_len:].tolist()
    if waveform is None:
        return ReferenceOutput(prompt_ids=prompt_ids, thinker_ids=thinker_ids)
    # Same stacking as generate(): [batch, frames, groups] -> [batch, groups, frames].
    codes = torch.stack(captured, dim=1).transpose(1, 2)[0] if captured else None
    return ReferenceOutput(
        prompt_ids=prompt_ids,
        thinker_ids=thinker_ids,
        codes=None if codes is None else codes.cpu().numpy(),
        waveform=waveform.reshape(-1).float().cpu().numpy(),
    )


def decode_codes(model: Any, codes: np.ndarray) -> np.ndarray:
    """Decode ``[num_code_groups, num_frames]`` codes with code2wav the way ``generate`` does."""
    import torch

    tensor = torch.as_tensor(codes, dtype=torch.long).unsqueeze(0)
    with torch.inference_mode():
        wav = model.code2wav.chunked_decode(
            tensor, chunk_size=CODE2WAV_CHUNK_SIZE, left_context_size=CODE2WAV_LEFT_CONTEXT
        )
    return wav.reshape(-1).float().cpu().numpy()


def sine_wave(seconds: float = 1.0, frequency: float = 440.0) -> np.ndarray:
    """A synthetic 16 kHz mono test signal (float32)."""
    import numpy as np

    t = np.arange(int(seconds * AUDIO_SAMPLING_RATE), dtype=np.float32) / AUDIO_SAMPLING_RATE
    return (0.5 * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def synthetic_image(width: int = 64, height: int = 64) -> Any:
    """A synthetic RGB PIL image with structure (gradients), so patches differ."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), mode="RGB")


def moving_frames(count: int = 5, height: int = 48, width: int = 64) -> np.ndarray:
    """Synthetic RGB video frames whose content moves from frame to frame (uint8 [T, H, W, 3])."""
    import numpy as np

    t, y, x = np.mgrid[0:count, 0:height, 0:width]
    return np.stack([(x * 4 + t * 30) % 256, (y * 5 + t * 10) % 256, (x + y + t * 50) % 256], -1).astype(np.uint8)


def mp4_bytes(frames: np.ndarray, fps: int = 4, audio: np.ndarray | None = None) -> bytes:
    """An MP4 file of `frames` (lossless H.264) and, given `audio` (16 kHz mono), an AAC sound track."""
    import io

    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv444p"
        stream.options = {"qp": "0"}
        sound = None
        if audio is not None:
            sound = container.add_stream("aac", rate=AUDIO_SAMPLING_RATE)
            sound.layout = "mono"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None and audio is not None:
            samples = av.AudioFrame.from_ndarray(audio.astype("float32")[None, :], format="fltp", layout="mono")
            samples.sample_rate = AUDIO_SAMPLING_RATE
            for packet in [*sound.encode(samples), *sound.encode(None)]:
                container.mux(packet)
    return buffer.getvalue()


def wav_base64(audio: np.ndarray, rate: int = AUDIO_SAMPLING_RATE) -> str:
    """`audio` as a base64 float WAV, the OpenAI ``input_audio`` payload (exact round trip)."""
    import base64
    import io

    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, audio, rate, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()


def png_data_url(image: Any) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL, the OpenAI ``image_url`` payload."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def paired_requests(audio: np.ndarray, image: Any) -> tuple[dict[str, Messages], dict[str, Messages]]:
    """Text, audio-in and image-in requests, in OpenAI format (what Omni takes) and in the
    reference's format (what `reference_generate` takes), keyed ``text``, ``audio``, ``image``."""
    text: Messages = [{"role": "user", "content": "Hello world, what is this?"}]
    openai = {
        "text": text,
        "audio": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": wav_base64(audio), "format": "wav"}},
            {"type": "text", "text": "What is this sound?"},
        ]}],
        "image": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(image)}},
            {"type": "text", "text": "Describe it."},
        ]}],
    }
    reference = {
        "text": text,
        "audio": [{"role": "user", "content": [{"type": "audio", "audio": audio}, {"type": "text", "text": "What is this sound?"}]}],
        "image": [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}],
    }
    return openai, reference


def _collect_media(messages: Messages, use_audio_in_video: bool = False) -> tuple[list[Any], list[Any], list[Any]]:
    """Audio arrays, images and videos (`omni_qwen3.video.DecodedVideo`) in message order (the
    order of their placeholders); with `use_audio_in_video` a video's ``audio`` in its place."""
    from omni_qwen3.video import DecodedVideo, as_frames

    audios: list[Any] = []
    images: list[Any] = []
    videos: list[Any] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        for part in content:
            kind = part.get("type")
            if _is_video(part):
                fps = part.get("fps")
                videos.append(DecodedVideo(frames=as_frames(part["video"]), fps=None if fps is None else float(fps)))
                if use_audio_in_video:
                    audios.append(part["audio"])
            elif kind == "audio" or "audio" in part:
                audios.append(part["audio"])
            elif kind == "image" or "image" in part:
                images.append(part["image"])
    return audios, images, videos


def _expand_placeholders(text: str, lengths_by_token: dict[str, list[int]]) -> str:
    """Repeat each placeholder once per encoder output, in order of appearance."""
    iterators = {token: iter(lengths) for token, lengths in lengths_by_token.items()}

    def expand(match: re.Match[str]) -> str:
        lengths = iterators[match.group()]
        try:
            return match.group() * int(next(lengths))
        except StopIteration:
            raise InvalidRequestError(
                f"the prompt has more {match.group()} placeholders than inputs", param="messages"
            ) from None

    pattern = "|".join(re.escape(token) for token in lengths_by_token)
    return re.sub(pattern, expand, text)
