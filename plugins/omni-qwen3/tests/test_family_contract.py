"""The family contract (`omni_core.testing.family_contract`) for Qwen3-Omni: thinker -> talker -> code2wav."""

from __future__ import annotations

import pytest

import vllm  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)

from omni_core.engine.request import OmniRequest  # noqa: E402
from omni_core.testing.family_contract import FamilyContract  # noqa: E402


@pytest.mark.vllm
class TestQwen3OmniFamily(FamilyContract):
    family = "qwen3-omni"
    # Small and fast to start: no compile, and stages in this process except the talker (two vLLM
    # engines cannot share a process).
    deploy = {
        "stages": {
            "thinker": {"placement": "inline", "options": {"max_model_len": 512}},
            "talker": {"options": {"max_model_len": 1024}},
            "code2wav": {"placement": "inline", "options": {"compile": False}},
        }
    }
    # Greedy in both AR stages (the talker samples by default); random weights never emit the
    # codec's end token, so its frames are capped.
    params = {"thinker": {"max_tokens": 8, "temperature": 0.0}, "talker": {"max_tokens": 8, "temperature": 0.0}}
    tolerance = {"audio": 1e-5}

    def bad_requests(self) -> dict[str, OmniRequest]:
        audio = ("text", "audio")
        return {
            **super().bad_requests(),
            "unknown voice": OmniRequest(prompt="hi", modalities=audio, extra={"voice": "Nobody"}),
            # Rejected inside the talker stage, after the thinker has run.
            "unknown talker speaker": OmniRequest(prompt="hi", modalities=audio, params={"talker": {"speaker": "Nobody"}}),
        }
