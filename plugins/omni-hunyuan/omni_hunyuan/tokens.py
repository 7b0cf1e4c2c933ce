"""The special tokens of HunyuanImage-3.0, with ids read from the checkpoint's tokenizer.

vLLM-Omni hard-codes these ids (FAMILIES.md 2.2); the tiny checkpoint has other ids than the release,
and so may a future release, so every id here comes from ``convert_tokens_to_ids``.
"""

from __future__ import annotations

from typing import Any

import attrs

NUM_BASE_RATIOS = 33  # <img_ratio_0..32> in the base release; Instruct adds 33..36
NUM_INSTRUCT_RATIOS = 37

NAMED_TOKENS = (
    "<boi>",
    "<eoi>",
    "<img>",
    "<cfg>",
    "<timestep>",
    "<guidance>",
    "<joint_img_sep>",
    "<pad>",
    "<answer>",
    "</answer>",
    "<recaption>",
    "</recaption>",
    "<think>",
    "</think>",
)
"""Tokens the prompt templates use, besides bos/eos and the size/ratio tokens."""


def size_token(base_size: int) -> str:
    return f"<img_size_{base_size}>"


def ratio_token(index: int) -> str:
    return f"<img_ratio_{index}>"


@attrs.frozen
class SpecialTokens:
    """Ids of the tokens the image and reasoning templates need, from one tokenizer."""

    bos: int
    eos: int
    boi: int
    eoi: int
    image: int
    joint_img_sep: int
    cfg: int
    timestep: int
    size: int
    ratios: tuple[int, ...]
    think: int
    end_think: int
    recaption: int
    end_recaption: int
    answer: int
    end_answer: int
    guidance: int | None = None  # the -Distil releases' step tokens (None: the tokenizer has none)
    timestep_r: int | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, image_base_size: int) -> SpecialTokens:
        """Look every token up; a missing one is an error naming it (never a silent unk id)."""

        def lookup(token: str) -> int:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer has no {token!r} token, which HunyuanImage-3.0 needs")
            return int(token_id)

        def optional(token: str) -> int | None:
            token_id = tokenizer.convert_tokens_to_ids(token)
            return None if token_id is None or token_id == tokenizer.unk_token_id else int(token_id)

        ratios = []
        for index in range(NUM_INSTRUCT_RATIOS):
            token_id = tokenizer.convert_tokens_to_ids(ratio_token(index))
            if token_id is None or token_id == tokenizer.unk_token_id:
                break
            ratios.append(int(token_id))
        if len(ratios) < NUM_BASE_RATIOS:
            raise ValueError(f"the tokenizer has {len(ratios)} <img_ratio_*> tokens; HunyuanImage-3.0 needs {NUM_BASE_RATIOS}")
        if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer needs a bos and an eos token")
        return cls(
            bos=int(tokenizer.bos_token_id),
            eos=int(tokenizer.eos_token_id),
            boi=lookup("<boi>"),
            eoi=lookup("<eoi>"),
            image=lookup("<img>"),
            joint_img_sep=lookup("<joint_img_sep>"),
            cfg=lookup("<cfg>"),
            timestep=lookup("<timestep>"),
            size=lookup(size_token(image_base_size)),
            ratios=tuple(ratios),
            think=lookup("<think>"),
            end_think=lookup("</think>"),
            recaption=lookup("<recaption>"),
            end_recaption=lookup("</recaption>"),
            answer=lookup("<answer>"),
            end_answer=lookup("</answer>"),
            guidance=optional("<guidance>"),
            timestep_r=optional("<timestep_r>"),
        )

    def step_tokens(self, config: Any) -> list[int]:
        """The tokens between an image's ratio token and its first ``<img>`` under `config`
        (`HunyuanConfig.step_tokens`): ``<timestep>`` [``<guidance>``] [``<timestep_r>``]."""
        ids = [self.timestep]
        for flag, token_id, name in ((config.cfg_distilled, self.guidance, "<guidance>"), (config.use_meanflow, self.timestep_r, "<timestep_r>")):
            if flag:
                if token_id is None:
                    raise ValueError(f"the checkpoint is distilled but its tokenizer has no {name!r} token")
                ids.append(token_id)
        return ids
