"""The ``dit`` stage: text-to-image on the core diffusion runtime, with our transformer and sampler.

Input: a ``prompt`` (task ``t2i``: the request's; ``it2i``: with ``images`` to edit, on an Instruct
checkpoint, `_prepare_edit`), or the ``ar`` stage's prompt, reasoning and ratio step as token ids
(``think_t2i``/``recaption_t2i``, `ReasoningAdapter`). The rows follow the checkpoint's
``sequence_template`` (`omni_hunyuan.prompt`). The size: the request's
``size``, one of the checkpoint's resolution table (`omni_hunyuan.resolution`); else the ratio the
``ar`` stage picked; else (``t2i``, or reasoning cut short) the model picks the ratio token here, its
logits limited to the ratio tokens of drawable sizes (as the release's ratio step).

Per request: the prompt's token rows (cond, plus uncond under CFG) are encoded ONCE into a text-prefix
KV cache (`start`); every step then runs only ``<timestep>`` and the image tokens. After think/recaption
the cond row starts from the ``ar`` stage's keys/values (``prefix_kv``: every token it computed, i.e.
all but the ratio token it sampled last), so only the rest of that row is computed here
(``reuse_prefix_kv: false``: all of it, for the same image). Requests at
different steps and with prompts of different lengths share one forward (`denoise`): their caches are
padded on the left, the padding left out of attention, their timesteps are per row, and each request
keeps its own sigmas.
The core's ``cache`` parameter (first-block caching) is decided per row: a row whose first layer's
output barely changed skips the other layers and reuses what they added last time.
The defaults (steps, guidance, flow shift, template) come from the checkpoint's generation_config;
a request's ``seed`` draws the release's starting noise, so it reproduces the release's image.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import attrs
import numpy as np
import torch

from omni_core.engine.params import int_param, number_param
from omni_core.errors import ConfigError, InvalidRequestError
from omni_core.stages.diffusion_model import DiffusionModel, DiffusionSample, LoadSpec
from omni_hunyuan.config import HunyuanConfig, generation_defaults
from omni_hunyuan.pipeline import EDIT_IMAGES_PARAM, PROMPT_PARAM
from omni_hunyuan.prompt import Text, image_rows, instruct_text, reasoned_text, t2i_text
from omni_hunyuan.resolution import aligned_size, drawable, ratio_index, ratio_sizes
from omni_hunyuan.sampler import distilled_guidance, flow_sigmas, initial_noise
from omni_hunyuan.tokens import SpecialTokens
from omni_hunyuan.transformer import PrefixCache


MAX_N = 8  # images per request (the server's bound on ``n`` too)


@attrs.define(eq=False)
class _Prefix:
    """A request's text rows and their KV cache, shared by its `n` samples (encoded once)."""

    ids: torch.Tensor  # [rows, L]: [cond, uncond] under CFG
    ar_kv: torch.Tensor | None = None  # the ar stage's rows of the cond row's first tokens (`start` uses them)
    cache: PrefixCache | None = None
    # it2i: the rows as embeddings [rows, L, hidden] (input images' blocks laid out), their (y, x)
    # positions [L, 2] and two-way spans (`start` encodes them instead of `ids`)
    embedded: tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]] | None = None


@attrs.define(eq=False)
class _State:
    prefix: _Prefix | None  # None once decoded (the last sample to let go frees the cache)
    latents: torch.Tensor  # fp32 [1, C, h, w]
    sigmas: torch.Tensor
    guidance_scale: float
    prompt_ids: list[int]  # the text the image is drawn after (what the request's usage counts)
    resize_to: tuple[int, int] | None = None  # align_image_size: (width, height) after decoding
    guidance_token: torch.Tensor | None = None  # -Distil: [1] on the device, what <guidance> embeds (`distilled_guidance`)


