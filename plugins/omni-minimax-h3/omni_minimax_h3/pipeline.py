"""The MiniMax-H3 family's pipeline: ``encoder`` (generation) -> ``dit`` (diffusion), and its input processor.

- ``encoder`` (`omni_minimax_h3.encoder.MiniMaxH3Encoder`): the presentation's token ids ->
  ``prompt_embeds``, Qwen3-VL's state at the conditioning layer.
- ``dit`` (`omni_minimax_h3.dit.MiniMaxH3DiT`): the keyframe VAE encode, the denoising of video
  and audio together, both VAE decodes; emits ``video`` (24 fps), ``audio`` (stereo, [N, 2]) and
  ``sample_rate``. Its per-request parameters: ``seed``, ``size`` ([width, height]), ``num_frames``
  or ``seconds``, ``num_inference_steps`` and ``cache``.

Request fields (`OmniRequest.extra`): ``size``, ``seconds``, ``num_frames``, ``seed``, ``image``
(the first frame), ``last_image`` (the last frame): PIL images, HxWx3 uint8 arrays or base64
``data:`` URLs (never a path or a URL to fetch). Everything is validated here, before any model work.
"""

from __future__ import annotations

from typing import Any

from omni_core.config.pipeline import EdgeSpec, PipelineConfig, StageSpec
from omni_core.engine.inputs import last_user_text
from omni_core.errors import InvalidRequestError
from omni_core.outputs import StageInput
from omni_core.parts import InputProcessor, PartContext

ENCODER, DIT = "encoder", "dit"
DEFAULT_DEPLOY = "omni_minimax_h3:deploy/default.yaml"
REQUEST_FIELDS = ("size", "seconds", "num_frames", "seed")
MAX_IMAGE_PIXELS = 4096 * 4096
# Where an image sent in a chat message belongs (`last_user_text`'s refusal says it).
KEYFRAMES_HINT = (
    "; MiniMax-H3 takes its first and last frames as the request's image and last_image fields "
    "(/v1/videos: input_reference and last_frame; omni generate: --image, once or twice)"
)


def build_pipeline(model_path: str, hf_config: dict[str, Any]) -> PipelineConfig:
    """The pipeline of a diffusers ``MiniMaxH3ModularPipeline`` checkpoint."""
    return PipelineConfig(
        family="minimax-h3",
        stages=(
            StageSpec(name=ENCODER, kind="generation", model="omni_minimax_h3.encoder:MiniMaxH3Encoder"),
            StageSpec(
                name=DIT,
                kind="diffusion",
                model="omni_minimax_h3.dit:MiniMaxH3DiT",
                inputs=(EdgeSpec(ENCODER),),
                output="video",
                extra_outputs=("audio",),
                final=True,
            ),
        ),
        input_processor="omni_minimax_h3.pipeline:MiniMaxH3InputProcessor",
        default_deploy=DEFAULT_DEPLOY,
        default_modalities=("video", "audio"),
    )


