"""vLLM-Omni's offline input shape, as `OmniRequest`s: ``Omni.generate(inputs, sampling_params_list)``.

vLLM-Omni (as vLLM's ``LLM.generate``) takes a prompt dict, or a list of them: ``prompt`` (the
model's final text: the chat template already applied, one placeholder per media item, e.g. Qwen3-
Omni's ``<|audio_start|><|audio_pad|><|audio_end|>``) or ``prompt_token_ids``, with
``multi_modal_data`` (``{"audio": (samples, rate)}``, ``{"image": PIL image}``, ``{"video": frames}``,
or lists of them), ``mm_processor_kwargs`` and vLLM-Omni's ``modalities`` (the outputs wanted).
Omni's own prompts differ: a plain string (or ``{"prompt": ...}``) is the user's text, put through
the family's chat template. So a dict is read as vLLM's when it has one of `VLLM_ONLY_KEYS`, or when
the call passes a ``sampling_params_list`` (vLLM-Omni's call).

The request carries the vLLM prompt in ``extra[VLLM_PROMPT]`` (``prompt``, ``prompt_token_ids``,
``multi_modal_data``); a family's input processor that understands it (Qwen3-Omni's) tokenizes the
text as it is, and others refuse it (`refuse_vllm_prompt`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from omni_core.engine.request import OmniRequest
from omni_core.errors import InvalidRequestError

VLLM_PROMPT = "vllm_prompt"
"""The `OmniRequest.extra` key holding a vLLM prompt (``prompt``, ``prompt_token_ids``, ``multi_modal_data``)."""

# Keys only vLLM's prompt dicts have (`OmniRequest` has ``prompt`` and ``modalities`` too).
VLLM_ONLY_KEYS = frozenset({"prompt_token_ids", "multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "cache_salt"})
# What vLLM-Omni's prompt dict may hold that Omni reads (``multi_modal_uuids`` and ``cache_salt`` only
# steer vLLM's caches: accepted and ignored).
VLLM_PROMPT_KEYS = VLLM_ONLY_KEYS | {"prompt", "modalities"}


def is_vllm_prompt(value: Any) -> bool:
    """Whether `value` is a dict in vLLM's prompt shape (it has a key only vLLM's prompts have)."""
    return isinstance(value, Mapping) and any(key in value for key in VLLM_ONLY_KEYS)


def request_from_vllm_prompt(prompt: Mapping[str, Any], params: dict[str, dict[str, Any]] | None = None, where: str = "prompt") -> OmniRequest:
    """A vLLM(-Omni) prompt dict -> an `OmniRequest` (`params`: per-stage parameters, e.g. from a
    ``sampling_params_list``); a key Omni does not know is an `InvalidRequestError` naming it."""
    unknown = sorted(set(prompt) - VLLM_PROMPT_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"{where}: unknown key(s) {unknown} of a vLLM prompt; Omni reads {', '.join(sorted(VLLM_PROMPT_KEYS))}", param=f"{where}.{unknown[0]}"
        )
    text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if (text is None) == (token_ids is None):
        raise InvalidRequestError(f"{where}: a vLLM prompt has either 'prompt' (text) or 'prompt_token_ids'", param=where)
    if text is not None and not isinstance(text, str):
        raise InvalidRequestError(f"{where}.prompt must be a string, got {type(text).__name__}", param=f"{where}.prompt")
    if token_ids is not None and (isinstance(token_ids, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids)):
        raise InvalidRequestError(f"{where}.prompt_token_ids must be a list of integers", param=f"{where}.prompt_token_ids")
    media = prompt.get("multi_modal_data") or {}
    if not isinstance(media, Mapping):
        raise InvalidRequestError(f"{where}.multi_modal_data must be a dict (audio, image, video)", param=f"{where}.multi_modal_data")
    extra: dict[str, Any] = {
        VLLM_PROMPT: {"prompt": text, "prompt_token_ids": None if token_ids is None else list(token_ids), "multi_modal_data": dict(media)}
    }
    if prompt.get("mm_processor_kwargs") is not None:
        extra["mm_processor_kwargs"] = prompt["mm_processor_kwargs"]
    modalities = prompt.get("modalities")
    if modalities is not None and (isinstance(modalities, str) or not all(isinstance(m, str) for m in modalities)):
        raise InvalidRequestError(f"{where}.modalities must be a list of strings", param=f"{where}.modalities")
    return OmniRequest(
        prompt=text,
        modalities=None if modalities is None else tuple(modalities),
        params=dict(params or {}),
        extra=extra,
    )


def mm_processor_flags(request: OmniRequest, known: Collection[str], family: str) -> dict[str, bool]:
    """The request's ``mm_processor_kwargs`` (vLLM's request field: the chat body's or a vLLM prompt's)
    for a family that reads only the true/false options `known`: those it sets. Not an object, another
    key or a value not true/false is an `InvalidRequestError` naming the field."""
    kwargs = request.extra.get("mm_processor_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(f"mm_processor_kwargs must be an object, got {type(kwargs).__name__}", param="mm_processor_kwargs")
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise InvalidRequestError(
            f"mm_processor_kwargs: {family} takes only {', '.join(map(repr, sorted(known)))}, not {', '.join(map(repr, unknown))}",
            param="mm_processor_kwargs",
        )
    for key, value in kwargs.items():
        if not isinstance(value, bool):
            raise InvalidRequestError(f"mm_processor_kwargs.{key} must be true or false, got {value!r}", param="mm_processor_kwargs")
    return dict(kwargs)


def refuse_vllm_prompt(request: OmniRequest, family: str) -> None:
    """For an input processor that takes no vLLM prompts: an `InvalidRequestError` saying what it takes."""
    if request.extra.get(VLLM_PROMPT) is not None:
        raise InvalidRequestError(
            f"the {family} family does not take vLLM prompt dicts (prompt text with placeholders and multi_modal_data): "
            "pass a text prompt, or OpenAI chat messages as {'messages': [...]}",
            param="prompt",
        )
