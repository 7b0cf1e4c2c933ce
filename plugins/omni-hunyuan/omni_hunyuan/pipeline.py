"""The HunyuanImage-3.0 family's pipeline: stages ``ar`` -> ``dit`` and four tasks over them.

- ``ar`` (kind ``ar``, `omni_hunyuan.ar.HunyuanAR`): text on vLLM, an out-of-tree vLLM model class of
  our own.
- ``dit`` (kind ``diffusion``, `omni_hunyuan.dit.HunyuanDiT`): the image; stage parameters ``seed``,
  ``size`` ([width, height], one of the checkpoint's resolution table; unset: the model picks), ``n``
  (images of one prompt, seeds ``seed``, ``seed + 1``, ...), ``num_inference_steps``,
  ``guidance_scale``, defaults from the checkpoint's generation_config.

Tasks (the core's paths per request; `modalities` pick one, a ``task`` field or stage parameter
names one):

| task | stages | modalities |
|---|---|---|
| ``t2t`` | ar | text |
| ``t2i`` | dit (the request's prompt) | image |
| ``it2i`` | dit (the prompt after the message's images: editing; Instruct checkpoints) | image, with images |
| ``think_t2i`` | ar -> dit: ``<think>`` reasoning and the ratio step, then the image after it | text, image |
| ``recaption_t2i`` | ar -> dit: ``<recaption>`` rewritten prompt, then the image | text, image |
| ``think_recaption_t2i`` | ar -> dit: ``<think>``, then ``<recaption>``, then the image | text, image (bot_task think_recaption) |
| ``think_it2i`` / ``recaption_it2i`` / ``think_recaption_it2i`` | ar -> dit: reasoning over the images, then the edit | text, image, with images |

One copy of the weights: the default deploy runs the ``dit`` stage in the ``ar`` stage's worker
process, on the modules the ``ar`` stage's vLLM engine loaded (``share_model_with: ar``);
``deploy/two-copies.yaml`` gives each stage its own process and copy.
After think/recaption, the ``dit`` stage starts from the ``ar`` stage's keys/values of the prompt and
reasoning (``prefix_kv`` rows, `omni_hunyuan.ar`) instead of computing them again; the ``dit``
parameter ``reuse_prefix_kv: false`` recomputes them (the same image).
"""

from __future__ import annotations

from typing import Any

from omni_hunyuan.ar import PREFIX_KV_PARAM
from omni_hunyuan.resolution import RATIO_TAIL_PARAM

from omni_core.config.pipeline import EdgeSpec, PipelineConfig, StageSpec, TaskSpec
from omni_core.engine.inputs import last_user_images, last_user_text
from omni_core.engine.params import int_param
from omni_core.engine.vllm_inputs import mm_processor_flags
from omni_core.errors import InvalidRequestError
from omni_core.outputs import Chunk, StageInput
from omni_core.parts import EdgeAdapter, InputProcessor, InternalKeysOutput

STAGE = "dit"
AR_STAGE = "ar"
DEFAULT_DEPLOY = "omni_hunyuan:deploy/default.yaml"
EXTRA_FIELDS = ("size", "seed", "n")
REASONING = {  # task -> the ar stage's bot_task
    "think_t2i": "think", "recaption_t2i": "recaption", "think_recaption_t2i": "think_recaption",
    "think_it2i": "think", "recaption_it2i": "recaption", "think_recaption_it2i": "think_recaption",
}
MAX_IMAGES = 3  # per request, as vLLM-Omni's template allows (the ar stage's vLLM limit too)
REASONING_TOTAL_TOKENS = 2048
"""The ar stage's default length for think/recaption-then-draw, forced tokens and ratio included (the release's
``generate_image`` ``max_new_tokens``); a request's ``ar`` ``max_tokens`` is the reasoning's budget instead."""
ALIGN_PARAM = "align_image_size"
"""Input images stretched to their bucket, the image drawn resized to their aspect ratio (the release's
``infer_align_image_size``): a request's ``mm_processor_kwargs`` key, and the ``dit`` stage's parameter."""
EDIT_IMAGES_PARAM = "edit_images"
"""The same, after reasoning over input images: the images (the ``ar`` stage hands the ``dit`` token ids only)."""
PROMPT_PARAM = "reasoning_prompt"
"""The ``dit`` stage's parameter for think/recaption-then-draw, set here (never by users): the ``ar``
stage's prompt as built for it, ``{"ids": [...], "blank": [...]}`` (`omni_hunyuan.prompt.Text`: each
input image one ``<img>`` placeholder, and which tokens the uncond row blanks)."""

