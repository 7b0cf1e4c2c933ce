"""The ``ar`` stage's ratio step (think/recaption-then-draw): a vLLM logits processor.

After the reasoning's closer (``</think>`` or ``</recaption>``; think-and-recaption: ``</think>``, then
``<recaption>`` forced, then ``</recaption>``) the release's Instruct model writes
``<answer><boi><img_size_B>`` and one ``<img_ratio_k>``; its sampler limits that last token to the
ratio tokens. Here, for a request whose ``SamplingParams.extra_args`` carry `TAIL_ARG`, the tokens
after the closer are forced in that order (the closer itself once the reasoning has used its budget) and the ratio is the
drawable one the model ranks first, even when the reasoning is sampled (the release picks it greedily; the
request stops on a ratio token: they are its stop tokens). Other requests are untouched. Registered
through vLLM's own extension point (``logits_processors`` engine argument), per request through
`AdapterLogitsProcessor`. This module imports vLLM: it is loaded by vLLM, in the engine's process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

TAIL_ARG = "omni_hunyuan_ratio_tail"
"""`extra_args` key: ``{"closers": [closer, ...], "openers": [opener, ...], "budget": n, "forced":
[answer, boi, size], "ratios": [allowed ids]}``: the reasoning's sections in order (``</think>``, then
for think-and-recaption ``</recaption>``), each next one opened by force (``openers[k]`` right after
``closers[k]``); a section still open once the reasoning has used `budget` tokens gets its closer then."""


def tail_allowed(tail: dict[str, Any], output_ids: list[int]) -> list[int] | None:
    """The token ids allowed next (None: any), given the tokens generated so far."""
    closers, openers = tail["closers"], tail.get("openers", [])
    section, start = 0, 0
    while True:
        cut = next((i for i in range(start, len(output_ids)) if output_ids[i] == closers[section]), None)
        if cut is None:
            return [closers[section]] if len(output_ids) >= tail["budget"] else None
        if section == len(closers) - 1:
            after = len(output_ids) - cut - 1
            forced = tail["forced"]
            return [forced[after]] if after < len(forced) else list(tail["ratios"])
        if cut + 1 == len(output_ids):
            return [openers[section]]
        section, start = section + 1, cut + 2


def limit_logits(tail: dict[str, Any], ratios: torch.Tensor, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A request's next-token `logits` (``[vocab]``) limited by `tail` (`TAIL_ARG`; `ratios`: its ratio ids
    as a tensor): during the reasoning no ratio token (a stop token: it would end the reasoning
    unclosed); then each forced token alone; at the ratio step only the allowed ratio the logits rank
    first (the release's ``force_greedy``: a sampled reasoning still gets the greedy ratio)."""
    allowed = tail_allowed(tail, output_ids)
    if allowed is None:
        logits[ratios.to(logits.device)] = float("-inf")
        return logits
    keep = torch.full_like(logits, float("-inf"))
    index = torch.tensor(allowed, device=logits.device)
    if len(allowed) > 1:
        index = index[logits[index].argmax()][None]
    keep[index] = logits[index]
    return keep


class RatioTail(AdapterLogitsProcessor):
    """Forces ``<answer><boi><img_size>`` after the closer, then the first-ranked allowed ratio token (`limit_logits`)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        tail = (params.extra_args or {}).get(TAIL_ARG)
        if tail is None:
            return None
        return functools.partial(limit_logits, tail, torch.tensor(tail["ratios"]))
