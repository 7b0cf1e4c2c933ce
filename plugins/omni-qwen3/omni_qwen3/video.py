"""Video input for Qwen3-Omni without torchvision: decoding (PyAV) and the video processor.

transformers' ``Qwen2VLVideoProcessor`` (the video processor of Qwen3-Omni) needs torchvision, which
cannot be installed on CPU machines. `QwenVideoProcessor` reproduces what it computes, step by step:

- frame sampling (`sample_frame_indices`, only where the config says ``do_sample_frames``): its
  ``sample_frames`` (``fps`` / ``num_frames``, ``min_frames`` / ``max_frames``, a multiple of
  ``temporal_patch_size``);
- resize of every frame to ``smart_resize`` of its size (factor ``patch_size * merge_size``, the
  pixel bounds ``Qwen3OmniMoeProcessor`` passes), with torchvision's CPU kernel for uint8 bicubic:
  ``torch.nn.functional.interpolate(uint8, mode="bicubic", antialias=True, align_corners=False)``;
- fused rescale + normalize in float32 (``(x - mean / rescale) / (std / rescale)``);
- padding to a multiple of ``temporal_patch_size`` with the last frame, and the same patch layout
  (``pixel_values_videos [t*h*w, C*tp*p*p]``, ``video_grid_thw``).

It is callable like the HF video processor (``processor(videos=..., size=..., return_tensors=...)``),
so the HF ``Qwen3OmniMoeProcessor`` that vLLM's thinker runs can use it (`omni_qwen3.thinker`), and
`omni_qwen3.reference.prepare_inputs` feeds the same features to transformers' model.

``video_second_per_grid`` follows ``Qwen3OmniMoeProcessor``: ``temporal_patch_size / fps`` with the
processor call's ``fps`` (1.0 unless given), not the video's frame rate.
"""

from __future__ import annotations

import functools
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from omni_core.errors import InvalidRequestError
from omni_core.media_decode import MAX_AUDIO_SECONDS, check_frame_count, check_video_stream
from omni_qwen3.inputs import undecodable

if TYPE_CHECKING:
    import numpy as np
    import torch

VIDEO_CONFIG = "video_preprocessor_config.json"
PROCESSOR_FPS = 1.0
"""``Qwen3OmniMoeProcessor``'s fps for ``video_second_per_grid`` when the call passes none."""


SOUND_TRACK_RATE = 16000
"""Sample rate of a decoded sound track (the thinker's audio encoder input)."""


@attrs.frozen
class DecodedVideo:
    """Frames of one video as ``uint8 [T, H, W, 3]`` RGB, its frame rate (None if unknown) and,
    when asked for, its sound track (mono float32 at `SOUND_TRACK_RATE`)."""

    frames: np.ndarray
    fps: float | None = None
    audio: np.ndarray | None = None


def decode_video(raw: bytes, where: str = "video", with_audio: bool = False) -> DecodedVideo:
    """Decode a video file's bytes (any container/codec FFmpeg reads) to RGB frames with PyAV;
    `with_audio` also decodes its first audio stream in the same pass over the file, downmixed to
    mono and resampled to `SOUND_TRACK_RATE` by FFmpeg's resampler (float32 samples)."""
    try:
        import av
    except ImportError:  # pragma: no cover - av is a dependency of the serving install
        raise InvalidRequestError(
            f"{where}: video input needs PyAV: pip install av", param="messages"
        ) from None
    import numpy as np

    frames: list[np.ndarray] = []
    pieces: list[np.ndarray] = []
    fps: float | None = None
    sound = 0
    part = "video"
    try:
        with av.open(io.BytesIO(raw), mode="r") as container:
            if not container.streams.video:
                raise InvalidRequestError(f"{where}: the file has no video stream", param="messages")
            video = container.streams.video[0]
            # What the container declares is checked before decoding, what it holds while decoding.
            check_video_stream(video, where, "messages")
            if video.average_rate:
                fps = float(video.average_rate)
            streams = [video]
            resampler = None
            if with_audio:
                if not container.streams.audio:
                    raise InvalidRequestError(
                        f"{where}: use_audio_in_video reads the video's sound track, and this video has none", param="messages"
                    )
                streams.append(container.streams.audio[0])
                resampler = av.AudioResampler(format="flt", layout="mono", rate=SOUND_TRACK_RATE)
            # One demux over both streams; each stream's last (empty) packet flushes its decoder.
            for packet in container.demux(*streams):
                part = "video" if packet.stream is video else "video's sound track"
                for frame in packet.decode():
                    if resampler is None or packet.stream is video:
                        check_frame_count(len(frames) + 1, frame.width, frame.height, where, "messages")
                        frames.append(frame.to_ndarray(format="rgb24"))
                    else:
                        new = [out.to_ndarray().reshape(-1) for out in resampler.resample(frame)]
                        pieces.extend(new)
                        sound += sum(len(piece) for piece in new)
                        if sound > MAX_AUDIO_SECONDS * SOUND_TRACK_RATE:
                            raise InvalidRequestError(
                                f"{where}: the video's sound track is longer than the limit of {MAX_AUDIO_SECONDS:g} s", param="messages"
                            )
            if resampler is not None:
                part = "video's sound track"
                pieces.extend(out.to_ndarray().reshape(-1) for out in resampler.resample(None))
    except InvalidRequestError:
        raise
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise undecodable(where, f"the {part}", exc) from None
    if not frames:
        raise InvalidRequestError(f"{where}: the video has no frames", param="messages")
    audio = None
    if with_audio:
        audio = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, dtype=np.float32)
        if audio.size == 0:
            raise InvalidRequestError(f"{where}: the video's sound track is empty", param="messages")
    return DecodedVideo(frames=np.stack(frames), fps=fps, audio=audio)


