"""Token rows of the release's image sequences: the text before the image, and CFG's two rows.

``sequence_template: pretrain`` (the base release), ``t2i``::

    cond:   <bos> prompt <boi> <img_size_{base}> <img_ratio_k> <timestep> <img>*(h*w) <eoi>
    uncond: <bos> <cfg>*len(prompt) <boi> <img_size_{base}> <img_ratio_k> <timestep> <img>*(h*w) <eoi>

``sequence_template: instruct`` (`instruct_text`), as the release's chat template lays it out, each
piece tokenized on its own::

    <bos> [system "\n\n"] "User: " [input image blocks] prompt "\n\n" "Assistant: "
          [<think> reasoning </think>] [<recaption> caption </recaption>] <answer> <boi> ... <eoi>

The uncond row replaces the prompt's and the reasoning's tokens with ``<cfg>``, one for one, and keeps
the rest (``<bos>``, the system text, the role prefixes, the separators, the tags, the input images):
`Text.blank` marks which. Both rows have the same length and the image at the same index, so CFG is
one batch of two rows. Which ratio index names which size is the release's resolution group
(`omni_hunyuan.resolution`).

Think/recaption-then-draw: the ``ar`` stage continues the instruct text from ``Assistant: <think>``
(or ``<recaption>``) to ``</think>`` (think-and-recaption: then ``<recaption>`` ... ``</recaption>``),
then the ratio step ``<answer><boi><img_size_B><img_ratio_k>``; the image rows start with that text
up to its last closer and ``<answer>``, as token ids (never decoded and re-encoded), with ratio k.
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


@attrs.frozen
class Text:
    """Token ids of the text before an image, and which of them the uncond row blanks (``<cfg>``)."""

    ids: list[int]
    blank: list[bool]

    def __add__(self, other: Text) -> Text:
        return Text([*self.ids, *other.ids], [*self.blank, *other.blank])

    @staticmethod
    def of(ids: list[int], blank: bool = False) -> Text:
        return Text(list(ids), [blank] * len(ids))


def _piece(tokenizer: Any, text: str, blank: bool = False) -> Text:
    return Text.of(tokenizer.encode(text, add_special_tokens=False), blank)


def t2i_text(tokenizer: Any, tokens: SpecialTokens, prompt: str) -> Text:
    """``<bos> prompt`` (``pretrain``): the uncond row blanks the prompt."""
    return Text.of([tokens.bos]) + _piece(tokenizer, prompt, blank=True)


def instruct_text(
    tokenizer: Any, tokens: SpecialTokens, prompt: str, *, system: str | None = None, images: int = 0, opener: int | None = None,
    raw_system: bool = False,
) -> Text:
    """``<bos> [system "\n\n"] "User: " <img>*images prompt "\n\n" "Assistant: " [opener]``, each
    piece tokenized on its own (as the release's template does: no merge across pieces); each
    ``<img>`` stands for an input image's block (`omni_hunyuan.understanding.layout`). The uncond
    row blanks the prompt only. The system text is stripped (the release strips a request's or the
    checkpoint's), unless `raw_system`: the text the release swaps in under drop_think, unstripped as it does."""
    text = Text.of([tokens.bos])
    if system and system.strip():
        text = text + _piece(tokenizer, system if raw_system else system.strip()) + _piece(tokenizer, "\n\n")
    text = text + _piece(tokenizer, "User: ") + Text.of([tokens.image] * images) + _piece(tokenizer, prompt, blank=True)
    text = text + _piece(tokenizer, "\n\n") + _piece(tokenizer, "Assistant: ")
    return text + Text.of([opener]) if opener is not None else text


def t2i_rows(
    tokenizer: Any, tokens: SpecialTokens, prompt: str, ratio_index: int, height: int, width: int, cfg: bool
) -> ImageRows:
    """The cond row (and the uncond row when `cfg`) for an image of ``height x width`` latent tokens (``pretrain``)."""
    text = t2i_text(tokenizer, tokens, prompt)
    return image_rows(tokens, text.ids, ratio_index, height, width, cfg, blank=text.blank)


def instruct_prompt_ids(
    tokenizer: Any, tokens: SpecialTokens, prompt: str, bot_task: str, system: str | None = None, images: int = 0,
) -> list[int]:
    """The ``ar`` stage's prompt for `bot_task` ``think`` (``... Assistant: <think>``) or ``recaption``
    (with `images` ``<img>`` placeholders before the prompt: reasoning before an edit)."""
    return reasoning_prompt(tokenizer, tokens, prompt, bot_task, system, images).ids


def reasoning_prompt(
    tokenizer: Any, tokens: SpecialTokens, prompt: str, bot_task: str, system: str | None = None, images: int = 0,
    raw_system: bool = False,
) -> Text:
    """`instruct_prompt_ids` with its blank marks (the prompt's tokens); ``think_recaption`` opens with
    ``<think>``; `raw_system` as `instruct_text` takes it."""
    opener = {"think": tokens.think, "recaption": tokens.recaption, "think_recaption": tokens.think}[bot_task]
    return instruct_text(tokenizer, tokens, prompt, system=system, images=images, opener=opener, raw_system=raw_system)


def reasoned_text(tokens: SpecialTokens, prompt: Text, generated: list[int], drop_think: bool = False) -> tuple[Text, int | None]:
    """The text before the image after think/recaption, and the ratio index the ``ar`` stage picked.

    The text: the ``ar`` stage's prompt, its reasoning up to the closer before its ratio step
    ``<answer><boi><img_size><img_ratio_k>`` (`omni_hunyuan.ratio_tail`; think-and-recaption: both
    sections), ``<answer>``; a reasoning that ran out of tokens first is closed (its open section's
    closer added). The uncond row blanks the reasoning but not its tags, besides what `prompt` marks.
    `drop_think` (generation_config's, as the release applies it to the image pass): the think
    section, its tags included, is left out (think-and-recaption keeps the recaption; think, nothing).
    The ratio: k, or None when the reasoning did not get there.
    """
    tags = {tokens.think, tokens.end_think, tokens.recaption, tokens.end_recaption}
    step = [tokens.answer, tokens.boi, tokens.size]
    ratio = None
    if len(generated) >= 5 and generated[-4:-1] == step and generated[-1] in tokens.ratios and generated[-5] in (tokens.end_think, tokens.end_recaption):
        reasoning, ratio = generated[:-4], tokens.ratios.index(generated[-1])
    else:  # cut short (max_tokens, a stop token): its partial ratio step dropped, its open section closed
        reasoning = [t for t in generated if t != tokens.eos]
        while reasoning and (reasoning[-1] in step or reasoning[-1] in tokens.ratios):
            reasoning.pop()
        opened = [t for t in [*prompt.ids[-1:], *reasoning] if t in tags]
        if opened and opened[-1] in (tokens.think, tokens.recaption):
            reasoning.append(tokens.end_think if opened[-1] == tokens.think else tokens.end_recaption)
    if drop_think and prompt.ids[-1:] == [tokens.think] and tokens.end_think in reasoning:
        prompt = Text(prompt.ids[:-1], prompt.blank[:-1])
        reasoning = reasoning[reasoning.index(tokens.end_think) + 1 :]
    marks = Text(list(reasoning), [t not in tags for t in reasoning])
    return prompt + marks + Text.of([tokens.answer]), ratio


def image_rows(
    tokens: SpecialTokens, text_ids: list[int], ratio_index: int, height: int, width: int, cfg: bool, blank: list[bool] | None = None,
    step_ids: list[int] | None = None,
) -> ImageRows:
    """Rows for an image after `text_ids` (starting with ``<bos>``); the uncond row replaces the
    tokens `blank` marks with ``<cfg>`` (unset: every one after ``<bos>``, the ``pretrain`` rule).
    `step_ids`: the tokens before the first ``<img>`` (unset: ``<timestep>``; a -Distil checkpoint's:
    `SpecialTokens.step_tokens`)."""
    if not 0 <= ratio_index < len(tokens.ratios):
        raise ValueError(f"ratio index {ratio_index} is outside 0..{len(tokens.ratios) - 1}")
    if blank is None:
        blank = [False] + [True] * (len(text_ids) - 1)
    if len(blank) != len(text_ids):
        raise ValueError(f"{len(blank)} blank marks for {len(text_ids)} tokens")
    image_head = [tokens.boi, tokens.size, tokens.ratios[ratio_index]]
    prefixes = [[*text_ids, *image_head]]
    if cfg:
        prefixes.append([tokens.cfg if out else t for t, out in zip(text_ids, blank)] + image_head)
    suffix = [*(step_ids or [tokens.timestep]), *([tokens.image] * (height * width)), tokens.eoi]
    prefix = torch.tensor(prefixes, dtype=torch.long)
    rows = torch.tensor([p + suffix for p in prefixes], dtype=torch.long)
    return ImageRows(prefix=prefix, rows=rows, height=height, width=width)
