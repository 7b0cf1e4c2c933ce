"""The tiny checkpoint: release schema, release key layout, special tokens, family match."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omni_core.config.modelref import read_hf_config
from omni_core.plugins import default_plugins


def test_family_matches_release_configs(checkpoint: Path) -> None:
    family = default_plugins().families["hunyuan-image3"]
    config = read_hf_config(checkpoint)
    assert "HunyuanImage3ForCausalMM" in config["architectures"]
    assert set(family.model_types) == {"Hunyuan", "hunyuan_image_3_moe"}
    assert config["model_type"] in family.model_types


@pytest.mark.parametrize("config", [{"model_type": "Hunyuan"}, {"model_type": "hunyuan_image_3_moe"}, {"architectures": ["HunyuanImage3ForCausalMM"]}])
def test_base_and_later_release_configs_pick_the_family(config: dict[str, Any]) -> None:
    assert default_plugins().family_for("some/checkpoint", config).name == "hunyuan-image3"


def test_release_schema(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    for section in ("vae", "vit", "vit_processor", "vit_aligner"):
        assert isinstance(config[section], dict), section
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    for key in ("sequence_template", "flow_shift", "diff_infer_steps", "diff_guidance_scale", "bot_task"):
        assert key in generation, key


def test_release_key_layout(checkpoint: Path) -> None:
    from omni_hunyuan.config import HunyuanConfig
    from omni_hunyuan.weights import read_tensors

    config = HunyuanConfig.from_pretrained(checkpoint)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    layer = "model.layers.0."
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    tensors = read_tensors(checkpoint, (layer, "model.wte", "model.ln_f", "lm_head"))
    assert tensors[layer + "self_attn.qkv_proj.weight"].shape == ((config.num_heads + 2 * config.num_kv_heads) * config.head_dim, hidden)
    assert tensors[layer + "mlp.gate.wg.weight"].shape == (config.num_experts, hidden)
    assert tensors[layer + "mlp.experts.0.gate_and_up_proj.weight"].shape == (2 * inter, hidden)
    assert {"model.wte.weight", "model.ln_f.weight", "lm_head.weight"} <= set(tensors)
    for prefix in ("vae.encoder.down.0.block.0.", "vae.decoder.up.0.block.0.", "vae.decoder.mid.attn_1.", "vision_model.", "vision_aligner.", "patch_embed.", "final_layer.", "timestep_emb.", "time_embed.", "time_embed_2."):
        assert any(key.startswith(prefix) for key in index), prefix


def test_special_tokens_come_from_the_tokenizer(tokenizer: Any, tokens: Any) -> None:
    from omni_hunyuan.tokens import NUM_INSTRUCT_RATIOS

    assert tokens.image == tokenizer.convert_tokens_to_ids("<img>")
    assert len(tokens.ratios) == NUM_INSTRUCT_RATIOS
    ids = {tokens.bos, tokens.eos, tokens.boi, tokens.eoi, tokens.image, tokens.cfg, tokens.timestep, tokens.size, *tokens.ratios}
    assert len(ids) == 8 + NUM_INSTRUCT_RATIOS  # all distinct
    # Each special token is one token, never split by the BPE.
    assert tokenizer.encode("<think>x</think><img_ratio_36>", add_special_tokens=False)[0] == tokens.think
    listed = json.dumps(json.loads((Path(tokenizer.name_or_path) / "tokenizer_config.json").read_text()))
    for name in ("<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>", "<recaption>", "</think>", "<answer>", "<img_ratio_0>"):
        assert name in listed, name


def test_unknown_size_names_the_supported_ones(tmp_path: Path) -> None:
    from omni_hunyuan.tiny import make_tiny

    with pytest.raises(ValueError, match="tiny"):
        make_tiny(tmp_path, "huge")


def test_loader_is_strict(checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint missing a transformer tensor is refused by name, not half-loaded."""
    import shutil

    from omni_hunyuan.weights import load_transformer
    from safetensors.torch import load_file, save_file

    for item in checkpoint.iterdir():
        if item.name != "model-00001-of-00002.safetensors":
            (tmp_path / item.name).symlink_to(item)
    tensors = load_file(checkpoint / "model-00001-of-00002.safetensors")
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.experts.3.down_proj.weight"]
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="experts.3.down_proj"):
        load_transformer(tmp_path)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_an_instruct_checkpoint_thinks_then_draws_by_default(tmp_path) -> None:
    """vLLM-Omni's default for HunyuanImage-3.0 (AR text and DiT image, both final) on an Instruct
    checkpoint; a base checkpoint (no reasoning template) draws."""
    import json

    from omni_hunyuan.pipeline import build_pipeline

    assert build_pipeline(str(tmp_path), {}).default_modalities == ("image",)
    (tmp_path / "generation_config.json").write_text(json.dumps({"sequence_template": "instruct"}))
    assert build_pipeline(str(tmp_path), {}).default_modalities == ("text", "image")

    def drawing_after_text(pipeline: Any) -> str:  # the task text + image picks: the first that makes both
        return next(t.name for t in pipeline.tasks if set(t.modalities) == {"text", "image"})

    assert drawing_after_text(build_pipeline(str(tmp_path), {})) == "think_t2i"
    # The reasoning the checkpoint's bot_task names (the Instruct release's: think and recaption).
    for bot_task, task in (("think_recaption", "think_recaption_t2i"), ("recaption", "recaption_t2i"), ("image", "think_t2i")):
        (tmp_path / "generation_config.json").write_text(json.dumps({"sequence_template": "instruct", "bot_task": bot_task}))
        assert drawing_after_text(build_pipeline(str(tmp_path), {})) == task