def as_frames(video: Any, where: str = "video") -> np.ndarray:
    """A frames array ``[T, H, W, 3]`` (uint8, or floats in 0..255) or a list of PIL images ->
    ``uint8 [T, H, W, 3]``."""
    import numpy as np
    from PIL import Image

    if isinstance(video, (list, tuple)) and video and all(isinstance(f, Image.Image) for f in video):
        video = np.stack([np.asarray(f.convert("RGB")) for f in video])
    array = np.asarray(video)
    if array.ndim != 4 or array.shape[0] == 0 or array.shape[-1] != 3 or min(array.shape[1:3]) == 0:
        raise InvalidRequestError(
            f"{where}: a video must be a non-empty [frames, height, width, 3] RGB array or a list of PIL images",
            param="messages",
        )
    if array.dtype != np.uint8:
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 255:
            raise InvalidRequestError(f"{where}: video values must be 0..255", param="messages")
        array = array.astype(np.uint8)
    return np.ascontiguousarray(array)


def processor_video_kwargs() -> dict[str, Any]:
    """The video kwargs ``Qwen3OmniMoeProcessor`` passes to its video processor by default (its
    ``size`` bounds override the video processor config's)."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessorKwargs

    defaults = Qwen3OmniMoeProcessorKwargs._defaults["videos_kwargs"]
    return {"size": dict(defaults["size"])}


@attrs.frozen
class QwenVideoProcessor:
    """torchvision-free ``Qwen2VLVideoProcessor`` (see the module docstring).

    Built from a checkpoint's ``video_preprocessor_config.json`` (`from_pretrained`); missing keys
    take ``Qwen2VLVideoProcessor``'s class defaults.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    size: dict[str, int] = attrs.field(factory=lambda: {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768})
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    model_input_names: tuple[str, ...] = ("pixel_values_videos", "video_grid_thw")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> QwenVideoProcessor:
        path = Path(model_dir) / VIDEO_CONFIG
        config: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        size = dict(config.get("size") or cls().size)
        if config.get("min_pixels") is not None:
            size["shortest_edge"] = int(config["min_pixels"])
        if config.get("max_pixels") is not None:
            size["longest_edge"] = int(config["max_pixels"])
        names = {f.name for f in attrs.fields(cls)} - {"size", "model_input_names"}
        kwargs = {k: v for k, v in config.items() if k in names and v is not None}
        for key in ("image_mean", "image_std"):
            if key in kwargs:
                kwargs[key] = tuple(kwargs[key])
        return cls(size=size, **kwargs)

    # -- the HF processor interface ----------------------------------------------------------------

    @property
    def valid_kwargs(self) -> type:
        """The call's keyword arguments as a TypedDict (HF's processor and vLLM read its annotations)."""
        return _video_kwargs_type()

    def __call__(self, videos: Any = None, *, size: dict[str, int] | None = None, return_tensors: Any = None,
                 **_ignored: Any) -> Any:
        """``videos``: one frames array or a list of them -> ``BatchFeature`` with
        ``pixel_values_videos`` and ``video_grid_thw`` (torch tensors). Other kwargs of the HF
        call (``fps``, ``do_sample_frames``: frames arrive sampled) are ignored."""
        import torch
        from transformers import BatchFeature

        if videos is None:
            raise InvalidRequestError("the video processor got no videos", param="messages")
        items = [videos] if _is_single_video(videos) else list(videos)
        patches, grids = [], []
        for i, video in enumerate(items):
            frames = as_frames(video, f"video {i}")
            pixel_values, grid = self.process(frames, size=size)
            patches.append(pixel_values)
            grids.append(grid)
        return BatchFeature(
            data={"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids, dtype=torch.long)}
        )

    # -- the computation -------------------------------------------------------------------------

    def resized_size(self, height: int, width: int, size: dict[str, int] | None = None) -> tuple[int, int]:
        """Frame size after ``smart_resize`` (the image processor's rule, factor patch * merge)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        bounds = size or self.size
        if not self.do_resize:
            return height, width
        try:
            return smart_resize(
                height, width, factor=self.patch_size * self.merge_size,
                min_pixels=bounds["shortest_edge"], max_pixels=bounds["longest_edge"],
            )
        except ValueError as exc:  # aspect ratio over 200
            raise InvalidRequestError(f"video frames of {width}x{height}: {exc}", param="messages") from None

    def grid(self, num_frames: int, height: int, width: int, size: dict[str, int] | None = None) -> tuple[int, int, int]:
        """``video_grid_thw`` of a video of `num_frames` (already sampled) frames of height x width."""
        resized_height, resized_width = self.resized_size(height, width, size)
        grid_t = (num_frames + -num_frames % self.temporal_patch_size) // self.temporal_patch_size
        return grid_t, resized_height // self.patch_size, resized_width // self.patch_size

    def num_tokens(self, num_frames: int, height: int, width: int, size: dict[str, int] | None = None) -> int:
        """Placeholder tokens of such a video in the thinker's prompt."""
        t, h, w = self.grid(num_frames, height, width, size)
        return t * h * w // (self.merge_size**2)

    def process(self, frames: np.ndarray, size: dict[str, int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """``uint8 [T, H, W, 3]`` frames -> (``pixel_values_videos [t*h*w, 3*tp*p*p]``, ``[t, h, w]``)."""
        import torch

        video = torch.tensor(frames).permute(0, 3, 1, 2).contiguous()  # T C H W, uint8 (a copy: frames may be read-only)
        height, width = video.shape[-2:]
        resized_height, resized_width = self.resized_size(int(height), int(width), size)
        if (resized_height, resized_width) != (height, width):
            # torchvision's resize on CPU runs this kernel natively on uint8 for bicubic.
            video = torch.nn.functional.interpolate(
                video, size=[resized_height, resized_width], mode="bicubic", align_corners=False, antialias=True
            )
        video = video.to(torch.float32)
        if self.do_normalize:
            scale = 1.0 / self.rescale_factor if self.do_rescale else 1.0
            mean = (torch.tensor(self.image_mean) * scale).view(-1, 1, 1)
            std = (torch.tensor(self.image_std) * scale).view(-1, 1, 1)
            video = (video - mean) / std
        elif self.do_rescale:
            video = video * self.rescale_factor
        return self._patchify(video)

    def _patchify(self, video: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        import torch

        tp, patch, merge = self.temporal_patch_size, self.patch_size, self.merge_size
        num_frames, channels, height, width = video.shape
        if pad := -num_frames % tp:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
            num_frames += pad
        grid_t, grid_h, grid_w = num_frames // tp, height // patch, width // patch
        patches = video.view(grid_t, tp, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(grid_t * grid_h * grid_w, channels * tp * patch * patch)
        return flat, [grid_t, grid_h, grid_w]

    def sample_frame_indices(self, total_frames: int, video_fps: float | None) -> np.ndarray | None:
        """Indices of the frames to keep (``Qwen2VLVideoProcessor.sample_frames``), or None to keep
        all (``do_sample_frames`` off, or an fps target with an unknown frame rate)."""
        import torch

        if not self.do_sample_frames:
            return None
        tp = self.temporal_patch_size
        if self.num_frames is not None:
            num_frames = round(self.num_frames / tp) * tp
        elif self.fps is not None:
            if video_fps is None:
                return None
            max_frames = math.floor(min(self.max_frames, total_frames) / tp) * tp
            num_frames = total_frames / video_fps * self.fps
            num_frames = min(max(num_frames, self.min_frames), max_frames, total_frames)
            num_frames = math.floor(num_frames / tp) * tp
        else:
            return None
        if num_frames <= 0 or num_frames > total_frames:
            raise InvalidRequestError(
                f"the video has {total_frames} frames, too few to sample {max(num_frames, tp)} "
                f"(temporal patch {tp}): send a longer video",
                param="messages",
            )
        return torch.arange(0, total_frames, total_frames / num_frames).int().numpy()

    def sample(self, video: DecodedVideo) -> np.ndarray:
        """The frames the processor keeps of a decoded video."""
        indices = self.sample_frame_indices(video.frames.shape[0], video.fps)
        return video.frames if indices is None else video.frames[indices]


@functools.cache
def _video_kwargs_type() -> type:
    from transformers.processing_utils import VideosKwargs

    class QwenVideoProcessorKwargs(VideosKwargs, total=False):
        """``Qwen2VLVideoProcessor``'s own keyword arguments (its module needs torchvision)."""

        min_pixels: int
        max_pixels: int
        patch_size: int
        temporal_patch_size: int
        merge_size: int
        min_frames: int
        max_frames: int

    return QwenVideoProcessorKwargs


def _is_single_video(videos: Any) -> bool:
    """One video (a 4-D array, or a list of PIL frames) rather than a list of videos."""
    if hasattr(videos, "ndim"):
        return int(videos.ndim) == 4
    from PIL import Image

    return isinstance(videos, (list, tuple)) and bool(videos) and isinstance(videos[0], Image.Image)
