"""MiniMax-H3's presentation of a request to its text encoder: token ids, row tags, vision inputs.

What diffusers' `MiniMaxH3TextEncoderStep` / `MiniMaxH3FL2VATextEncoderStep` build before their one
conditioner call: the prompt verbatim (no chat template, no special tokens), preceded for fl2va by a
``"<Picture i>: "`` label and a vision block (``<|vision_start|>``, ``<|image_pad|>`` x n,
``<|vision_end|>``) per keyframe; the rows of a vision block are tagged video, the rest text. It runs
where the request is parsed (the input processor: tokenizer and image processor only, no weights),
so the ``encoder`` stage receives token ids and runs only the model.

The keyframes are put onto the canvas by the library's own `MiniMaxH3ResizeStep` (the first is
stretched, a second cover-cropped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs


@attrs.frozen
class Presentation:
    """A request's encoder input and what the dit needs of it."""

    token_ids: list[int]
    token_tags: list[int]
    vision: dict[str, Any] | None  # pixel_values / image_grid_thw of the keyframes, for the encoder
    keyframes: list[Any]  # PIL images on the canvas, in packed order
    keyframe_anchors: tuple[str, ...]


class Presenter:
    """Builds `Presentation`s; loads the tokenizer, the image processor and the pipeline's facts."""

    def __init__(self, model_path: str | Path) -> None:
        from omni_minimax_h3.loading import LOAD_LOCK

        root = Path(model_path)
        with LOAD_LOCK:  # diffusers' lazy imports and from_pretrained are not thread-safe (`loading`)
            from diffusers import ModularPipeline
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
            self.image_processor = load_image_processor(root / "processor")
            facts = ModularPipeline.from_pretrained(str(root))
            self._resize = _resize_pipeline(root)
            self._setup = _setup_pipeline(root)
            self._limits = self._setup.blocks.sub_blocks["ref2va"]
        self.text_tag, self.video_tag = int(facts.text_tag), int(facts.video_tag)

    def present(
        self, prompt: str, size: tuple[int, int], image: Any = None, last_image: Any = None,
        references: list[Any] | None = None, num_frames: int | None = None,
    ) -> Presentation:
        """`size` (width, height): the canvas, already resolved (`requests.parse_request`); `references`:
        diffusers' `MiniMaxH3ImageReference` / `MiniMaxH3AudioReference` (ref2va)."""
        if references:
            return self._present_references(prompt, size, references, num_frames)
        tokenizer = self.tokenizer
        keyframes: list[Any] = []
        anchors: tuple[str, ...] = ()
        if image is not None or last_image is not None:
            out = self._resize(image=image, last_image=last_image, height=size[1], width=size[0], output=["keyframes", "keyframe_anchors"])
            keyframes, anchors = list(out["keyframes"]), tuple(out["keyframe_anchors"])
        token_ids: list[int] = []
        token_tags: list[int] = []
        vision = None
        if keyframes:
            processed = self.image_processor(images=keyframes, return_tensors="pt")
            grid = processed["image_grid_thw"]
            vision = {"pixel_values": processed["pixel_values"], "image_grid_thw": grid}
            merge = self.image_processor.merge_size**2
            for index in range(len(keyframes)):
                label = tokenizer(f"<Picture {index + 1}>: ", add_special_tokens=False)["input_ids"]
                block = (
                    [tokenizer.convert_tokens_to_ids("<|vision_start|>")]
                    + [tokenizer.convert_tokens_to_ids("<|image_pad|>")] * (int(grid[index].prod()) // merge)
                    + [tokenizer.convert_tokens_to_ids("<|vision_end|>")]
                )
                token_ids += label + block
                token_tags += [self.text_tag] * len(label) + [self.video_tag] * len(block)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        token_ids += prompt_ids
        token_tags += [self.text_tag] * len(prompt_ids)
        return Presentation(token_ids, token_tags, vision, keyframes, anchors)


    def _present_references(self, prompt: str, size: tuple[int, int], references: list[Any], num_frames: int | None) -> Presentation:
        """ref2va: the library's setup step (limits, image references onto their short edge), then its
        presentation: a label per reference in order, a vision block per image, the prompt."""
        from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

        from omni_core.errors import InvalidRequestError
        from omni_minimax_h3 import diffusers_private

        self._check_references(references)
        # A waveform never reaches the conditioner: its rate is left to the dit, which resamples it.
        shown = [MiniMaxH3AudioReference(audio=ref.audio) if ref.kind == "audio" else ref for ref in references]
        try:
            out = self._setup(references=shown, height=size[1], width=size[0], num_frames=num_frames, output=["normalized_references"])
        except ValueError as exc:
            raise InvalidRequestError(f"{exc}", param="references") from None
        normalized = list(out["normalized_references"])
        processors = _Processors(self.image_processor)
        vision, images, videos, stamps = diffusers_private.gather_vision_features(
            MiniMaxH3Ref2VATextEncoderStep(), processors, normalized, float(self._setup.fps)
        )
        token_ids, token_tags = diffusers_private.build_presentation(
            self.tokenizer, prompt, normalized, images, videos, stamps, text_tag=self.text_tag, video_tag=self.video_tag
        )
        return Presentation(list(token_ids), list(token_tags), vision or None, [], ())

    def _check_references(self, references: list[Any]) -> None:
        """The library setup step's rules on the references' counts, kinds and shapes, with its limits,
        checked before it runs: it logs every refusal as an error with a traceback, and a client's
        mistake is not the server's error."""
        from omni_core.errors import InvalidRequestError

        step = self._limits
        kinds = [ref.kind for ref in references]
        for kind, limit in (("image", step.max_images), ("video", step.max_videos), ("audio", step.max_audios)):
            if kinds.count(kind) > limit:
                raise InvalidRequestError(f"MiniMax-H3 accepts at most {limit} {kind} references, got {kinds.count(kind)}", param="references")
        if len(kinds) > step.max_references:
            raise InvalidRequestError(f"MiniMax-H3 accepts at most {step.max_references} references in total, got {len(kinds)}", param="references")
        if set(kinds) == {"audio"}:
            raise InvalidRequestError("an audio reference has to be paired with at least one image reference (it cannot be used on its own)", param="references")
        for index, ref in enumerate(references):
            if ref.kind == "image":
                width, height = ref.image.size
                if width > 4 * height or height > 4 * width:
                    raise InvalidRequestError(f"references[{index}]: a reference image must be within 1:4 and 4:1, got {width}x{height}", param="references")


@attrs.frozen
class _Processors:
    """The processors the library's ref2va presentation reads: images only (video references need torchvision)."""

    image_processor: Any
    video_processor: Any = None


def load_image_processor(directory: Path) -> Any:
    """The Qwen2-VL image processor of ``processor/``, its PIL implementation: the same arithmetic as
    the torchvision one, and it loads where torchvision is missing (vLLM's CPU build removes it)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(str(directory))


def _resize_pipeline(root: Path) -> Any:
    """The library's `MiniMaxH3ResizeStep` as a pipeline with the checkpoint's canvas configs."""
    from diffusers.modular_pipelines import SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep

    blocks = SequentialPipelineBlocks.from_blocks_dict({"keyframes": MiniMaxH3ResizeStep()})
    return blocks.init_pipeline(str(root))


def _setup_pipeline(root: Path) -> Any:
    """The library's `MiniMaxH3Ref2VASetupStep` as a pipeline with the checkpoint's configs."""
    from diffusers.modular_pipelines import SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    return SequentialPipelineBlocks.from_blocks_dict({"ref2va": MiniMaxH3Ref2VASetupStep()}).init_pipeline(str(root))


def mm_token_type_ids(token_ids: list[int], image_token_id: int, video_token_id: int) -> list[int]:
    """Qwen's own modality ids of a token sequence (0 text, 1 image, 2 video), as
    `ProcessorMixin.create_mm_token_type_ids` builds them from the processor's token ids."""
    return [1 if token == image_token_id else 2 if token == video_token_id else 0 for token in token_ids]
