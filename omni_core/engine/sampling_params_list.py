"""vLLM-Omni's ``sampling_params_list``, mapped onto Omni's per-stage parameters.

vLLM-Omni takes one set of vLLM sampling parameters per stage, in stage order (its Qwen3-Omni
example: thinker, talker, code2wav), on the server (``extra_body.sampling_params_list``, dicts) and
offline (``Omni.generate(prompts, sampling_params_list)``, vLLM `SamplingParams` or dicts). Omni
names stages instead (`stage_params`), so the list is read by position against the resolved
pipeline's stage order. Mapping by stage kind:

- ``ar`` stages sample with vLLM: every key is passed on except those in `IGNORED_KEYS`.
- ``generation`` stages (codec decoders such as code2wav) do not sample: vLLM-Omni runs them in an
  LLM engine, so its clients send sampling parameters for them, which mean nothing here and are
  dropped. Only vLLM's key names are accepted, as vLLM-Omni's own `SamplingParams` would.
- Other stages (diffusion) get the entry as their own parameters, which the stage checks.

`IGNORED_KEYS` (``detokenize``, ``output_kind``, ``skip_clone``) steer vLLM-Omni's engine (how
outputs are collected), which the stage runtime decides here: they are accepted and dropped everywhere.

A vLLM `SamplingParams` object stands for all its fields, as in vLLM-Omni, where it replaces the
stage's defaults: vLLM's defaults included (``max_tokens=16`` when left unset, ``temperature=1.0``),
but a stage's stop tokens are kept (`omni_core.engine.params.UNION_KEYS`). Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omni_core.config.resolved import ResolvedPipeline
from omni_core.errors import InvalidRequestError

# vLLM's `SamplingParams.from_optional` arguments (vLLM 0.32). Kept here rather than read from vLLM
# so that the API process need not import vLLM; tests/test_sampling_params_list.py checks it against
# the installed vLLM, so an upgrade that adds or renames one fails a test instead of a request.
VLLM_SAMPLING_KEYS = frozenset(
    {
        "allowed_token_ids", "bad_words", "detokenize", "extra_args", "frequency_penalty", "ignore_eos",
        "include_stop_str_in_output", "logit_bias", "logprob_token_ids", "logprobs", "max_tokens", "min_p",
        "min_tokens", "n", "output_kind", "presence_penalty", "prompt_logprob_start", "prompt_logprob_token_ids",
        "prompt_logprobs", "repetition_detection", "repetition_penalty", "routed_experts_prompt_start", "seed",
        "skip_clone", "skip_special_tokens", "spaces_between_special_tokens", "stop", "stop_token_ids",
        "stream_interval", "structured_outputs", "temperature", "thinking_token_budget", "top_k", "top_p",
        "trace_decode_token_ids", "watermarking",
    }
)

# Keys that only steer vLLM-Omni's engine (text detokenization of a stage's tokens, how outputs are
# delivered, whether vLLM may skip copying them): Omni's stage runtime owns these, so they are
# accepted and ignored on every stage.
IGNORED_KEYS = frozenset({"detokenize", "output_kind", "skip_clone"})

# Stage kinds whose vLLM-Omni counterpart runs in vLLM's LLM engine (its entry is `SamplingParams`).
SAMPLING_KINDS = frozenset({"ar", "generation"})


def stage_params_from_list(pipeline: ResolvedPipeline, entries: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """``sampling_params_list`` -> parameters per stage name; raises `InvalidRequestError` naming
    the entry (``sampling_params_list[1].foo``) for a wrong length, a non-object or an unknown key."""
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise InvalidRequestError(
            f"sampling_params_list must be a list (one entry per stage), got {type(entries).__name__}", param="sampling_params_list"
        )
    stages = pipeline.stages
    if len(entries) != len(stages):
        order = ", ".join(s.name for s in stages)
        raise InvalidRequestError(
            f"sampling_params_list has {len(entries)} entries; this pipeline has {len(stages)} stages, one entry each in "
            f"this order: {order} (or name stages in stage_params instead)",
            param="sampling_params_list",
        )
    params: dict[str, dict[str, Any]] = {}
    for index, (stage, raw) in enumerate(zip(stages, entries)):
        where = f"sampling_params_list[{index}]"
        entry = sampling_params_dict(raw, where, stage.name)
        if stage.kind in SAMPLING_KINDS:
            for key in entry:
                if key not in VLLM_SAMPLING_KEYS:
                    raise InvalidRequestError(
                        f"unknown sampling parameter {key!r} in {where} (stage {stage.name!r}); vLLM's are {', '.join(sorted(VLLM_SAMPLING_KEYS))}",
                        param=f"{where}.{key}",
                    )
        # A decoder stage does not sample: vLLM-Omni's entry for it has no meaning here.
        kept = {} if stage.kind == "generation" else {k: v for k, v in entry.items() if k not in IGNORED_KEYS}
        if kept:
            params[stage.name] = kept
    return params


def sampling_params_dict(entry: Any, where: str, stage: str) -> dict[str, Any]:
    """One entry as a dict: a dict as it is, a vLLM `SamplingParams` as the fields it sets apart
    from vLLM's defaults; anything else is an `InvalidRequestError`."""
    if isinstance(entry, dict):
        return entry
    if _is_sampling_params(entry):
        values = {key: getattr(entry, key, None) for key in sorted(VLLM_SAMPLING_KEYS - IGNORED_KEYS)}
        # ``n`` (one output stream per request here) and ``extra_args`` (the stage's bookkeeping) are
        # the stage's own; vLLM's defaults for them mean "not set".
        return {key: value for key, value in values.items() if value is not None and not (key == "n" and value == 1) and not (key == "extra_args" and not value)}
    raise InvalidRequestError(
        f"{where} (stage {stage!r}) must be an object of sampling parameters (a dict or vLLM's SamplingParams), "
        f"got {type(entry).__name__}",
        param=where,
    )


def _is_sampling_params(value: Any) -> bool:
    # By class name and module, not isinstance: the caller's vLLM is not imported here.
    cls = type(value)
    return cls.__name__ == "SamplingParams" and cls.__module__.startswith("vllm")
