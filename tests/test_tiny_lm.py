"""`omni_core.testing.tiny_lm`: tiny random causal LMs that transformers and vLLM load alike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omni_core.testing.tiny_lm import ARCHITECTURES, tiny_lm

import torch
import transformers

PROMPT = [{"role": "user", "content": "Once upon a time there was a little robot"}]


def greedy_transformers(path: Path, prompt_ids: list[int], tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def prompt_ids(path: Path) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return list(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_transformers_loads_it_and_greedy_output_varies(tmp_path: Path, arch: str) -> None:
    lm = tiny_lm(tmp_path, arch)
    written = {p.name for p in tmp_path.iterdir()}
    assert written >= {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"}
    assert lm.config["architectures"] == [arch] and lm.vocab_size % 64 == 0
    ids = prompt_ids(tmp_path)
    assert ids[0] == transformers.AutoTokenizer.from_pretrained(tmp_path).convert_tokens_to_ids("<|im_start|>")
    tokens = greedy_transformers(tmp_path, ids, 12)
    assert len(set(tokens)) >= 4, f"greedy output collapsed: {tokens}"


def test_same_seed_same_files_another_seed_other_weights(tmp_path: Path) -> None:
    tiny_lm(tmp_path / "a", seed=3)
    tiny_lm(tmp_path / "b", seed=3)
    tiny_lm(tmp_path / "c", seed=4)
    for file in (tmp_path / "a").iterdir():
        assert file.read_bytes() == (tmp_path / "b" / file.name).read_bytes(), file.name
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_sizes_and_extra_config_fields(tmp_path: Path) -> None:
    lm = tiny_lm(tmp_path, "LlamaForCausalLM", hidden_size=128, num_layers=3, head_dim=64, config={"rms_norm_eps": 1e-5})
    assert (lm.hidden_size, lm.config["num_hidden_layers"], lm.config["head_dim"]) == (128, 3, 64)
    assert lm.config["rms_norm_eps"] == 1e-5 and lm.eos_token_id == lm.config["eos_token_id"]


def test_what_it_cannot_write_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Qwen3ForCausalLM, LlamaForCausalLM"):
        tiny_lm(tmp_path, "GPT2LMHeadModel")
    # vLLM's Qwen2 derives the head dim from the hidden size: the heads must multiply out to it.
    with pytest.raises(ValueError, match="hidden_size"):
        tiny_lm(tmp_path, "Qwen2ForCausalLM", num_attention_heads=4)
    assert not (tmp_path / "config.json").exists()


def test_the_testing_package_imports_nothing_heavy() -> None:
    code = (
        "import sys, omni_core.testing, omni_core.testing.tiny_lm, omni_core.testing.tokenizer, "
        "omni_core.testing.family_contract, omni_core.testing.connector_contract, omni_core.testing.live_server; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers', 'vllm', 'diffusers') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_vllm_greedy_equals_transformers(tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3 runs on vLLM in the toy family's tests; the other architectures here."""
    import vllm

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # an in-process engine: starts in seconds
    tiny_lm(tmp_path, arch)
    ids = prompt_ids(tmp_path)
    expected = greedy_transformers(tmp_path, ids, 12)
    llm = vllm.LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20, enforce_eager=True)
    try:
        params = vllm.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        (output,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    finally:
        del llm
    assert list(output.outputs[0].token_ids) == expected
