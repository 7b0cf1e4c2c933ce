"""`mm_processor_flags`: a family's true/false ``mm_processor_kwargs`` options (vLLM's request field),
checked once in the core for every family that reads them."""

from __future__ import annotations

import pytest

from omni_core.engine.request import OmniRequest
from omni_core.engine.vllm_inputs import mm_processor_flags, request_from_vllm_prompt
from omni_core.errors import InvalidRequestError


def test_the_options_a_request_sets_and_none_where_it_sets_none() -> None:
    assert mm_processor_flags(OmniRequest(prompt="hi"), ("a", "b"), "Fam") == {}
    request = OmniRequest(prompt="hi", extra={"mm_processor_kwargs": {"b": True}})
    assert mm_processor_flags(request, ("a", "b"), "Fam") == {"b": True}
    prompt = request_from_vllm_prompt({"prompt": "hi", "mm_processor_kwargs": {"a": False}})
    assert mm_processor_flags(prompt, ("a", "b"), "Fam") == {"a": False}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (["a"], "must be an object, got list"),
        ({"a": True, "do_resize": True}, "Fam takes only 'a', 'b', not 'do_resize'"),
        ({"a": "yes"}, r"mm_processor_kwargs.a must be true or false, got 'yes'"),
        ({"b": 1}, "must be true or false, got 1"),
    ],
)
def test_refusals_name_the_field(kwargs: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        mm_processor_flags(OmniRequest(prompt="hi", extra={"mm_processor_kwargs": kwargs}), ("b", "a"), "Fam")
    assert info.value.param == "mm_processor_kwargs"