class HunyuanDiT(DiffusionModel):
    """Text -> image with HunyuanImage-3.0's own transformer; stage params ``seed``, ``size``
    ([width, height]), ``n`` (images, seeds ``seed``, ``seed + 1``, ...; one text-prefix encoding),
    ``num_inference_steps``, ``guidance_scale`` (defaults from generation_config), ``reuse_prefix_kv``
    (after think/recaption: start from the ``ar`` stage's keys/values; default true),
    ``align_image_size`` (edits: the release's ``infer_align_image_size``, `_prepare_edit`; default
    false) and the core's ``cache`` (first-block caching: `HunyuanImage3.velocity`)."""

    max_steps = 1000  # (flow-matching Euler steps: no scheduler limit; bounds a request's cost)
    load_options = frozenset({"quantization", "compile"})  # (compile: the layers' pieces, and the VAE decoder; no CUDA graphs)
    takes_shared_model = True  # share_model_with: ar (the decoder of the ar stage's vLLM model, `load_transformer`)
    request_params = frozenset({"seed", "n", "size", "num_inference_steps", "guidance_scale", "reuse_prefix_kv", "align_image_size"})

    def load(self, spec: LoadSpec) -> None:
        from transformers import AutoTokenizer

        from omni_hunyuan.vae import load_image_decoder
        from omni_hunyuan.weights import SharedBackboneError, load_transformer

        path = self.context.model_path
        self.config = HunyuanConfig.from_pretrained(path)
        self.defaults = generation_defaults(path)
        self.device = spec.device
        # With share_model_with: ar, the decoder runs on the modules the ar stage's vLLM engine loaded.
        try:
            self.transformer = load_transformer(path, device=spec.device, dtype=getattr(torch, spec.dtype), backbone=spec.shared_model)
        except SharedBackboneError as exc:
            stage = self.context.stage
            assert stage is not None  # (a stage's model part)
            raise ConfigError(f"share_model_with: {stage.share_model_with!r}: {exc}", key=f"stages.{stage.name}.{exc.setting}") from None
        # The ar stage's input-image encoder (VAE encoder, ViT, aligner, patch embedder), when it has one: edits use it (one copy).
        self._shared_encoder = getattr(spec.shared_model, "encoder", None)
        if spec.quantization is not None:  # (resolve() refuses it beside share_model_with: those are the ar's weights)
            from omni_hunyuan.quantized import quantize_layers

            quantize_layers(self.transformer, spec.quantization)
        if spec.compile:
            self.transformer.compile_layers()
        self.decoder = load_image_decoder(path, self.config.vae, device=spec.device)
        if spec.compile:
            # The VAE decoder whole under torch.compile (its norms, activations and adds fused around the
            # convolutions): 231 ms a 1024x1024 image on an H100 against 312 eager (463 with the
            # library's group norm), `bench/results/hunyuan-vae-decode-h100-norms.md`. A second image
            # size recompiles it once with dynamic sizes (~20 s there), which then serve every size.
            self.decoder.compile(dynamic=None)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokens = SpecialTokens.from_tokenizer(self.tokenizer, self.config.image_base_size)
        self.step_ids = self.tokens.step_tokens(self.config)  # <timestep> (-Distil: <guidance>, <timestep_r>)
        self.template = self.defaults.get("sequence_template", "pretrain")
        if self.template not in ("pretrain", "instruct"):
            raise NotImplementedError(f"sequence_template {self.template!r}: only 'pretrain' and 'instruct' are implemented")
        base = self.config.image_base_size
        self.num_ratios = len(self.tokens.ratios)
        self.drawable = drawable(base, self.num_ratios, self.config.vae_downsample)
        # The last batch's caches and their concatenation: the same requests step together for many
        # steps, so `denoise` pads and concatenates their keys/values once, not at every step.
        self._batch: tuple[list[PrefixCache], PrefixCache] | None = None

    def _param(self, data: dict[str, Any], params: dict[str, Any], key: str, default: Any) -> Any:
        return params.get(key, data.get(key, default))

    def prepare(self, request_id: str, data: dict[str, Any], params: dict[str, Any]) -> list[DiffusionSample]:
        images = data.get("images") or params.get(EDIT_IMAGES_PARAM) or []
        align = self._param(data, params, "align_image_size", False)
        if not isinstance(align, bool):
            raise InvalidRequestError(f"align_image_size must be true or false, got {align!r}", param="align_image_size")
        conds = self._conditions(images, stretch=align) if images else []
        text, picked = self._text(data, params, conds)
        text_ids = text.ids
        steps = int_param(self._param(data, params, "num_inference_steps", int(self.defaults.get("diff_infer_steps", 50))), "num_inference_steps")
        if not 1 <= steps <= self.max_steps:
            raise InvalidRequestError(f"num_inference_steps must be in 1..{self.max_steps}, got {steps}", param="num_inference_steps")
        guidance = number_param(self._param(data, params, "guidance_scale", self.defaults.get("diff_guidance_scale", 5.0)), "guidance_scale")
        seed = self._param(data, params, "seed", None)
        seed = random.randrange(2**31) if seed is None else int_param(seed, "seed")
        if not 0 <= seed < 2**63 - MAX_N:
            raise InvalidRequestError(f"seed must be a non-negative 63-bit integer, got {seed}", param="seed")
        n = int_param(self._param(data, params, "n", 1), "n")
        if not 1 <= n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {n}", param="n")
        size = self._param(data, params, "size", None)
        if conds:
            return self._prepare_edit(request_id, text, conds, size, picked, steps, guidance, seed, n, align)
        ratio = picked if size is None and picked is not None else self._ratio(size, text_ids)
        width, height = ratio_sizes(self.config.image_base_size, self.num_ratios)[ratio]
        side_h, side_w = height // self.config.vae_downsample, width // self.config.vae_downsample
        rows = image_rows(self.tokens, text_ids, ratio, side_h, side_w, cfg=self._cfg(guidance), blank=text.blank, step_ids=self.step_ids)
        reuse = self._param(data, params, "reuse_prefix_kv", True)
        if not isinstance(reuse, bool):
            raise InvalidRequestError(f"reuse_prefix_kv must be true or false, got {reuse!r}", param="reuse_prefix_kv")
        prefix = _Prefix(rows.prefix.to(self.device), self._reused_rows(data, rows.prefix[0].tolist()) if reuse else None)
        sigmas = flow_sigmas(steps, float(self.defaults.get("flow_shift", 3.0))).to(self.device)
        tokens = rows.prefix.shape[0] * (len(self.step_ids) + side_h * side_w)  # per branch: the step tokens and the image
        return [
            DiffusionSample(
                request_id, index, steps, (side_h, side_w),
                _State(
                    prefix, initial_noise(seed + index, self.config.latent_channels, side_h, side_w, self.device), sigmas, guidance, text_ids,
                    guidance_token=self._guidance_token(guidance),
                ),
                tokens=tokens,
            )
            for index in range(n)
        ]

    def _cfg(self, guidance: float) -> bool:
        """Whether a request draws with CFG rows ([cond, uncond]): a scale above 1 on a checkpoint not
        guidance-distilled (a -Distil one embeds the scale in its <guidance> token instead)."""
        return guidance > 1.0 and not self.config.cfg_distilled

    def _guidance_token(self, guidance: float) -> torch.Tensor | None:
        """A -Distil checkpoint's ``<guidance>`` value for the request, put on the device once (not a
        host-to-device copy at every step); None for a checkpoint with CFG."""
        return torch.tensor([distilled_guidance(guidance)], device=self.device) if self.config.cfg_distilled else None

    def _conditions(self, images: list[Any], stretch: bool = False) -> list[Any]:
        """The input images preprocessed for their blocks (`omni_hunyuan.understanding.CondImage`;
        `stretch`: their VAE branch stretched to the bucket, not cropped)."""
        from omni_hunyuan.understanding import preprocess

        if self.template != "instruct":
            raise InvalidRequestError(
                "image editing (it2i) needs an Instruct checkpoint (generation_config.json sequence_template: instruct); "
                f"this one's is {self.template!r}", param="messages",
            )
        try:
            return [preprocess(image, self.config, self.num_ratios, self._vit_processor, stretch) for image in images]
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"cannot read the input image: {exc}", param="messages") from None

    def _prepare_edit(
        self, request_id: str, text: Text, conds: list[Any], size: Any, picked: int | None, steps: int, guidance: float, seed: int, n: int,
        align: bool = False,
    ) -> list[DiffusionSample]:
        """it2i: the input images' blocks (`omni_hunyuan.understanding.layout`) in both CFG rows (the
        uncond row blanks the prompt, not the images). As the release draws them, one generator seeded
        with a sample's seed draws each input image's VAE latent, then the starting noise: each sample
        has its own prefix. The ratio: `size`'s, else the one the ``ar`` stage picked, else the model
        picks it after the images and the prompt. `align` (the release's ``infer_align_image_size``):
        the input images were stretched to their buckets (`_conditions`), and the image drawn is resized
        after decoding to the aspect ratio of the first input image of its ratio (`resolution.aligned_size`)."""
        from omni_hunyuan.understanding import layout

        if text.ids.count(self.tokens.image) != len(conds):
            raise InvalidRequestError("the prompt may not contain the image placeholder token <img>", param="prompt")
        encoder = self._image_encoder
        wte = self.transformer.model.wte
        sigmas = flow_sigmas(steps, float(self.defaults.get("flow_shift", 3.0))).to(self.device)
        head = [self.tokens.boi, self.tokens.size]
        # The uncond row's blanks over the laid-out ids: an image's block (which replaces its <img>) is kept.
        lengths = iter(cond.shape.length for cond in conds)
        blank: list[bool] = []
        for token, mark in zip([*text.ids, *head], [*text.blank, False, False]):
            blank += [False] * next(lengths) if token == self.tokens.image else [mark]
        samples: list[DiffusionSample] = []
        ratio: int | None = None
        for index in range(n):
            generator = torch.Generator(self.device).manual_seed(seed + index)
            with torch.no_grad():
                laid = layout([*text.ids, *head], conds, self.tokens, wte, encoder, generator)
                if ratio is None:
                    ratio = self._ratio(size, text.ids) if size is not None else picked if picked is not None else self._pick_ratio_of(laid)
                    width, height = ratio_sizes(self.config.image_base_size, self.num_ratios)[ratio]
                    side_h, side_w = height // self.config.vae_downsample, width // self.config.vae_downsample
                last = torch.tensor([self.tokens.ratios[ratio]], device=self.device)
                ids = [*laid.ids, int(last)]
                embeds = torch.cat([laid.embeds, wte(last)])
                positions = torch.cat([laid.positions, torch.full((1, 2), len(laid.ids), device=self.device)])
                rows, row_embeds = [ids], [embeds]
                if self._cfg(guidance):
                    out = torch.tensor([*blank, False], device=self.device)
                    rows.append([self.tokens.cfg if b else t for t, b in zip(ids, out.tolist())])
                    row_embeds.append(torch.where(out[:, None], wte(torch.tensor([self.tokens.cfg], device=self.device)), embeds))
            noise = torch.randn((1, self.config.latent_channels, side_h, side_w), generator=generator, device=self.device, dtype=torch.bfloat16).float()
            prefix = _Prefix(torch.tensor(rows, device=self.device), embedded=(torch.stack(row_embeds), positions, laid.spans))
            own = [(c.ratio, c.original) for c in conds if c.original is not None]
            resize = aligned_size(ratio, own, self.config.image_base_size, self.num_ratios) if align else None
            state = _State(prefix, noise, sigmas, guidance, ids, resize, self._guidance_token(guidance))
            samples.append(DiffusionSample(request_id, index, steps, (side_h, side_w), state, tokens=len(rows) * (len(self.step_ids) + side_h * side_w)))
        return samples

    @torch.no_grad()
    def _pick_ratio_of(self, laid: Any) -> int:
        """`pick_ratio` after a laid-out prompt ending ``<boi> <img_size>`` (input images in it)."""
        logits, _ = self.transformer.prompt_forward(laid.embeds[None], laid.positions[None], laid.spans, last=True)
        return self._best_ratio(logits[0, -1])

    @functools.cached_property
    def _image_encoder(self) -> Any:
        """The VAE encoder, Siglip2 tower, aligner and patch embedder for input images: the ar stage's
        (``share_model_with: ar``), else loaded on the first it2i request."""
        from omni_hunyuan.understanding import ImageEncoder

        if isinstance(self._shared_encoder, ImageEncoder):
            return self._shared_encoder
        return ImageEncoder.from_pretrained(self.context.model_path, device=self.device, dtype=self.transformer.model.wte.weight.dtype)

    @functools.cached_property
    def _vit_processor(self) -> Any:
        from omni_hunyuan.understanding import vit_processor

        return vit_processor(self.config)

    def _reused_rows(self, data: dict[str, Any], cond: list[int]) -> torch.Tensor | None:
        """The ``ar`` stage's key/value rows that the cond row can start from: those of the longest
        common beginning of what it computed (prompt, then reasoning) and the cond row."""
        rows = data.get("prefix_kv")
        if rows is None:
            return None
        c = self.config
        if rows.ndim != 2 or rows.shape[1] != c.num_layers * 2 * c.num_kv_heads * c.head_dim:
            raise ValueError(f"prefix_kv rows of shape {tuple(rows.shape)} do not fit this checkpoint's layers and KV heads")
        computed = [*data["prompt_token_ids"], *(data.get("token_ids") or ())][: rows.shape[0]]
        same = next((i for i, (a, b) in enumerate(zip(computed, cond)) if a != b), min(len(computed), len(cond)))
        return rows[:same] if same > 0 else None

    def _text(self, data: dict[str, Any], params: dict[str, Any], conds: list[Any]) -> tuple[Text, int | None]:
        """The text before the image and the ratio the ``ar`` stage picked (None: none picked):
        ``<bos> prompt`` (``pretrain`` t2i); the instruct template's ``... Assistant: <answer>``
        (``instruct`` t2i; it2i with the input images' placeholders); or the ``ar`` stage's prompt
        (as the input processor built it: `PROMPT_PARAM`), reasoning and ``<answer>`` (think/recaption)."""
        if data.get("prompt_token_ids") is not None:
            built = params.get(PROMPT_PARAM)
            if built is not None:
                prompt = Text(list(built["ids"]), [bool(b) for b in built["blank"]])
            elif conds:
                raise ValueError(f"an edit after reasoning needs the ar stage's prompt as built for it ({PROMPT_PARAM})")
            else:  # (its ids as the ar stage ran them, every token after <bos> blanked: the pretrain rule)
                ids = list(data["prompt_token_ids"])
                prompt = Text.of(ids[:1]) + Text.of(ids[1:], blank=True)
            return reasoned_text(self.tokens, prompt, list(data.get("token_ids") or ()), drop_think=bool(self.defaults.get("drop_think")))
        prompt = data.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError("HunyuanImage-3.0 needs a text prompt", param="prompt")
        if self.template == "instruct":
            text = instruct_text(self.tokenizer, self.tokens, prompt, system=data.get("system"), images=len(conds))
            return text + Text.of([self.tokens.answer]), None
        return t2i_text(self.tokenizer, self.tokens, prompt), None

    def _ratio(self, size: Any, text_ids: list[int]) -> int:
        """The ratio index of the requested `size`, or the model's pick after the text."""
        if size is None:
            return self.pick_ratio(text_ids)
        try:
            width, height = (int(v) for v in size)
        except (TypeError, ValueError):
            raise InvalidRequestError("size must be [width, height]", param="size") from None
        try:
            return ratio_index((width, height), self.config.image_base_size, self.num_ratios, self.config.vae_downsample)
        except ValueError as exc:
            raise InvalidRequestError(f"size: {exc}", param="size") from None

    @torch.no_grad()
    def pick_ratio(self, text_ids: list[int]) -> int:
        """The ratio token the model ranks first after ``text <boi> <img_size>``, among drawable sizes."""
        ids = torch.tensor([[*text_ids, self.tokens.boi, self.tokens.size]], device=self.device)
        logits, _ = self.transformer.text_forward(ids)
        return self._best_ratio(logits[0, -1])

    def _best_ratio(self, logits: torch.Tensor) -> int:
        """The drawable ratio whose token `logits` (``[vocab]``, after ``<boi> <img_size>``) rank first."""
        allowed = torch.tensor([self.tokens.ratios[i] for i in self.drawable], device=logits.device)
        return self.drawable[int(logits[allowed].argmax())]

    def start(self, samples: list[DiffusionSample]) -> None:
        dtype = self.transformer.model.wte.weight.dtype
        for sample in samples:
            prefix = sample.state.prefix
            if prefix.cache is not None:  # a sibling sample (same request) encoded it
                continue
            if prefix.embedded is not None:
                prefix.cache, prefix.embedded = self.transformer.encode_prompt_prefix(*prefix.embedded), None
                continue
            if prefix.ar_kv is None:
                prefix.cache = self.transformer.encode_prefix(prefix.ids)
                continue
            reused = PrefixCache.from_rows(prefix.ar_kv, self.config, device=self.device, dtype=dtype)
            rows = [self.transformer.encode_prefix(prefix.ids[:1, reused.length :], reused)]
            if prefix.ids.shape[0] > 1:  # the uncond row (<cfg> tokens): never computed by ar
                rows.append(self.transformer.encode_prefix(prefix.ids[1:]))
            prefix.cache, prefix.ar_kv = PrefixCache.concat(rows), None

    @torch.no_grad()
    def denoise(self, samples: list[DiffusionSample]) -> None:
        # Rows sorted by prefix length attend in the fewest runs (`ImageRowsMask`); a request's rows
        # (cond, uncond) have one length.
        samples = sorted(samples, key=lambda sample: sample.state.prefix.cache.length)
        states: list[_State] = [s.state for s in samples]
        dtype = self.transformer.model.wte.weight.dtype
        prefixes = [state.prefix for state in states]
        rows = [prefix.ids.shape[0] for prefix in prefixes]
        # One latent and timestep per sample: its rows share them (`velocity`'s `repeats`).
        latents = torch.cat([state.latents for state in states]).to(dtype)
        timesteps = torch.stack([state.sigmas[sample.step] * 1000 for sample, state in zip(samples, states)])
        caches = [prefix.cache for prefix in prefixes]
        assert all(cache is not None for cache in caches)
        if self._batch is None or len(self._batch[0]) != len(caches) or any(a is not b for a, b in zip(self._batch[0], caches)):
            self._batch = (caches, PrefixCache.concat(caches))  # type: ignore[arg-type]
        # Row r of a sample is its CFG branch r (cond, uncond): first-block caching decides per row.
        cache_rows = [(sample.cache, branch) for sample, n in zip(samples, rows) for branch in range(n)]
        steps = [sample.step for sample, n in zip(samples, rows) for _ in range(n)]
        totals = [sample.total_steps for sample, n in zip(samples, rows) for _ in range(n)]
        scalars: dict[str, torch.Tensor] = {}
        if self.config.cfg_distilled:
            scalars["guidance"] = torch.cat([state.guidance_token for state in states])
        if self.config.use_meanflow:
            scalars["timestep_r"] = torch.stack([state.sigmas[sample.step + 1] * 1000 for sample, state in zip(samples, states)])
        velocity = self.transformer.velocity(self._batch[1], latents, timesteps, cache_rows, steps, totals, repeats=rows, **scalars).float()
        for sample, state, part in zip(samples, states, velocity.split(rows)):
            if part.shape[0] == 2:
                cond, uncond = part.chunk(2)
                part = uncond + state.guidance_scale * (cond - uncond)
            state.latents = state.latents + part * (state.sigmas[sample.step + 1] - state.sigmas[sample.step])

    def decode(self, samples: list[DiffusionSample]) -> list[dict[str, Any]]:
        from omni_hunyuan.vae import decode_latents

        images = list(decode_latents(self.decoder, torch.cat([s.state.latents for s in samples]), self.config.vae).cpu().numpy())
        for index, sample in enumerate(samples):
            sample.state.prefix = None  # the prefix KV is the request's largest state: let it go now
            if sample.state.resize_to is not None:
                from PIL import Image

                resized = Image.fromarray(images[index]).resize(sample.state.resize_to, Image.Resampling.LANCZOS)
                images[index] = np.asarray(resized)
        self._batch = None  # (it holds the finished samples' caches too)
        return [{"image": image, "prompt_token_ids": sample.state.prompt_ids} for sample, image in zip(samples, images)]