def test_the_ar_stage_samples_as_the_checkpoints_generation_config_says(tmp_path) -> None:
    """The ar stage's default sampling parameters: greedy without ``do_sample`` (the tiny checkpoint's),
    else generation_config's values, transformers' defaults for those it leaves out (top-k 50)."""
    import json

    from omni_hunyuan.pipeline import build_pipeline

    def ar_params(config: dict) -> dict:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
        return dict(next(s for s in build_pipeline(str(tmp_path), {}).stages if s.name == "ar").params)

    assert ar_params({}) == ar_params({"do_sample": False, "temperature": 0.6}) == {"temperature": 0.0}
    sampled = {"do_sample": True, "temperature": 0.6, "top_k": 1024, "top_p": 0.95, "repetition_penalty": 1.0}
    assert ar_params(sampled) == {"temperature": 0.6, "top_k": 1024, "top_p": 0.95}
    assert ar_params({"do_sample": True, "repetition_penalty": 1.1}) == {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.1}


def test_the_ratio_step_forces_each_section_then_the_ratio() -> None:
    """think-and-recaption: ``</think>`` (generated, or forced at the budget), ``<recaption>`` forced,
    ``</recaption>``, then ``<answer><boi><img_size>`` and a ratio token; a reasoning is free until then."""
    from omni_hunyuan.ratio_tail import tail_allowed

    END_THINK, RECAPTION, END_RECAPTION, ANSWER, BOI, SIZE = 2, 3, 4, 5, 6, 7
    tail = {"closers": [END_THINK, END_RECAPTION], "openers": [RECAPTION], "budget": 6, "forced": [ANSWER, BOI, SIZE], "ratios": [10, 11]}
    assert tail_allowed(tail, []) is None and tail_allowed(tail, [20, 21]) is None
    assert tail_allowed(tail, [20, END_THINK]) == [RECAPTION]
    assert tail_allowed(tail, [20, END_THINK, RECAPTION]) is None and tail_allowed(tail, [20, END_THINK, RECAPTION, 30]) is None
    assert tail_allowed(tail, [20, 21, 22, 23, 24, 25]) == [END_THINK]  # the budget: the open section closed
    assert tail_allowed(tail, [20, END_THINK, RECAPTION, 30, 31, 32]) == [END_RECAPTION]
    done = [20, END_THINK, RECAPTION, 30, END_RECAPTION]
    assert [tail_allowed(tail, done + [ANSWER, BOI, SIZE][:k]) for k in range(4)] == [[ANSWER], [BOI], [SIZE], [10, 11]]
    # a closer of a later section inside an earlier one is reasoning, not its end
    assert tail_allowed(tail, [20, END_RECAPTION]) is None
    single = {"closers": [END_THINK], "budget": 4, "forced": [ANSWER, BOI, SIZE], "ratios": [10]}
    assert tail_allowed(single, [20, END_THINK]) == [ANSWER] and tail_allowed(single, [20, 21, 22, 23]) == [END_THINK]


