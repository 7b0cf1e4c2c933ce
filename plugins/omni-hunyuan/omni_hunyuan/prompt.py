"""Token rows of the release's text-to-image sequence (``sequence_template: pretrain``, ``bot_task: image``).

    cond:   <bos> prompt <boi> <img_size_{base}> <img_ratio_k> <timestep> <img>*(h*w) <eoi>
    uncond: <bos> <cfg>*len(prompt) <boi> <img_size_{base}> <img_ratio_k> <timestep> <img>*(h*w) <eoi>

Both rows have the same length and the image at the same index, so CFG is one batch of two rows.
Which ratio index names which size is the release's resolution group (`omni_hunyuan.resolution`).

Think/recaption-then-draw (``sequence_template: instruct``): the ``ar`` stage continues
``<bos>User: prompt\n\nAssistant: <think>`` (or ``<recaption>``) up to ``</think>``, then the ratio
step ``<answer><boi><img_size_B><img_ratio_k>``; the image rows start with that text up to
``</think><answer>``, as token ids (never decoded and re-encoded), with ratio k.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from omni_hunyuan.tokens import SpecialTokens


@attrs.frozen
class ImageRows:
    """The text prefixes (up to, not including, ``<timestep>``) and the whole rows, ``[rows, length]``."""

    prefix: torch.Tensor
    rows: torch.Tensor
    height: int  # latent tokens
    width: int


def t2i_rows(
    tokenizer: Any, tokens: SpecialTokens, prompt: str, ratio_index: int, height: int, width: int, cfg: bool
) -> ImageRows:
    """The cond row (and the uncond row when `cfg`) for an image of ``height x width`` latent tokens."""
    return image_rows(tokens, [tokens.bos, *tokenizer.encode(prompt, add_special_tokens=False)], ratio_index, height, width, cfg)


def instruct_prompt_ids(tokenizer: Any, tokens: SpecialTokens, prompt: str, bot_task: str) -> list[int]:
    """``<bos>User: prompt\n\nAssistant: <think>`` (`bot_task` ``think``) or ``... <recaption>``."""
    opener = {"think": tokens.think, "recaption": tokens.recaption}[bot_task]
    return [tokens.bos, *tokenizer.encode(f"User: {prompt}\n\nAssistant: ", add_special_tokens=False), opener]


def reasoned_text_ids(tokens: SpecialTokens, prompt_ids: list[int], generated: list[int]) -> tuple[list[int], int | None]:
    """The text before the image after think/recaption, and the ratio index the ``ar`` stage picked.

    The text: the ``ar`` stage's prompt, its reasoning up to the first ``</think>``/``</recaption>``
    (added if the reasoning ran out of tokens first), ``<answer>``. The ratio: the index of the
    ``<img_ratio_k>`` ending ``<answer><boi><img_size>`` after the closer (`omni_hunyuan.ratio_tail`),
    or None when the reasoning did not get there.
    """
    closers = (tokens.end_think, tokens.end_recaption)
    cut = next((i for i, t in enumerate(generated) if t in closers), None)
    if cut is None:
        closer = tokens.end_recaption if tokens.recaption in prompt_ids[-1:] else tokens.end_think
        return [*prompt_ids, *(t for t in generated if t != tokens.eos), closer, tokens.answer], None
    tail = generated[cut + 1 :]
    ratio = None
    if tail[:3] == [tokens.answer, tokens.boi, tokens.size] and len(tail) == 4 and tail[3] in tokens.ratios:
        ratio = tokens.ratios.index(tail[3])
    return [*prompt_ids, *generated[: cut + 1], tokens.answer], ratio


def image_rows(tokens: SpecialTokens, text_ids: list[int], ratio_index: int, height: int, width: int, cfg: bool) -> ImageRows:
    """Rows for an image after `text_ids` (starting with ``<bos>``); the uncond row replaces every
    text token after ``<bos>`` with ``<cfg>``."""
    if not 0 <= ratio_index < len(tokens.ratios):
        raise ValueError(f"ratio index {ratio_index} is outside 0..{len(tokens.ratios) - 1}")
    image_head = [tokens.boi, tokens.size, tokens.ratios[ratio_index]]
    prefixes = [[*text_ids, *image_head]]
    if cfg:
        prefixes.append([text_ids[0], *([tokens.cfg] * (len(text_ids) - 1)), *image_head])
    suffix = [tokens.timestep, *([tokens.image] * (height * width)), tokens.eoi]
    prefix = torch.tensor(prefixes, dtype=torch.long)
    rows = torch.tensor([p + suffix for p in prefixes], dtype=torch.long)
    return ImageRows(prefix=prefix, rows=rows, height=height, width=width)
