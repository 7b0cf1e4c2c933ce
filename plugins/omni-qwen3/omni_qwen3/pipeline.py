"""The Qwen3-Omni pipeline: ``thinker`` (vLLM) -> ``talker`` (vLLM + code predictor) -> ``code2wav``.

- ``thinker``: text (and the talker's hidden states) from text, audio and image input.
- ``talker``: codec frames (``codes`` ``[n_frames, num_code_groups]``) from the thinker's hidden
  states, through the ``omni_qwen3.edges:ThinkerToTalker`` adapter; internal (no user output).
- ``code2wav``: 24 kHz audio from the frames (final).

A thinker-only checkpoint (``Qwen3OmniMoeThinkerForConditionalGeneration``) gives the thinker alone,
text out. Nothing heavy is imported here: stages name their model parts by lazy reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_core.config.pipeline import EdgeSpec, PipelineConfig, StageSpec
from omni_core.errors import ConfigError
from omni_core.parts import InternalKeysOutput
from omni_qwen3.thinker import EMBEDS_KEY, HIDDEN_KEY

FAMILY = "qwen3-omni"
THINKER_ONLY_ARCHITECTURE = "Qwen3OmniMoeThinkerForConditionalGeneration"
INPUT_PROCESSOR = "omni_qwen3.inputs:Qwen3OmniInputProcessor"
DEFAULT_DEPLOY = "omni_qwen3:deploy/default.yaml"
THINKER_DEPLOY = "omni_qwen3:deploy/thinker.yaml"
# Default lengths (a request's max_tokens overrides them): the thinker's answer, and the talker's
# codec frames (12.5 a second) as transformers' generate(talker_max_new_tokens=4096); the talker
# normally stops at its codec EOS well before.
THINKER_MAX_TOKENS = 256
TALKER_MAX_TOKENS = 4096
# What a request naming no modalities gets: as vLLM-Omni, whose stage config for Qwen3-Omni
# (vllm_omni/model_executor/stage_configs/qwen3_omni_moe.yaml) marks the thinker (text) and code2wav
# (audio) as final outputs and returns every final output by default.
DEFAULT_MODALITIES = ("text", "audio")


def build_pipeline(model_path: str, hf_config: dict[str, Any]) -> PipelineConfig:
    """The pipeline for the Qwen3-Omni checkpoint at `model_path` (its ``config.json`` is `hf_config`)."""
    thinker_only = THINKER_ONLY_ARCHITECTURE in (hf_config.get("architectures") or ()) or not hf_config.get(
        "talker_config"
    )
    thinker = StageSpec(
        name="thinker",
        kind="ar",
        model="omni_qwen3.thinker:ThinkerModel",
        output="text",
        final=thinker_only,
        params={"max_tokens": THINKER_MAX_TOKENS, "stop_token_ids": [_im_end_id(model_path, hf_config)]},
        output_adapter="omni_qwen3.pipeline:ThinkerOutput",
    )
    if thinker_only:
        return PipelineConfig(
            family=FAMILY,
            stages=(thinker,),
            input_processor=INPUT_PROCESSOR,
            default_deploy=THINKER_DEPLOY,
            default_modalities=("text",),
        )
    talker_config = hf_config["talker_config"]
    talker = StageSpec(
        name="talker",
        kind="ar",
        model="omni_qwen3.talker:TalkerModel",
        inputs=(EdgeSpec("thinker", adapter="omni_qwen3.edges:ThinkerToTalker"),),
        output=None,
        # transformers' `generate` samples the talker with temperature 0.9 and top_k 50 by default. Its
        # repetition penalty (1.05) is left out: vLLM would apply it to the prompt's placeholder ids too.
        params={
            "max_tokens": TALKER_MAX_TOKENS,
            "stop_token_ids": [int(talker_config["codec_eos_token_id"])],
            "temperature": 0.9,
            "top_k": 50,
        },
    )
    code2wav = StageSpec(
        name="code2wav",
        kind="generation",
        model="omni_qwen3.code2wav:Code2WavModel",
        inputs=(EdgeSpec("talker"),),
        output="audio",
        final=True,
    )
    return PipelineConfig(
        family=FAMILY,
        stages=(thinker, talker, code2wav),
        input_processor=INPUT_PROCESSOR,
        default_deploy=DEFAULT_DEPLOY,
        default_modalities=DEFAULT_MODALITIES,
    )


def _im_end_id(model_path: str, hf_config: dict[str, Any]) -> int:
    """The thinker's end-of-turn id: the config's ``im_end_token_id``, else the tokenizer's."""
    if hf_config.get("im_end_token_id") is not None:
        return int(hf_config["im_end_token_id"])
    tokenizer_file = Path(model_path) / "tokenizer.json"
    try:
        added = json.loads(tokenizer_file.read_text(encoding="utf-8")).get("added_tokens", [])
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot find <|im_end|>: no im_end_token_id in config.json and {tokenizer_file}: {exc}") from exc
    for token in added:
        if token.get("content") == "<|im_end|>":
            return int(token["id"])
    raise ConfigError(f"{tokenizer_file} has no <|im_end|> token and config.json no im_end_token_id", key="im_end_token_id")


class ThinkerOutput(InternalKeysOutput):
    """The thinker's chunks as the user gets them: without the hidden-state rows meant for the talker."""

    internal = frozenset({EMBEDS_KEY, HIDDEN_KEY})
