"""The ``ar`` stage's model part: HunyuanImage-3.0's text path on vLLM (`omni_hunyuan.vllm_model`).

Registers the out-of-tree model class through vLLM's public registry, points vLLM at a derived config
transformers can read (the release config's type is unknown to transformers and its ``auto_map`` names
remote code we never run), and builds the ``pretrain`` template's prompt, ``<bos> prompt``, with ids
from the checkpoint's tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import types
from pathlib import Path
from typing import Any

from omni_core.config.modelref import cache_dir
from omni_core.outputs import StageInput
from omni_core.stages.ar_model import ARModel

ARCHITECTURE = "OmniHunyuanImage3ForCausalLM"


class HunyuanAR(ARModel):
    """Text out from HunyuanImage-3.0 (``t2t``), greedy by default as the release generates text."""

    architectures = types.MappingProxyType({ARCHITECTURE: "omni_hunyuan.vllm_model:HunyuanImage3ForVLLM"})

    def engine_args(self) -> dict[str, Any]:
        from omni_hunyuan.vllm_model import vllm_config_dir

        path = Path(self.context.model_path)
        # One derived config per checkpoint (and per release config content): never another's.
        key = hashlib.sha256(str(path.resolve()).encode() + (path / "config.json").read_bytes()).hexdigest()[:16]
        config = vllm_config_dir(path, cache_dir() / "hunyuan-image3" / key)
        return {**super().engine_args(), "hf_config_path": str(config), "tokenizer": str(path)}

    def make_prompt(self, stage_input: StageInput) -> dict[str, Any]:
        data = stage_input.data
        if isinstance(data.get("prompt"), str) and data.get("prompt_token_ids") is None:
            ids = self.hf_tokenizer.encode(data["prompt"], add_special_tokens=False)
            return {"prompt_token_ids": [int(self.hf_tokenizer.bos_token_id), *ids]}
        return super().make_prompt(stage_input)

    @functools.cached_property
    def hf_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (bos id and the prompt's ids), loaded on first use."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.context.model_path)
