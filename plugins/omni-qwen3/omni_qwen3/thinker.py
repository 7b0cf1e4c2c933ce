"""The Qwen3-Omni thinker stage: vLLM's own ``Qwen3OmniMoeThinkerForConditionalGeneration``.

The stage's model part (`ThinkerModel`) runs the thinker of a full
Qwen3-Omni checkpoint on vLLM (talker/code2wav tensors are skipped by vLLM's weight mapper) through
a registered subclass, `capture_class()`, that

- records two hidden states per token for the talker: ``thinker_embeds`` (the input embeddings
  after the audio/image embeddings are merged: transformers' ``hidden_states[0]``) and
  ``thinker_hidden`` (transformers' ``hidden_states[talker_config.accept_hidden_layer]``), through
  the bridge's multi-layer side channel (`omni_core.stages.vllm_bridge.HiddenStateCapture`). Only
  the prompt's rows leave the stage (in its first chunk): the talker's edge adapter reads a
  generated token's row, its input embedding, from the token table;
- takes image, audio and video input without torchvision: its multimodal processor builds the HF
  ``Qwen3OmniMoeProcessor`` from the PIL image processor and `omni_qwen3.video.QwenVideoProcessor`
  (transformers' video processors need torchvision); vLLM's own thinker then takes the
  ``pixel_values_videos`` / ``video_grid_thw`` / ``second_per_grid_ts`` that processor returns.

Nothing heavy is imported at module import: vLLM classes are built on first use in the worker.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any, Mapping

from omni_core.outputs import Payload, StageInput
from omni_core.parts import PartContext
from omni_core.stages.ar_model import ARDelta, ARModel

if TYPE_CHECKING:
    import torch

ARCHITECTURE = "OmniQwen3OmniThinker"
"""The vLLM architecture name the thinker's capture class is registered under."""

EMBEDS_KEY = "thinker_embeds"
HIDDEN_KEY = "thinker_hidden"
CAPTURE_KEY = "capture_hidden"
"""Key of the thinker's stage input saying whether this request needs the hidden states (audio out)."""


class ThinkerModel(ARModel):
    """Model part of the ``thinker`` stage (an `ARModel` for the thinker inside a full checkpoint).

    The captured layers come from the checkpoint when the engine starts (`engine_args`): layer 0
    and ``talker_config.accept_hidden_layer``; a thinker-only checkpoint (no talker) captures
    nothing. Requests whose input says ``capture_hidden: False`` (no audio wanted) get no rows.
    """

    # The capture class is registered by object (in this process), so vLLM must not look the
    # architecture up in the checkpoint's own config.
    hf_overrides = types.MappingProxyType({"architectures": [ARCHITECTURE]})

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        talker = _read_config(context.model_path).get("talker_config")
        self.capture_hidden_states = talker is not None
        if talker is not None:
            self.hidden_state_layers = {EMBEDS_KEY: 0, HIDDEN_KEY: int(talker["accept_hidden_layer"])}
        self._model_path: str | None = None

    def register(self) -> None:
        from omni_core.stages import vllm_bridge
        from omni_qwen3 import compat

        compat.install()  # before vLLM imports its qwen2_vl-based modules
        vllm_bridge.register_architectures({ARCHITECTURE: capture_class()})

    def engine_args(self) -> dict[str, Any]:
        args = super().engine_args()
        self._model_path = str(args["model"])
        return args

    def wants_hidden_states(self, stage_input: StageInput) -> bool:
        return bool(stage_input.data.get(CAPTURE_KEY, True))

    def make_prompt(self, stage_input: StageInput) -> dict[str, Any]:
        data = {k: v for k, v in stage_input.data.items() if k != CAPTURE_KEY}
        return super().make_prompt(StageInput(data=data, final=stage_input.final, params=stage_input.params))

    def prompt_info(self, stage_input: StageInput) -> Payload:
        """``image_grid_thw`` / ``video_grid_thw`` (+ ``video_second_per_grid``) /
        ``audio_feature_lengths`` of the prompt's media (and ``use_audio_in_video`` when set), in
        the first chunk: the talker's 3-D positions need them (only computed when the talker runs)."""
        media = stage_input.data.get("multi_modal_data") or {}
        if not media or not self.wants_hidden_states(stage_input) or not self.capture_hidden_states:
            return {}
        assert self._model_path is not None
        info = _media_sizes(self._model_path, media)
        if (stage_input.data.get("mm_processor_kwargs") or {}).get("use_audio_in_video"):
            info["use_audio_in_video"] = True
        return info

    def chunk_data(self, delta: ARDelta) -> Payload:
        data = super().chunk_data(delta)
        data.pop("hidden_states", None)  # the layer keys carry the same rows
        if delta.prompt_token_ids is None:
            # Only the first chunk's rows (the prompt's) leave the stage: the talker reads a
            # generated token's row (its input embedding) from the token table.
            data.pop(EMBEDS_KEY, None)
            data.pop(HIDDEN_KEY, None)
        return data


def _read_config(model_path: str) -> dict[str, Any]:
    from omni_core.config.modelref import read_hf_config

    return read_hf_config(model_path)


