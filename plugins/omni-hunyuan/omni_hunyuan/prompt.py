"""Token rows of the release's text-to-image sequence (``sequence_template: pretrain``, ``bot_task: image``).

    cond:   <bos> prompt <boi> <img_size_{base}> <img_ratio_k> <timestep> <img>*(h*w) <eoi>
    uncond: <bos> <cfg>*len(prompt) <boi> <img_size_{base}> <img_ratio_k> <timestep> <img>*(h*w) <eoi>

Both rows have the same length and the image at the same index, so CFG is one batch of two rows.
Which ratio index names which size is the release's resolution group; until that table is implemented
here (issue 25), the caller names the ratio index (FAMILIES.md 2.5).
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
    if not 0 <= ratio_index < len(tokens.ratios):
        raise ValueError(f"ratio index {ratio_index} is outside 0..{len(tokens.ratios) - 1}")
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    image_head = [tokens.boi, tokens.size, tokens.ratios[ratio_index]]
    prefixes = [[tokens.bos, *prompt_ids, *image_head]]
    if cfg:
        prefixes.append([tokens.bos, *([tokens.cfg] * len(prompt_ids)), *image_head])
    suffix = [tokens.timestep, *([tokens.image] * (height * width)), tokens.eoi]
    prefix = torch.tensor(prefixes, dtype=torch.long)
    rows = torch.tensor([p + suffix for p in prefixes], dtype=torch.long)
    return ImageRows(prefix=prefix, rows=rows, height=height, width=width)
