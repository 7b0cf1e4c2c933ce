"""The toy families' pipelines and the edge adapter between the LM and the vocoder.

``toy``: stage ``lm`` (kind ``ar``: the tiny Qwen3 in ``lm/`` on vLLM, text out) -> edge adapter
(token ids, or hidden states when the LM captures them, become vocoder frames) -> stage ``vocoder``
(kind ``generation``: `omni_toy.vocoder.ToyVocoder`, audio out, final).

``toy-passthrough``: one ``generation`` stage ``echo`` that copies its input frames to audio.

Nothing heavy is imported here at module level: the engine imports this module to build the
pipeline; torch is imported by the adapter when the first chunk arrives.
"""

from __future__ import annotations

from typing import Any

from omni_core.config.pipeline import EdgeSpec, PipelineConfig, StageSpec
from omni_core.outputs import Chunk, StageInput
from omni_core.parts import EdgeAdapter
from omni_core.stages.ar_model import ARModel

LM_SUBFOLDER = "lm"
DEFAULT_DEPLOY = "omni_toy:deploy/default.yaml"
PASSTHROUGH_DEPLOY = "omni_toy:deploy/passthrough.yaml"


def build_toy_pipeline(model_path: str, hf_config: dict[str, Any]) -> PipelineConfig:
    """The ``toy`` family's pipeline for a checkpoint written by `omni_toy.tiny.make_tiny`.

    Token ids feed the vocoder unless the root ``config.json`` sets ``"lm_hidden_states": true``.
    """
    lm_model = "LMWithHiddenStates" if hf_config.get("lm_hidden_states") else "LM"
    return PipelineConfig(
        family="toy",
        stages=(
            StageSpec(
                name="lm",
                kind="ar",
                model=f"omni_toy.pipeline:{lm_model}",
                output="text",
                params={"max_tokens": 16, "temperature": 0.0},
            ),
            StageSpec(
                name="vocoder",
                kind="generation",
                model="omni_toy.vocoder:ToyVocoder",
                inputs=(EdgeSpec(source="lm", adapter="omni_toy.pipeline:TokensToCodes"),),
                output="audio",
                final=True,
            ),
        ),
        default_deploy=DEFAULT_DEPLOY,
        default_modalities=("text", "audio"),
    )


def build_passthrough_pipeline(model_path: str, hf_config: dict[str, Any]) -> PipelineConfig:
    """The ``toy-passthrough`` family: one stage, input frames copied to audio (no vLLM)."""
    return PipelineConfig(
        family="toy-passthrough",
        stages=(
            StageSpec(
                name="echo",
                kind="generation",
                model="omni_toy.passthrough:PassThroughModel",
                output="audio",
                final=True,
            ),
        ),
        input_processor="omni_toy.passthrough:PromptBytesProcessor",
        default_deploy=PASSTHROUGH_DEPLOY,
        default_modalities=("audio",),
    )


class LM(ARModel):
    """The ``lm`` stage's model part: vLLM over the checkpoint's ``lm/`` folder."""

    subfolder = LM_SUBFOLDER


class LMWithHiddenStates(LM):
    """The same LM, also capturing per-token final hidden states (checkpoint config
    ``"lm_hidden_states": true``): the vocoder then decodes hidden states instead of token ids."""

    capture_hidden_states = True
    capture_base = "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"


class TokensToCodes(EdgeAdapter):
    """Edge adapter ``lm -> vocoder``: each LM chunk's new tokens become vocoder frames.

    Frames are the token ids (``codes``, LongTensor ``[n]``), or, when the LM stage captures them,
    its hidden-state rows (float ``[n_rows, hidden]``: prompt and generated tokens as they pass
    through the model); the vocoder takes both.
    """

    def on_chunk(self, state: dict[str, Any], chunk: Chunk) -> StageInput | None:
        import torch

        hidden = chunk.data.get("hidden_states")
        if hidden is not None:
            frames = torch.as_tensor(hidden)
        else:
            frames = torch.as_tensor(list(chunk.data.get("token_ids") or ()), dtype=torch.long)
        if frames.shape[0] == 0 and not chunk.final:
            return None  # nothing new yet
        return StageInput(data={"codes": frames}, final=chunk.final)