def _media_sizes(model_path: str, media: Mapping[str, Any]) -> Payload:
    """Image grids and audio feature lengths as the HF processor computes them (plain lists)."""
    out: Payload = {}
    images = media.get("image")
    if images:
        processor = _image_processor(model_path)
        grids = processor(images=list(images) if isinstance(images, (list, tuple)) else [images], return_tensors="pt")
        out["image_grid_thw"] = grids["image_grid_thw"].tolist()
    videos = media.get("video")
    if videos:
        from omni_qwen3.video import PROCESSOR_FPS, processor_video_kwargs

        video_processor = _video_processor(model_path)
        items = [videos] if hasattr(videos, "ndim") else list(videos)
        out["video_grid_thw"] = [list(video_processor.grid(*v.shape[:3], **processor_video_kwargs())) for v in items]
        # What Qwen3OmniMoeProcessor returns (transformers' generate passes it to the talker too).
        out["video_second_per_grid"] = [video_processor.temporal_patch_size / PROCESSOR_FPS] * len(items)
    audios = media.get("audio")
    if audios:
        from omni_qwen3.reference import AUDIO_SAMPLING_RATE

        extractor = _feature_extractor(model_path)
        arrays = [a[0] if isinstance(a, tuple) else a for a in (audios if isinstance(audios, (list, tuple)) else [audios])]
        features = extractor(
            arrays, sampling_rate=AUDIO_SAMPLING_RATE, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt"
        )
        out["audio_feature_lengths"] = features["attention_mask"].sum(-1).tolist()
    return out


@functools.cache
def _image_processor(model_path: str) -> Any:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_path)


@functools.cache
def _video_processor(model_path: str) -> Any:
    from omni_qwen3.video import QwenVideoProcessor

    return QwenVideoProcessor.from_pretrained(model_path)


@functools.cache
def _feature_extractor(model_path: str) -> Any:
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(model_path)


@functools.cache
def capture_class() -> type:
    """vLLM's thinker class with the hidden-state capture and the torchvision-free processor.

    Cached: vLLM's registry compares classes by identity.
    """
    from omni_qwen3 import compat

    compat.install()
    from vllm.model_executor.models import qwen3_omni_moe_thinker as vllm_thinker
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from omni_core.stages.vllm_bridge import HiddenStateCapture

    class TorchvisionFreeProcessingInfo(vllm_thinker.Qwen3OmniMoeThinkerProcessingInfo):
        """Builds the HF processor from its parts, with our video processor (HF's needs torchvision)."""

        def get_hf_processor(self, **kwargs: object) -> Any:
            return _omni_processor(str(self.ctx.model_config.model), self.ctx.tokenizer)

    class OmniQwen3OmniThinker(HiddenStateCapture, vllm_thinker.Qwen3OmniMoeThinkerForConditionalGeneration):
        """The thinker, recording per-token hidden states as transformers reports them.

        vLLM adds the deepstack visual features to the residual stream after decoder layers
        0..n-1 before its layer hook sees them; transformers' ``hidden_states[k]`` is the decoder
        layer's output before that addition. The capture removes the addition again, so the rows
        equal transformers' at image positions too.
        """

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            self._omni_deepstack = self._omni_snapshot_deepstack(kwargs.get("inputs_embeds"))
            try:
                return super().forward(*args, **kwargs)
            finally:
                self._omni_deepstack = None

        def _omni_snapshot_deepstack(self, inputs_embeds: torch.Tensor | None) -> list[torch.Tensor] | None:
            # The deepstack buffers belong to vLLM's thinker class, which this one extends (vLLM's
            # out-of-tree model extension point), not to its runner or forward context: read here,
            # not through the bridge. Read without fallbacks: were they renamed, skipping the
            # subtraction would silently give rows unlike transformers' at image positions.
            if inputs_embeds is None or not self.use_deepstack:
                return None
            if not self.deepstack_input_embeds_num_tokens:
                return None  # no image in this batch: the buffers are zeros
            n = inputs_embeds.shape[0]
            return [buffer[:n].clone() for buffer in self.deepstack_input_embeds]

        def omni_layer_states(self, layers: tuple[int | None, ...], states: list[torch.Tensor]) -> list[torch.Tensor]:
            deepstack = getattr(self, "_omni_deepstack", None)
            if not deepstack:
                return states
            fixed = []
            for layer, state in zip(layers, states):
                # Layer k (k >= 1) is the output of decoder layer k-1, which got deepstack level k-1.
                if layer is not None and 1 <= layer <= len(deepstack):
                    state = state - deepstack[layer - 1][: state.shape[0]].to(state.dtype)
                fixed.append(state)
            return fixed

    OmniQwen3OmniThinker.__module__ = __name__
    return MULTIMODAL_REGISTRY.register_processor(
        vllm_thinker.Qwen3OmniMoeThinkerMultiModalProcessor,
        info=TorchvisionFreeProcessingInfo,
        dummy_inputs=vllm_thinker.Qwen3OmniMoeThinkerDummyInputsBuilder,
    )(OmniQwen3OmniThinker)


@functools.cache
def _omni_processor(model_path: str, tokenizer: Any) -> Any:
    """``Qwen3OmniMoeProcessor`` for text, image, audio and video, built without torchvision."""
    from transformers import AutoImageProcessor, Qwen3OmniMoeProcessor, WhisperFeatureExtractor

    from omni_qwen3.video import QwenVideoProcessor

    class TorchvisionFreeProcessor(Qwen3OmniMoeProcessor):
        """The Qwen3-Omni processor with `QwenVideoProcessor` as its video processor."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and isinstance(argument, QwenVideoProcessor):
                return QwenVideoProcessor
            return super().check_argument_for_proper_class(argument_name, argument)

    image_processor = AutoImageProcessor.from_pretrained(model_path)
    hf_tokenizer = getattr(tokenizer, "transformers_tokenizer", tokenizer)
    return TorchvisionFreeProcessor(
        image_processor=image_processor,
        video_processor=QwenVideoProcessor.from_pretrained(model_path),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(model_path),
        tokenizer=hf_tokenizer,
        chat_template=getattr(hf_tokenizer, "chat_template", None),
    )
