"""The text path against transformers' `HunYuanMoEV1ForCausalLM` on the same weights, remapped
(de-interleaved qkv, swapped expert halves, renamed embeddings and norm): FAMILIES.md 2.4/2.5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

PROMPTS = ("A cat sleeps on a sofa", "Draw a lighthouse at night", "Hello world! How are you today?")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    from omni_hunyuan.reference import hunyuan_v1_model

    return hunyuan_v1_model(checkpoint)


def _prompt(tokenizer: Any, tokens: Any, text: str) -> torch.Tensor:
    return torch.tensor([[tokens.bos, *tokenizer.encode(text, add_special_tokens=False)]])


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_tokens_equal_transformers(model: Any, reference: Any, tokenizer: Any, tokens: Any, text: str) -> None:
    ids = _prompt(tokenizer, tokens, text)
    ours = model.greedy(ids, max_new_tokens=20)
    theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, eos_token_id=None)
    theirs = theirs[0, ids.shape[1] :].tolist()
    assert ours == theirs
    assert len(set(ours)) > 3, "random weights collapsed to one repeated token: the comparison would be empty"


def test_logits_equal_transformers(model: Any, reference: Any, tokenizer: Any, tokens: Any) -> None:
    ids = _prompt(tokenizer, tokens, PROMPTS[0] + " <think>and</think>")
    with torch.no_grad():
        ours, _ = model.text_forward(ids)
        theirs = reference(ids).logits
    torch.testing.assert_close(ours, theirs.float(), atol=1e-5, rtol=1e-5)


def test_cached_decode_equals_full_recompute(model: Any, tokenizer: Any, tokens: Any) -> None:
    """The KV cache the image path reuses gives the logits a full forward gives."""
    ids = _prompt(tokenizer, tokens, PROMPTS[1])
    with torch.no_grad():
        full, _ = model.text_forward(ids)
        head, cache = model.text_forward(ids[:, :-3])
        tail, _ = model.text_forward(ids[:, -3:], cache)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), full, atol=1e-5, rtol=1e-5)


def test_bf16_keeps_the_router_fp32(checkpoint: Path) -> None:
    from omni_hunyuan.weights import load_transformer

    bf16 = load_transformer(checkpoint, dtype=torch.bfloat16)
    layer = bf16.model.layers[0]
    assert layer.mlp.gate.wg.weight.dtype == torch.float32
    assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
