"""The ``ar`` stage's model part: HunyuanImage-3.0's text path on vLLM (`omni_hunyuan.vllm_model`).

Registers the out-of-tree model class through vLLM's public registry, points vLLM at a derived config
transformers can read (the release config's type is unknown to transformers and its ``auto_map`` names
remote code we never run), and builds the prompt with ids from the checkpoint's tokenizer: the
``pretrain`` template's ``<bos> prompt`` (``t2t``), or for think/recaption-then-draw (input
``bot_task``) the ``instruct`` template's ``<bos>User: prompt\n\nAssistant: <think>``.

For think/recaption-then-draw the input processor sets `PREFIX_KV_PARAM`: the request's keys and
values (`omni_hunyuan.vllm_model`) come with its chunks as ``prefix_kv`` rows, one per computed token,
for the ``dit`` stage to start its prefix from (``reuse_prefix_kv``).
"""

from __future__ import annotations

import functools
import hashlib
import types
from pathlib import Path
from typing import Any

from omni_core.config.modelref import cache_dir
from omni_core.outputs import StageInput
from omni_core.stages.ar_model import ARDelta, ARModel

ARCHITECTURE = "OmniHunyuanImage3ForCausalLM"
PREFIX_KV_PARAM = "prefix_kv"
"""The ``ar`` stage's parameter (set by the input processor, never by users) asking for the request's keys/values."""
KV_EXPORT_ARG = "omni_hunyuan_prefix_kv"
"""The same, in `SamplingParams.extra_args`, where the vLLM model class reads it."""


class HunyuanAR(ARModel):
    """Text out from HunyuanImage-3.0 (``t2t``, and the reasoning of think/recaption-then-draw), sampled as
    the checkpoint's generation_config says by default (`omni_hunyuan.config.text_sampling_defaults`: greedy
    unless ``do_sample``), as the release's transformers ``generate`` samples."""

    architectures = types.MappingProxyType({ARCHITECTURE: "omni_hunyuan.vllm_model:HunyuanImage3ForVLLM"})
    # The ratio step of think/recaption-then-draw, on vLLM's logits-processor extension point.
    engine_overrides = types.MappingProxyType({"logits_processors": ["omni_hunyuan.ratio_tail:RatioTail"]})
    # The side channel that carries the keys/values the dit stage reuses (rows only for those requests).
    capture_hidden_states = True
    # The model class keeps the release's plain torch modules (shared with the dit as they are): vLLM's
    # quantization config would not reach them, so resolve() refuses the ar stage's `quantization`.
    load_options: frozenset[str] = frozenset()

    def wants_hidden_states(self, stage_input: StageInput) -> bool:
        return bool(stage_input.params.get(PREFIX_KV_PARAM))

    def chunk_data(self, delta: ARDelta) -> dict[str, Any]:
        data = super().chunk_data(delta)
        rows = data.pop("hidden_states", None)
        if rows is not None:
            data[PREFIX_KV_PARAM] = rows
        return data

    def engine_args(self) -> dict[str, Any]:
        from omni_hunyuan.vllm_model import vllm_config_dir

        path = Path(self.context.model_path)
        # One derived config per checkpoint (and per release config content): never another's.
        key = hashlib.sha256(str(path.resolve()).encode() + (path / "config.json").read_bytes()).hexdigest()[:16]
        config = vllm_config_dir(path, cache_dir() / "hunyuan-image3" / key)
        from omni_hunyuan.pipeline import MAX_IMAGES

        # An image block attends both ways, which our model computes within one forward
        # (`omni_hunyuan.vllm_model`): a prompt must never be split across steps, by chunked prefill
        # or by a prefix-cache hit, as vLLM-Omni's AR stage runs too.
        return {
            **super().engine_args(), "hf_config_path": str(config), "tokenizer": str(config),  # (its tokenizer files: linked)
            "enable_prefix_caching": False, "enable_chunked_prefill": False, "limit_mm_per_prompt": {"image": MAX_IMAGES},
        }

    def make_prompt(self, stage_input: StageInput) -> dict[str, Any]:
        data = stage_input.data
        images = list(data.get("images") or ())
        # (images: their processor's kwargs, `pipeline.ALIGN_PARAM`, as vLLM takes them)
        media = {"multi_modal_data": {"image": images}, **({"mm_processor_kwargs": dict(data["mm_processor_kwargs"])} if data.get("mm_processor_kwargs") else {})}
        if isinstance(data.get("prompt"), str) and data.get("bot_task") is not None:
            from omni_hunyuan.prompt import instruct_prompt_ids

            ids = instruct_prompt_ids(self.hf_tokenizer, self.special_tokens, data["prompt"], data["bot_task"], data.get("system"), len(images))
            return {"prompt_token_ids": ids, **(media if images else {})}
        if images:
            from omni_hunyuan.understanding import i2t_prompt_ids

            ids = i2t_prompt_ids(self.hf_tokenizer, self.special_tokens, data["prompt"], len(images), data.get("system"))
            return {"prompt_token_ids": ids, **media}
        if isinstance(data.get("prompt"), str) and data.get("prompt_token_ids") is None:
            ids = self.hf_tokenizer.encode(data["prompt"], add_special_tokens=False)
            return {"prompt_token_ids": [int(self.hf_tokenizer.bos_token_id), *ids]}
        return super().make_prompt(stage_input)

    def sampling_params(self, params: dict[str, Any], *, delta: bool = True) -> Any:
        """vLLM's parameters, plus the ratio step's settings (the input processor's ``ratio_tail``,
        `omni_hunyuan.ratio_tail`) in ``extra_args`` where the logits processor reads them."""
        from omni_hunyuan.ratio_tail import TAIL_ARG
        from omni_hunyuan.resolution import RATIO_TAIL_PARAM

        tail = params.get(RATIO_TAIL_PARAM)
        export = bool(params.get(PREFIX_KV_PARAM))
        sampling = super().sampling_params({k: v for k, v in params.items() if k not in (RATIO_TAIL_PARAM, PREFIX_KV_PARAM)}, delta=delta)
        extra = {**({TAIL_ARG: tail} if tail is not None else {}), **({KV_EXPORT_ARG: True} if export else {})}
        if extra:
            sampling.extra_args = {**(sampling.extra_args or {}), **extra}
        return sampling

    @functools.cached_property
    def hf_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (bos id and the prompt's ids), loaded on first use."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.context.model_path)

    @functools.cached_property
    def special_tokens(self) -> Any:
        from omni_hunyuan.config import HunyuanConfig
        from omni_hunyuan.tokens import SpecialTokens

        base = HunyuanConfig.from_pretrained(self.context.model_path).image_base_size
        return SpecialTokens.from_tokenizer(self.hf_tokenizer, base)
