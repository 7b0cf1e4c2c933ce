"""The family contract (`omni_core.testing.family_contract`) for both toy families."""

from __future__ import annotations

import pytest

from omni_core.engine.request import OmniRequest
from omni_core.testing.family_contract import FamilyContract


@pytest.mark.vllm
class TestToyFamily(FamilyContract):
    family = "toy"
    deploy = {"stages": {"lm": {"placement": "inline"}, "vocoder": {"placement": "inline"}}}
    params = {"lm": {"max_tokens": 8, "temperature": 0.0}}
    tolerance = {"audio": 1e-5}  # the vocoder's float32 convolutions differ by ~1e-7 with the batch shape

    def bad_requests(self) -> dict[str, OmniRequest]:
        return {
            **super().bad_requests(),
            "a negative temperature (vLLM rejects it)": OmniRequest(prompt="hello", params={"lm": {"temperature": -1.0}}),
            "a prompt past max_model_len": OmniRequest(prompt="one two three " * 200, params={"lm": {"max_tokens": 4}}),
        }


class TestToyPassthroughFamily(FamilyContract):
    family = "toy-passthrough"
    deploy = {"stages": {"echo": {"placement": "inline"}}}

    def bad_requests(self) -> dict[str, OmniRequest]:
        return {
            **super().bad_requests(),
            "rejected when it starts": OmniRequest(prompt="x", params={"echo": {"fail": "invalid"}}),
            "rejected by the model mid-step": OmniRequest(prompt="x", params={"echo": {"fail": "request"}}),
        }
