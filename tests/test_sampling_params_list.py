"""The server's copy of vLLM's sampling parameter names matches the installed vLLM (the API process
does not import vLLM; an upgrade that changes the names must fail here, not in a request)."""

from __future__ import annotations

import inspect

from omni_core.engine.sampling_params_list import IGNORED_KEYS, VLLM_SAMPLING_KEYS


def test_vllm_sampling_keys_match_the_installed_vllm() -> None:
    import vllm  # (CI installs it: a missing vLLM fails here, as every vLLM test does)
    names = set(inspect.signature(vllm.SamplingParams.from_optional).parameters) - {"self", "cls"}
    assert VLLM_SAMPLING_KEYS == names
    assert IGNORED_KEYS <= VLLM_SAMPLING_KEYS