class MiniMaxH3InputProcessor(InputProcessor):
    """Request -> the encoder's token ids and the dit's parameters, validated before any model work."""

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.presenter: Any = None
        self.geometry: Any = None

    def load(self) -> None:
        from omni_minimax_h3.loading import LOAD_LOCK
        from omni_minimax_h3.native import diffusers_layout
        from omni_minimax_h3.presentation import Presenter
        from omni_minimax_h3.requests import Geometry

        with LOAD_LOCK:  # diffusers' lazy imports are not thread-safe (`omni_minimax_h3.loading`)
            root = diffusers_layout(self.context.model_path)  # a native partition: its diffusers layout
            self.geometry = Geometry.from_checkpoint(root)
            self.presenter = Presenter(root)

    def process(self, request: Any) -> dict[str, StageInput]:
        from omni_minimax_h3.requests import parse_request

        if self.presenter is None:
            self.load()
        prompt = request.prompt
        if prompt is None and request.messages:
            prompt = last_user_text(request.messages, hint=KEYFRAMES_HINT)
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError("MiniMax-H3 needs a text prompt", param="prompt")
        unknown = sorted(set(request.extra) - {*REQUEST_FIELDS, "image", "last_image", "references"})
        if unknown:
            raise InvalidRequestError(f"unknown MiniMax-H3 request fields {unknown}", param=unknown[0])
        image = decode_image(request.extra.get("image"), "image")
        last_image = decode_image(request.extra.get("last_image"), "last_image")
        params = {**dict(request.params.get(DIT) or {}), **{k: request.extra[k] for k in REQUEST_FIELDS if request.extra.get(k) is not None}}
        _check_cache(params)
        if "size" in params:
            params["size"] = list(params["size"])
        references = self._references(request.extra.get("references"))
        if references and (image is not None or last_image is not None):
            raise InvalidRequestError("give keyframes (image, last_image) or references, not both", param="references")
        anchor = image if image is not None else last_image
        default_size = self.geometry.default_canvas(*anchor.size) if anchor is not None else None
        parsed = parse_request({k: v for k, v in params.items() if k != "cache"}, self.geometry, default_size=default_size)
        shown = self.presenter.present(
            prompt, (parsed.width, parsed.height), image=image, last_image=last_image, references=references, num_frames=parsed.num_frames
        )
        dit = {**{k: params[k] for k in REQUEST_FIELDS if k in params}, "size": [parsed.width, parsed.height], "token_tags": shown.token_tags}
        if references:
            dit.update(references=references, num_frames=parsed.num_frames)
            dit.pop("seconds", None)
        if shown.keyframes:
            dit.update(keyframes=shown.keyframes, keyframe_anchors=shown.keyframe_anchors)
        encoder_params = {"vision": shown.vision} if shown.vision else {}
        return {
            ENCODER: StageInput(data={"token_ids": shown.token_ids}, params=encoder_params),
            DIT: StageInput(params=dit),
        }

    def _references(self, value: Any) -> list[Any]:
        """ref2va references -> diffusers' reference objects, in order: ``{"type": "image", "image": ...}``
        (as a keyframe), ``{"type": "audio", "audio": ..., "sample_rate": hz}`` (a float waveform ``[N]`` or
        ``[channels, N]``, or a base64 ``data:audio/...`` URL of a WAV/FLAC file)."""
        if value is None:
            return []
        from diffusers.modular_pipelines.minimax_h3 import (
            MiniMaxH3AudioReference,
            MiniMaxH3ImageReference,
        )

        if not isinstance(value, (list, tuple)) or not value:
            raise InvalidRequestError("references must be a non-empty list of {type: image|audio, ...} objects", param="references")
        out: list[Any] = []
        for index, entry in enumerate(value):
            kind = entry.get("type") if isinstance(entry, dict) else None
            if kind == "image":
                out.append(MiniMaxH3ImageReference(image=decode_image(entry.get("image"), f"references[{index}].image")))
            elif kind == "audio":
                waveform, rate = decode_audio(entry.get("audio"), entry.get("sample_rate"), f"references[{index}].audio")
                if rate != self.geometry.audio_sample_rate and not _has_torchaudio():
                    raise InvalidRequestError(
                        f"references[{index}] is audio at {rate} Hz; this model's audio VAE runs at "
                        f"{self.geometry.audio_sample_rate} Hz and resampling needs torchaudio: send it at that rate",
                        param="references",
                    )
                out.append(MiniMaxH3AudioReference(audio=waveform, sample_rate=rate))
            else:
                raise InvalidRequestError(
                    f"references[{index}] must be {{'type': 'image', 'image': ...}} or {{'type': 'audio', 'audio': ..., "
                    "'sample_rate': ...}} (video references need torchvision, which this build lacks)",
                    param="references",
                )
        return out


def _check_cache(params: dict[str, Any]) -> None:
    """A valid ``cache``, refused here before the encoder runs (the engine refused unknown names:
    `MiniMaxH3DiT.request_params`)."""
    from omni_core.stages.diffusion_cache import CacheConfig, resolve_cache

    resolve_cache(CacheConfig(), params.get("cache"))


def _has_torchaudio() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchaudio") is not None


def decode_audio(value: Any, sample_rate: Any, param: str) -> tuple[Any, int]:
    """A reference soundtrack as a float32 ``[channels, N]`` tensor and its rate: an array (with
    `sample_rate`) or a base64 ``data:audio/...`` URL (never a path or a URL to fetch)."""
    import numpy as np
    import torch

    if isinstance(value, str):
        if value[:5].lower() != "data:":
            raise InvalidRequestError(f"{param} must be a base64 data URL (data:audio/wav;base64,...); paths and URLs are not fetched", param=param)
        from omni_core.media_access import data_url_bytes
        from omni_core.media_decode import read_audio

        # (its bytes decide what it is, not the URL's media type: `omni generate` names a file's type from its name)
        samples, rate = read_audio(data_url_bytes(value, param)[1], param, param)  # its duration checked before decoding
        return torch.from_numpy(np.ascontiguousarray(samples.T)), int(rate)
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
        raise InvalidRequestError(f"{param} needs its sample_rate (a positive integer, Hz)", param=param)
    array = np.asarray(value, dtype=np.float32) if value is not None else None
    if array is None or array.ndim not in (1, 2) or array.size == 0 or (array.ndim == 2 and array.shape[0] not in (1, 2)):
        raise InvalidRequestError(f"{param} must be a float waveform [N] or [channels (1 or 2), N]", param=param)
    return torch.from_numpy(np.ascontiguousarray(array.reshape(1, -1) if array.ndim == 1 else array)), sample_rate


def decode_image(value: Any, param: str) -> Any:
    """A keyframe as a PIL RGB image: a PIL image, an HxWx3 uint8 array or a base64 ``data:image/...`` URL.

    A path or an http(s) URL is refused: a server must never read files or fetch URLs for a client.
    """
    if value is None:
        return None
    import numpy as np
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, str):
        if value[:5].lower() != "data:":  # (any media type: the bytes are decoded as an image or refused)
            raise InvalidRequestError(
                f"{param} must be a base64 data URL (data:image/png;base64,...); paths and URLs to fetch are not accepted",
                param=param,
            )
        from omni_core.media_access import data_url_bytes
        from omni_core.media_decode import open_image

        return open_image(data_url_bytes(value, param)[1], param, max_pixels=MAX_IMAGE_PIXELS)
    array = np.asarray(value)
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8 or 0 in array.shape:
        raise InvalidRequestError(f"{param} must be an HxWx3 uint8 array, a PIL image or a data URL", param=param)
    return Image.fromarray(array)

