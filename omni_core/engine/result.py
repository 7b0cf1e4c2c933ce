"""`OmniResult`: a request's outputs accumulated from its streamed deltas, and saving them as files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from omni_core.outputs import OutputDelta


@attrs.define
class OmniResult:
    """Everything a request produced, by modality.

    `text`/`token_ids`/`logprobs` come from the stage whose output is ``text``, `prompt_token_ids` too
    (else from the first stage that sends them: a diffusion stage's prompt as its model read it); `audio`
    (float32 samples: ``[N]`` mono, or ``[N, 2]`` when a stage sends stereo) and `sample_rate`, `images`, `video`/`fps` and `actions` from whichever
    stage sends those keys (a diffusion stage may send a video and its audio in one delta).
    `actions` is an array (``[steps, action width]``), or a list of them for ``n`` samples.
    `extra` keeps any other keys per stage (last value wins).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[Any] = attrs.field(factory=list)  # per token, when asked for (`omni_core.stages.ar`)
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    sample_rate: int | None = None
    images: list[Any] = attrs.field(factory=list)
    video: Any = None
    fps: float | None = None
    actions: Any = None
    extra: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    _audio_parts: list[Any] = attrs.field(factory=list, repr=False)
    _prompt_from_text: bool = attrs.field(default=False, repr=False)

    def add(self, delta: OutputDelta) -> None:
        data = dict(delta.data)
        prompt = data.pop("prompt_token_ids", None)
        text = delta.modality == "text"
        if prompt is not None and (self.prompt_token_ids is None or (text and not self._prompt_from_text)):
            self.prompt_token_ids = [int(t) for t in prompt]
            self._prompt_from_text = text
        if text:
            self.text += data.pop("text", "") or ""
            self.token_ids.extend(int(t) for t in data.pop("token_ids", []) or [])
            self.logprobs.extend(data.pop("logprobs", None) or [])
            self.finish_reason = data.pop("finish_reason", None) or self.finish_reason
        else:
            self._add_media(data)
        if data:
            self.extra.setdefault(delta.stage, {}).update(data)

    def _add_media(self, data: dict[str, Any]) -> None:
        """Take the core's media keys out of `data` (see `omni_core.outputs.OutputDelta`)."""
        if "audio" in data or "sample_rate" in data:
            audio = data.pop("audio", None)
            if audio is not None and len(audio):
                self._audio_parts.append(_audio_samples(audio))
            self.sample_rate = data.pop("sample_rate", None) or self.sample_rate
        image = data.pop("image", None)
        if image is not None:
            self.images.extend(image if isinstance(image, list) else [image])
        video = data.pop("video", None)
        if video is not None:
            self.video = video
        self.fps = data.pop("fps", None) or self.fps
        actions = data.pop("actions", None)
        if actions is not None:
            self.actions = actions

    @property
    def audio(self) -> Any:
        """All audio so far as one float32 array (joined on read, not on every chunk), or None."""
        if not self._audio_parts:
            return None
        if len(self._audio_parts) > 1:
            import numpy as np

            self._audio_parts[:] = [np.concatenate(self._audio_parts)]
        return self._audio_parts[0]

    @property
    def audio_duration(self) -> float | None:
        if self.audio is None or not self.sample_rate:
            return None
        return len(self.audio) / self.sample_rate

    def save(self, directory: str | Path) -> dict[str, str]:
        """Write outputs as files a person opens (WAV, PNG, MP4 with the audio muxed, actions as .npy); return their paths by kind."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths: dict[str, str] = {}
        if self.audio is not None and self.sample_rate:
            import soundfile

            path = out / f"{self.request_id}.wav"
            soundfile.write(path, self.audio, self.sample_rate, subtype="PCM_16")
            paths["audio"] = str(path)
        if self.video is not None and not isinstance(self.video, list):
            from omni_core.media import encode_mp4

            path = out / f"{self.request_id}.mp4"
            path.write_bytes(encode_mp4(_numpy(self.video), self.fps or 24.0, self.audio, self.sample_rate))
            paths["video"] = str(path)
        for i, image in enumerate(self.images):
            from PIL import Image

            path = out / f"{self.request_id}-{i}.png"
            Image.fromarray(_numpy(image)).save(path)
            paths[f"image{i}" if i else "image"] = str(path)
        if self.actions is not None:
            import numpy as np

            path = out / f"{self.request_id}-actions.npy"
            np.save(path, _actions_array(self.actions))
            paths["actions"] = str(path)
        return paths

    @property
    def reported_finish_reason(self) -> str:
        """The finish reason a finished request reports (the server's answers, ``omni generate
        --json``): its text stage's, or "stop" where no stage gave one (an image, a video)."""
        return self.finish_reason or "stop"

    def to_json(self, paths: dict[str, str] | None = None) -> dict[str, Any]:
        """Plain-data summary (what ``omni generate --json`` prints)."""
        result: dict[str, Any] = {"request_id": self.request_id, "text": self.text, "finish_reason": self.reported_finish_reason}
        if self.prompt_token_ids is not None or self.token_ids:
            result["prompt_token_ids"] = self.prompt_token_ids
            result["token_ids"] = self.token_ids
        if self.audio is not None:
            channels = int(self.audio.shape[1]) if self.audio.ndim == 2 else 1
            result["audio"] = {"path": (paths or {}).get("audio"), "sample_rate": self.sample_rate, "duration_s": self.audio_duration, "num_samples": int(len(self.audio)), "channels": channels}
        if self.video is not None and not isinstance(self.video, list):
            shape = list(_numpy(self.video).shape)
            result["video"] = {"path": (paths or {}).get("video"), "shape": shape, "frames": shape[0], "fps": self.fps}
        if self.images:
            result["images"] = [{"path": (paths or {}).get(f"image{i}" if i else "image"), "shape": list(_numpy(im).shape)} for i, im in enumerate(self.images)]
        if self.actions is not None:
            actions = _actions_array(self.actions)
            result["actions"] = {"path": (paths or {}).get("actions"), "shape": list(actions.shape), "values": actions.tolist()}
        return result


def _audio_samples(audio: Any) -> Any:
    """float32 samples: ``[N, 2]`` stays stereo (video soundtracks); anything else is flattened to mono, as before."""
    samples = _numpy(audio).astype("float32", copy=False)
    return samples if samples.ndim == 2 and samples.shape[1] == 2 else samples.reshape(-1)


def _actions_array(actions: Any) -> Any:
    """One array: ``n`` samples' actions (a list) are stacked on a leading axis."""
    import numpy as np

    if isinstance(actions, list):
        return np.stack([_numpy(a) for a in actions]).astype("float32", copy=False)
    return _numpy(actions).astype("float32", copy=False)


def _numpy(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)
