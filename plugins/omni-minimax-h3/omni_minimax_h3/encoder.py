"""The ``encoder`` stage's model part: Qwen3-VL's hidden state at MiniMax-H3's layer, on transformers.

A ``generation`` stage (batched, non-AR): each request's presentation (token ids, built by the
input processor, `omni_minimax_h3.presentation`) is one chunk of "frames"; a step encodes the
requests that are ready in one forward of ``text_encoder.model`` (right-padded: the encoder is
causal, so a real token never sees padding) and emits ``prompt_embeds`` [T, text_dim], the state
after decoder layer ``MiniMaxH3ModularPipeline.text_encoder_layer`` (diffusers'
`get_qwen3vl_prompt_embeds`). Requests with keyframes carry their vision inputs in their stage
parameters and are encoded one by one (the vision tower packs its patches per call).

Why transformers and not vLLM: see the plugin's README ("The encoder stage"). In short, vLLM's
Qwen3-VL cannot be imported where vLLM's CPU build runs (its qwen2-vl/qwen3-vl modules import
torchvision, which that build removes), and a prefill-only encoder gains nothing from vLLM's KV
cache or decode scheduling. The layers after the conditioning one (but one) are not loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from omni_core.errors import InvalidRequestError, MissingDependencyError
from omni_core.stages.generation_model import DecodeBatch, GenerationModel
from omni_minimax_h3.loading import LOAD_LOCK
from omni_minimax_h3.presentation import mm_token_type_ids


class MiniMaxH3Encoder(GenerationModel):
    """Token ids [T] -> ``prompt_embeds`` [T, text_dim] (its own factory: ``MiniMaxH3Encoder(context)``)."""

    input_key = "token_ids"
    output_key = "prompt_embeds"
    chunk_size = 1 << 20  # a presentation is encoded whole: the encoder attends over all of it
    samples_per_frame = 1

    def load(self, device: str, dtype: str) -> None:
        with LOAD_LOCK:  # diffusers' lazy imports and from_pretrained are not thread-safe (`loading`)
            self._load(device, dtype)

    def _load(self, device: str, dtype: str) -> None:
        try:
            from diffusers import ModularPipeline
            from transformers import AutoConfig, Qwen3VLForConditionalGeneration
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise MissingDependencyError(f"MiniMax-H3 needs diffusers and transformers: pip install omni-minimax-h3 ({exc})") from None

        from omni_minimax_h3.native import diffusers_layout

        root = Path(diffusers_layout(self.context.model_path))  # a native partition: its diffusers layout
        self.device = torch.device(device)
        self.layer = int(ModularPipeline.from_pretrained(str(root)).text_encoder_layer)
        config = AutoConfig.from_pretrained(str(root / "text_encoder"))
        layers = int(config.text_config.num_hidden_layers)
        if layers <= self.layer:
            raise InvalidRequestError(
                f"MiniMax-H3 conditions on hidden_states[{self.layer}] of its text encoder, which has only {layers} layers"
            )
        # Only the layers up to the conditioning one, plus one: the state after the last layer of a
        # stack comes out normalized, the one before it does not. The rest (13 of the release's 64,
        # a fifth of its weights and compute) is never loaded.
        config.text_config.num_hidden_layers = self.layer + 1
        # On an accelerator the weights go straight there (device_map): no host copy of the ~50 GB encoder.
        placement = {"device_map": str(self.device)} if self.device.type != "cpu" else {}
        model = _without_layers(Qwen3VLForConditionalGeneration, range(self.layer + 1, layers)).from_pretrained(
            str(root / "text_encoder"), config=config, dtype=getattr(torch, dtype), **placement
        )
        self.model = model.to(self.device).eval()
        self.image_token_id = int(model.config.image_token_id)
        self.video_token_id = int(model.config.video_token_id)

    def to_frames(self, value: Any) -> torch.Tensor:
        ids = torch.as_tensor(value, dtype=torch.long) if not isinstance(value, torch.Tensor) else value.long()
        if ids.ndim != 1 or ids.numel() == 0:
            raise InvalidRequestError("token_ids must be a non-empty list of token ids", param="token_ids")
        if int(ids.max()) >= int(self.model.config.text_config.vocab_size) or int(ids.min()) < 0:
            raise InvalidRequestError("token_ids has ids outside the text encoder's vocabulary", param="token_ids")
        return ids.cpu()

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> Sequence[torch.Tensor] | torch.Tensor:
        plain = [i for i, item in enumerate(batch.items) if not item.params.get("vision")]
        outputs: list[torch.Tensor | None] = [None] * len(batch.items)
        if plain:
            encoded = self.encode([batch.items[i].frames for i in plain])
            for i, embeds in zip(plain, encoded):
                outputs[i] = embeds
        for i, item in enumerate(batch.items):
            if outputs[i] is None:
                outputs[i] = self.encode([item.frames], item.params["vision"])[0]
        return outputs  # type: ignore[return-value]

    def encode(self, sequences: list[torch.Tensor], vision: dict[str, Any] | None = None) -> list[torch.Tensor]:
        """Layer-`self.layer` hidden states of each token sequence, one right-padded forward."""
        lengths = [int(ids.shape[0]) for ids in sequences]
        width = max(lengths)
        input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
        types = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, : lengths[row]] = ids
            attention_mask[row, : lengths[row]] = 1
            types[row, : lengths[row]] = torch.tensor(mm_token_type_ids(ids.tolist(), self.image_token_id, self.video_token_id))
        kwargs: dict[str, Any] = {}
        for name, value in (vision or {}).items():
            kwargs[name] = value.to(self.device, self.model.dtype) if name.startswith("pixel_") else value.to(self.device)
        out = self.model.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            mm_token_type_ids=types.to(self.device),
            use_cache=False,
            output_hidden_states=True,
            **kwargs,
        )
        hidden = out.hidden_states[self.layer]
        return [hidden[row, : lengths[row]] for row in range(len(sequences))]

    def close(self) -> None:
        self.model = None


def _without_layers(cls: type, skipped: range) -> type:
    """`cls`, told through transformers' own `_keys_to_ignore_on_load_unexpected` that the weights of
    the `skipped` decoder layers are left out on purpose (otherwise its load report lists each one)."""
    if not skipped:
        return cls
    indexes = "|".join(str(index) for index in skipped)
    ignored = [*(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []), rf"language_model\.layers\.({indexes})\."]
    return type(f"{cls.__name__}UpToLayer{skipped.start - 1}", (cls,), {"_keys_to_ignore_on_load_unexpected": ignored})
