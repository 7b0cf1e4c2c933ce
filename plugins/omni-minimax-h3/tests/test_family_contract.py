"""The family contract (`omni_core.testing.family_contract`) for MiniMax-H3: video with stereo sound."""

from __future__ import annotations

from typing import Any

from omni_core.engine.request import OmniRequest
from omni_core.testing.family_contract import PROMPTS, FamilyContract


class TestMiniMaxH3Family(FamilyContract):
    family = "minimax-h3"
    deploy = {
        "stages": {
            "encoder": {"placement": "inline"},
            "dit": {"placement": "inline", "options": {"admission_window_ms": 20}},
        }
    }
    # Requests batched in one forward match each alone to float rounding (the encoder pads, the
    # DiT packs): a pixel level at most, audio within 1e-4.
    tolerance = {"video": 1, "audio": 1e-4}

    def valid_request(self, modalities: tuple[str, ...], index: int) -> OmniRequest:
        extra: dict[str, Any] = {"seed": index, "size": (32, 32), "num_frames": 124}
        return OmniRequest(prompt=PROMPTS[index], modalities=modalities, params={"dit": {"num_inference_steps": 3}}, extra=extra)

    def bad_requests(self) -> dict[str, OmniRequest]:
        steps = {"dit": {"num_inference_steps": 2}}
        return {
            **super().bad_requests(),
            "an image in the chat message (it reads none there)": OmniRequest(
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "a cat"}]}],
                params=steps,
            ),
            "a size the VAE cannot divide": OmniRequest(prompt="a cat", params=steps, extra={"size": (48, 32)}),
            "too long a video": OmniRequest(prompt="a cat", params=steps, extra={"seconds": 20}),
            "an aspect ratio past 4:1": OmniRequest(prompt="a cat", params=steps, extra={"size": (160, 32)}),
            "a first frame given as a path": OmniRequest(prompt="a cat", params=steps, extra={"image": "/etc/passwd"}),
        }