TASKS = (
    TaskSpec("t2i", (STAGE,), ("image",), "text -> image: the DiT alone (with images in the messages: it2i)"),
    TaskSpec("it2i", (STAGE,), ("image",), "image(s) and text -> image (editing): the DiT alone"),
    TaskSpec("t2t", (AR_STAGE,), ("text",), "text -> text on vLLM (with images in the messages: i2t)"),
    TaskSpec("i2t", (AR_STAGE,), ("text",), "image(s) and text -> text on vLLM"),
    TaskSpec("think_t2i", (AR_STAGE, STAGE), ("text", "image"), "think, then draw after the reasoning"),
    TaskSpec("recaption_t2i", (AR_STAGE, STAGE), ("text", "image"), "rewrite the prompt, then draw after it"),
    TaskSpec("think_recaption_t2i", (AR_STAGE, STAGE), ("text", "image"), "think, rewrite the prompt, then draw after both"),
    TaskSpec("think_it2i", (AR_STAGE, STAGE), ("text", "image"), "think over the message's images, then edit them"),
    TaskSpec("recaption_it2i", (AR_STAGE, STAGE), ("text", "image"), "rewrite the edit's prompt over its images, then edit"),
    TaskSpec("think_recaption_it2i", (AR_STAGE, STAGE), ("text", "image"), "think and rewrite over the images, then edit"),
)


def build_pipeline(model_path: str, hf_config: dict[str, Any]) -> PipelineConfig:
    """The pipeline of a ``HunyuanImage3ForCausalMM`` checkpoint (declarations only: no torch; it
    reads the checkpoint's generation_config.json).

    The default task is vLLM-Omni's for the same checkpoint: an Instruct checkpoint (``sequence_template:
    instruct``) thinks, then draws (text and image, both final outputs in its AR -> DiT config); a base
    checkpoint, which has no reasoning template, draws (``t2i``).
    """
    from omni_hunyuan.config import generation_defaults, text_sampling_defaults

    defaults = generation_defaults(model_path)
    instruct = defaults.get("sequence_template") == "instruct"
    # Text + image picks the first task that makes both: the reasoning the checkpoint's bot_task names
    # (the Instruct release's: think_recaption).
    first = {"think": "think_t2i", "recaption": "recaption_t2i", "think_recaption": "think_recaption_t2i"}.get(defaults.get("bot_task"))
    tasks = tuple(sorted(TASKS, key=lambda task: task.name != first)) if instruct and first else TASKS
    return PipelineConfig(
        family="hunyuan-image3",
        stages=(
            StageSpec(
                name=AR_STAGE, kind="ar", model="omni_hunyuan.ar:HunyuanAR", output="text", params=text_sampling_defaults(defaults),
                output_adapter="omni_hunyuan.pipeline:ReasoningOutput",
            ),
            StageSpec(
                name=STAGE,
                kind="diffusion",
                model="omni_hunyuan.dit:HunyuanDiT",
                inputs=(EdgeSpec(AR_STAGE, adapter="omni_hunyuan.pipeline:ReasoningAdapter"),),
                output="image",
                final=True,
            ),
        ),
        input_processor="omni_hunyuan.pipeline:HunyuanInputProcessor",
        default_deploy=DEFAULT_DEPLOY,
        default_modalities=("text", "image") if instruct else ("image",),
        tasks=tasks,
    )