def test_the_ratio_step_takes_the_first_ranked_ratio_even_when_sampling() -> None:
    """`limit_logits` (the vLLM logits processor's per-request function): no ratio token while reasoning,
    a forced token alone, and at the ratio step one finite logit, the allowed ratio ranked first (the
    release's force_greedy), so a temperature cannot pick another."""
    import torch

    from omni_hunyuan.ratio_tail import limit_logits

    END_THINK, ANSWER, BOI, SIZE = 2, 5, 6, 7
    tail = {"closers": [END_THINK], "budget": 8, "forced": [ANSWER, BOI, SIZE], "ratios": [10, 11, 12]}
    ratios = torch.tensor(tail["ratios"])
    logits = torch.arange(16, dtype=torch.float32)  # token 15 ranks first overall, 12 among the ratios
    reasoning = limit_logits(tail, ratios, [20], logits.clone())
    assert torch.isinf(reasoning[[10, 11, 12]]).all() and torch.equal(reasoning[:10], logits[:10])
    forced = limit_logits(tail, ratios, [20, END_THINK], logits.clone())
    assert torch.isfinite(forced).nonzero().flatten().tolist() == [ANSWER]
    logits[11] = 100.0
    ratio = limit_logits(tail, ratios, [20, END_THINK, ANSWER, BOI, SIZE], logits.clone())
    assert torch.isfinite(ratio).nonzero().flatten().tolist() == [11] and ratio[11] == 100.0


def test_drop_think_keeps_the_recaption_only() -> None:
    """`reasoned_text` under drop_think: the think section and its tags leave the image pass's text
    (the ar prompt's trailing ``<think>`` with them); a recaption after it stays; think alone leaves none."""
    from omni_hunyuan.prompt import Text, reasoned_text
    from omni_hunyuan.tokens import SpecialTokens

    tokens = SpecialTokens(
        bos=1, eos=2, boi=3, eoi=4, image=5, joint_img_sep=6, cfg=7, timestep=8, size=9, ratios=(10, 11), think=12,
        end_think=13, recaption=14, end_recaption=15, answer=16, end_answer=17,
    )
    prompt = Text.of([1, 40, 41, 12])  # <bos> ... "Assistant: " <think>
    both = [50, 51, 13, 14, 60, 15, 16, 3, 9, 11]
    text, ratio = reasoned_text(tokens, prompt, both, drop_think=True)
    assert (text.ids, ratio) == ([1, 40, 41, 14, 60, 15, 16], 1) and text.blank == [False] * 4 + [True, False, False]
    assert reasoned_text(tokens, prompt, both)[0].ids == [1, 40, 41, 12, 50, 51, 13, 14, 60, 15, 16]
    assert reasoned_text(tokens, prompt, [50, 13, 16, 3, 9, 10], drop_think=True)[0].ids == [1, 40, 41, 16]
    # cut short inside the think section: closed, then dropped
    assert reasoned_text(tokens, prompt, [50, 51], drop_think=True)[0].ids == [1, 40, 41, 16]
