"""Omni hook implementations of the Qwen3-Omni plugin (fast: no torch import, no I/O)."""

from __future__ import annotations

from typing import Callable

from omni_core import hookimpl
from omni_core.families import PipelineFamily

FAMILY = PipelineFamily(
    name="qwen3-omni",
    pipeline="omni_qwen3.pipeline:build_pipeline",
    architectures=("Qwen3OmniMoeForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration"),
    model_types=("qwen3_omni_moe",),
    make_tiny="omni_qwen3.tiny:make_tiny",
    # 2: thinker_config has audio_end_token_id / vision_end_token_id (use_audio_in_video);
    # 3: the talker ends its speech on its own (codec EOS after 45-49 frames, omni_qwen3.tiny.SPEECH_FRAMES).
    tiny_format=3,
    description="Qwen3-Omni (thinker -> talker -> code2wav): text, audio and image in; text and speech out",
)


@hookimpl
def register_pipelines(register: Callable[[PipelineFamily], None]) -> None:
    register(FAMILY)