class HunyuanInputProcessor(InputProcessor):
    """Request -> the input of its task's entry stages: the prompt; ``size``, ``seed`` and ``n`` for ``dit``;
    for think/recaption-then-draw the ``ar`` stage's template, stop token and budget."""

    def load(self) -> None:
        from transformers import AutoTokenizer

        from omni_hunyuan.config import SYSTEM_PROMPT_NAMES, HunyuanConfig, default_system_prompts, generation_defaults, system_prompt_texts
        from omni_hunyuan.resolution import drawable
        from omni_hunyuan.tokens import SpecialTokens
        from omni_hunyuan.understanding import image_block_refusal

        path = self.context.model_path
        config = HunyuanConfig.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        defaults = generation_defaults(path)
        self.template = defaults.get("sequence_template", "pretrain")
        self.system_prompts = default_system_prompts(path) if self.template == "instruct" else {}
        # generation_config's drop_think: after think-and-recaption the image pass keeps the recaption
        # only, and a system text gives way to the checkpoint's recaption one (as the release does).
        # (unstripped: the release swaps it in after its one strip of the system text)
        recaption_system = system_prompt_texts(path).get(SYSTEM_PROMPT_NAMES["en_recaption"]) if defaults.get("drop_think") else None
        self.drop_think_system = recaption_system if recaption_system and recaption_system.strip() else None
        self.tokens = SpecialTokens.from_tokenizer(self.tokenizer, config.image_base_size)
        self.image_refusal = image_block_refusal(config.raw)
        self.ratio_ids = [self.tokens.ratios[i] for i in drawable(config.image_base_size, len(self.tokens.ratios), config.vae_downsample)]

    def process(self, request: Any) -> dict[str, StageInput]:
        prompt = request.prompt
        if prompt is None and request.messages:
            prompt = last_user_text(request.messages, reads=("image_url", "image"))
        images = last_user_images(request.messages, MAX_IMAGES, "HunyuanImage-3.0")
        if images and self.image_refusal:
            raise InvalidRequestError(self.image_refusal, param="messages")
        if images and request.task in ("t2t", "i2t") and prompt is None:
            prompt = ""  # an image alone is a prompt for i2t
        elif not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError("HunyuanImage-3.0 needs a text prompt", param="prompt")
        reuse = request.params.get(STAGE, {}).get("reuse_prefix_kv", True)
        if not isinstance(reuse, bool):  # (checked here too: after think/recaption, dit would see it only later)
            raise InvalidRequestError(f"reuse_prefix_kv must be true or false, got {reuse!r}", param="reuse_prefix_kv")
        dit: dict[str, Any] = {}
        for key in EXTRA_FIELDS:
            if request.extra.get(key) is not None:
                dit[key] = tuple(request.extra[key]) if key == "size" else request.extra[key]
        align = self._align(request)
        if align:  # (both stages read input images: the ar stage through its vLLM processor's kwargs)
            dit[ALIGN_PARAM] = True
        processor_kwargs = {"mm_processor_kwargs": {ALIGN_PARAM: True}} if align and images else {}
        if (request.task in ("i2t", "it2i") or request.task.endswith("_it2i")) and not images:
            raise InvalidRequestError(f"task {request.task!r} needs an image (an image_url part in the user message)", param="messages")
        system = system_text(request.messages)
        if request.task in ("t2t", "i2t"):
            data: dict[str, Any] = {"prompt": prompt, "images": images, "system": system, **processor_kwargs} if images else {"prompt": prompt}
            return {AR_STAGE: StageInput(data=data, final=True)}
        if images and self.template != "instruct":
            raise InvalidRequestError(
                "image editing (it2i) needs an Instruct checkpoint (generation_config.json sequence_template: instruct); "
                f"this one's is {self.template!r}", param="messages",
            )
        asked = request.params.get(AR_STAGE, {})
        if asked.get("structured_outputs") is not None:  # (chat's response_format, or vLLM's own field)
            raise InvalidRequestError(
                f"response_format and structured_outputs apply to the text tasks t2t and i2t; task {request.task!r} draws an image "
                "(and its reasoning must end in the ratio step)", param="response_format",
            )
        # An image request without a system message gets the checkpoint's own (`default_system_prompts`).
        if system is None:
            system = self.system_prompts.get(REASONING.get(request.task, "image"))
        if request.task in ("t2i", "it2i"):
            edit = {"images": images} if images else {}
            return {STAGE: StageInput(data={"prompt": prompt, "system": system, **edit, **dit}, final=True)}
        bot_task = REASONING[request.task]
        closers = {
            "think": [self.tokens.end_think], "recaption": [self.tokens.end_recaption],
            "think_recaption": [self.tokens.end_think, self.tokens.end_recaption],
        }[bot_task]
        openers = [self.tokens.recaption] if bot_task == "think_recaption" else []  # forced after </think>
        # The reasoning, then the ratio step (`omni_hunyuan.ratio_tail`): it ends on a ratio token.
        # The reasoning's budget is the request's max_tokens (the closers, openers and ratio step come on top),
        # else what the release's 2048 new tokens leave it.
        forced = [self.tokens.answer, self.tokens.boi, self.tokens.size]
        steps = len(closers) + len(openers) + len(forced) + 1
        budget = int_param(asked.get("max_tokens", REASONING_TOTAL_TOKENS - steps), "max_tokens")
        if budget < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {budget}", param="max_tokens")
        tail = {"closers": closers, "openers": openers, "budget": budget, "forced": forced, "ratios": self.ratio_ids}
        ar_params: dict[str, Any] = {"max_tokens": budget + steps}
        ar_params["stop_token_ids"] = [*asked.get("stop_token_ids", ()), *self.ratio_ids]
        ar_params[RATIO_TAIL_PARAM] = tail
        if reuse and not images:
            # Its keys/values come along for the dit stage. (Not after reasoning over input images: the
            # image pass draws their VAE latents anew from the request's seed, as the release does.)
            ar_params[PREFIX_KV_PARAM] = True
        # The ar stage's prompt (`HunyuanAR.make_prompt`, the same builder), for the dit's rows: its images as placeholders, its
        # blanks (under drop_think the image pass's system text: `drop_think_system`).
        from omni_hunyuan.prompt import reasoning_prompt

        swapped = bool(system and bot_task == "think_recaption" and self.drop_think_system)
        image_system = self.drop_think_system if swapped else system
        built = reasoning_prompt(self.tokenizer, self.tokens, prompt, bot_task, image_system, images=len(images), raw_system=swapped)
        ar_data: dict[str, Any] = {"prompt": prompt, "bot_task": bot_task, "system": system, **({"images": images} if images else {}), **processor_kwargs}
        dit_params = {**dit, PROMPT_PARAM: {"ids": built.ids, "blank": built.blank}, **({EDIT_IMAGES_PARAM: images} if images else {})}
        return {
            AR_STAGE: StageInput(data=ar_data, final=True, params=ar_params),
            STAGE: StageInput(data={}, params=dit_params),  # its text comes from ar (ReasoningAdapter)
        }

    @staticmethod
    def _align(request: Any) -> bool:
        """``align_image_size`` (the release's ``infer_align_image_size``): from the request's
        ``mm_processor_kwargs`` (vLLM's field: both stages), else the ``dit`` stage parameter."""
        kwargs = mm_processor_flags(request, (ALIGN_PARAM,), "HunyuanImage-3.0")
        align = kwargs.get(ALIGN_PARAM, request.params.get(STAGE, {}).get(ALIGN_PARAM, False))
        if not isinstance(align, bool):
            raise InvalidRequestError(f"{ALIGN_PARAM} must be true or false, got {align!r}", param=ALIGN_PARAM)
        return align


