"""The family contract (`omni_core.testing.family_contract`) for Cosmos3: images, video with audio, actions."""

from __future__ import annotations

from typing import Any

import numpy as np

from omni_core.engine.request import OmniRequest
from omni_core.testing.family_contract import PROMPTS, FamilyContract

DOMAIN = "bridge_orig_lerobot"  # 10 action channels, the tiny checkpoint's action_dim


class TestCosmos3Family(FamilyContract):
    family = "cosmos3"
    deploy = {"stages": {"generator": {"placement": "inline", "options": {"admission_window_ms": 20}}}}
    # One task per request: an image, a video with its sound, or a robot's actions.
    modality_sets = (("image",), ("video", "audio"), ("action",))
    # Batched forwards round differently from single ones: a pixel level, float noise elsewhere.
    tolerance = {"image": 1, "video": 1, "audio": 1e-4, "action": 1e-4}

    def valid_request(self, modalities: tuple[str, ...], index: int) -> OmniRequest:
        params: dict[str, Any] = {"num_inference_steps": 2, "guidance_scale": 3.0}
        extra: dict[str, Any] = {"seed": index}
        if "action" in modalities:
            frame = np.random.default_rng(index).integers(0, 256, (24, 32, 3), dtype=np.uint8)
            extra.update(image=frame, domain=DOMAIN, chunk_size=4, resolution_tier=256)
        else:
            extra["size"] = (32, 32)
        if "video" in modalities:
            params["num_frames"] = 5
        return OmniRequest(prompt=PROMPTS[index], modalities=modalities, params={"generator": params}, extra=extra)

    def bad_requests(self) -> dict[str, OmniRequest]:
        steps = {"generator": {"num_inference_steps": 2}}
        return {
            **super().bad_requests(),
            "a size the VAE cannot divide": OmniRequest(
                prompt="a cat", modalities=("image",), params=steps, extra={"size": (33, 32)}
            ),
            "an image in the chat message (it reads none there)": OmniRequest(
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "a cat"}]}],
                params=steps,
            ),
            "actions of an unknown robot": OmniRequest(
                prompt="a robot", modalities=("action",), params=steps,
                extra={"image": np.zeros((24, 32, 3), np.uint8), "domain": "no_such_robot", "chunk_size": 4},
            ),
        }