def system_text(messages: Any) -> str | None:
    """The text of the first system message, or None."""
    for message in messages or ():
        if isinstance(message, dict) and message.get("role") == "system":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text") or None
    return None


class ReasoningAdapter(EdgeAdapter):
    """``ar`` -> ``dit``: the ``ar`` stage's prompt and reasoning as token ids, once it is done, and
    its keys/values of them (``prefix_kv`` rows) when it sent them."""

    def on_chunk(self, state: dict[str, Any], chunk: Chunk) -> StageInput | None:
        if chunk.data.get("prompt_token_ids") is not None:
            state["prompt_token_ids"] = list(chunk.data["prompt_token_ids"])
        state.setdefault("token_ids", []).extend(chunk.data.get("token_ids") or ())
        if chunk.data.get(PREFIX_KV_PARAM) is not None:
            state.setdefault("kv", []).append(chunk.data[PREFIX_KV_PARAM])
        if not chunk.final:
            return None
        data: dict[str, Any] = {"prompt_token_ids": state["prompt_token_ids"], "token_ids": state["token_ids"]}
        if state.get("kv"):
            import torch

            data[PREFIX_KV_PARAM] = torch.cat(state["kv"]) if len(state["kv"]) > 1 else state["kv"][0]
        return StageInput(data=data, final=True)


class ReasoningOutput(InternalKeysOutput):
    """The ``ar`` stage's chunks as the user sees them: without the keys/values meant for ``dit``."""

    internal = frozenset({PREFIX_KV_PARAM})
