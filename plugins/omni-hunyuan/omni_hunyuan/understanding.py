"""Image understanding (``i2t``): a conditioning image as the release's joint image block.

One image becomes, where its ``<img>`` placeholder stood in the prompt::

    <boi> <img_size_B> <img_ratio_k> <timestep> <img>*(h_v*w_v) <joint_img_sep> <img>*P <eoi>

- the VAE slots: the image scaled (Lanczos) to cover the size of the resolution table whose
  height/width ratio is nearest its own (``<img_ratio_k>``) and centre-cropped to it (`cover_crop`: the
  release's default; with ``align_image_size``, the release's ``infer_align_image_size``, stretched to
  it instead), mapped to [-1, 1], VAE-encoded (a sample of the
  latent distribution, seeded: ``seed``), shifted and scaled, then `UNetDown` (``patch_embed``) at
  timestep 0; ``h_v x w_v`` latent tokens, row-major;
- ``<timestep>``: ``timestep_emb(0)``; ``<joint_img_sep>``: its word embedding;
- the ViT slots: transformers' Siglip2 (naflex) processor and vision tower (``vision_model.*``) with
  the checkpoint's ``vit_processor`` settings, always ``P = max_num_patches`` rows (the padding rows as
  the tower gives them: masked as keys only, as the release's code does), then the aligner
  (``vision_aligner.layers.*``: Linear, GELU, Linear);
- positions (2-D RoPE, `omni_hunyuan.rope`): every token's is its index, but the VAE slots sit on their
  ``h_v x w_v`` grid and the first ``h_p * w_p`` ViT slots on the ViT's patch grid (the padding rows
  stay 1-D); text after the block goes on from its end;
- attention: causal, except that the span from the first VAE slot to the last ViT slot (separator and
  padding included) attends both ways within itself (the release's ``cond_token_attn_type: joint_full``;
  requests with images on a checkpoint naming another kind are refused: `image_block_refusal`).

Checked against the -Instruct release's own code on a tiny checkpoint (tests/test_release.py: an edit
through the ``dit`` stage). This is how vLLM-Omni's HunyuanImage-3.0 model builds its i2t inputs
(FAMILIES.md 2.2-2.3); the Instruct template puts the images after ``User: `` (`i2t_prompt_ids`).
Torch and transformers only: the ``ar`` stage's vLLM model (`omni_hunyuan.vllm_model`) and the torch
reference (`layout`, then `HunyuanImage3.greedy` with its ``prompt``) share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from omni_hunyuan.config import HunyuanConfig
from omni_hunyuan.patches import TimestepEmbedder, UNetDown
from omni_hunyuan.resolution import drawable, ratio_sizes
from omni_hunyuan.rope import image_positions
from omni_hunyuan.tokens import SpecialTokens

ENCODER_PREFIXES = ("vae.", "vision_model.", "vision_aligner.", "patch_embed.", "time_embed.", "timestep_emb.")
HEAD_TOKENS = 4  # <boi> <img_size> <img_ratio> <timestep>, before the VAE slots


@attrs.frozen
class CondImage:
    """One preprocessed conditioning image (what the vLLM processor hands the model per image)."""

    ratio: int  # <img_ratio_k>
    vae_pixels: torch.Tensor  # fp32 [3, H, W] in [-1, 1]
    vit_pixels: torch.Tensor  # fp32 [P, 3 * p * p]
    vit_mask: torch.Tensor  # [P] (1: a real patch)
    vit_grid: tuple[int, int]  # (h_p, w_p) patches
    downsample: int
    original: tuple[int, int] | None = None  # the image's own (width, height), where known (`preprocess`)

    @property
    def shape(self) -> BlockShape:
        grid = (self.vae_pixels.shape[1] // self.downsample, self.vae_pixels.shape[2] // self.downsample)
        return BlockShape(self.ratio, grid, self.vit_grid, self.vit_pixels.shape[0])


def vit_processor(config: HunyuanConfig) -> Any:
    """transformers' Siglip2 image processor with the checkpoint's ``vit_processor`` settings (PIL backend)."""
    from transformers.models.siglip2.image_processing_pil_siglip2 import (
        Siglip2ImageProcessorPil,
    )

    settings = dict(config.raw.get("vit_processor") or {})
    if not settings:
        raise ValueError("config.json has no 'vit_processor' section: this checkpoint cannot read images")
    return Siglip2ImageProcessorPil(**{k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")})


def vae_bucket(width: int, height: int, config: HunyuanConfig, num_ratios: int) -> int:
    """The ratio index whose (drawable) size has the height/width ratio nearest the image's."""
    sizes = ratio_sizes(config.image_base_size, num_ratios)
    valid = drawable(config.image_base_size, num_ratios, config.vae_downsample)
    return min(valid, key=lambda i: abs(sizes[i][1] / sizes[i][0] - height / width))


def cover_crop(image: Any, width: int, height: int) -> Any:
    """`image` scaled (Lanczos) to cover ``width x height`` with its aspect ratio kept, then its centre
    cut out (offsets rounded half to even, as Python rounds): the release's default for an input image's VAE branch."""
    from PIL import Image

    if image.height / image.width < height / width:  # wider than the target: match heights
        scaled = (int(round(height / image.height * image.width)), height)
    else:
        scaled = (width, int(round(width / image.width * image.height)))
    left, top = int(round((scaled[0] - width) / 2.0)), int(round((scaled[1] - height) / 2.0))
    return image.resize(scaled, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height))


def preprocess(image: Any, config: HunyuanConfig, num_ratios: int, processor: Any | None = None, stretch: bool = False) -> CondImage:
    """A PIL image -> `CondImage` (the VAE branch's bucket and pixels, the ViT branch's patches).
    `stretch` (``align_image_size``): the VAE branch scales the image to its bucket's size without
    keeping its aspect ratio instead of `cover_crop`; the ViT branch takes the whole image either way."""
    import numpy as np
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise TypeError(f"an image must be a PIL image, got {type(image).__name__}")
    image = image.convert("RGB")
    ratio = vae_bucket(image.width, image.height, config, num_ratios)
    width, height = ratio_sizes(config.image_base_size, num_ratios)[ratio]
    fitted = image.resize((width, height), Image.Resampling.LANCZOS) if stretch else cover_crop(image, width, height)
    pixels = np.asarray(fitted, dtype=np.float32) / 255.0
    vae_pixels = torch.from_numpy(pixels).permute(2, 0, 1).contiguous() * 2.0 - 1.0
    out = (processor or vit_processor(config))(images=[image], return_tensors="pt")
    grid = out["spatial_shapes"][0].tolist()
    return CondImage(
        ratio=ratio,
        vae_pixels=vae_pixels,
        vit_pixels=out["pixel_values"][0].float(),
        vit_mask=out["pixel_attention_mask"][0],
        vit_grid=(int(grid[0]), int(grid[1])),
        downsample=config.vae_downsample,
        original=(image.width, image.height),
    )


@attrs.frozen
class BlockShape:
    """What an image block's token layout depends on: the ratio token, the VAE grid, the ViT grid and
    slot count (a `CondImage`'s, or vLLM's per-item data)."""

    ratio: int
    vae_grid: tuple[int, int]
    vit_grid: tuple[int, int]
    vit_slots: int

    @property
    def slots(self) -> int:
        """The embedded run: VAE slots, ``<joint_img_sep>``, ViT slots."""
        return self.vae_grid[0] * self.vae_grid[1] + 1 + self.vit_slots

    @property
    def length(self) -> int:
        return HEAD_TOKENS + self.slots + 1

    def ids(self, tokens: SpecialTokens) -> list[int]:
        """The token ids an image's ``<img>`` placeholder becomes."""
        h, w = self.vae_grid
        return [
            tokens.boi, tokens.size, tokens.ratios[self.ratio], tokens.timestep,
            *([tokens.image] * (h * w)), tokens.joint_img_sep, *([tokens.image] * self.vit_slots), tokens.eoi,
        ]

    def positions(self, start: int) -> torch.Tensor:
        """``[length, 2]`` (y, x) positions of the block whose ``<boi>`` is at index `start`."""
        positions = torch.arange(start, start + self.length)[:, None].repeat(1, 2)
        h, w = self.vae_grid
        vae = HEAD_TOKENS
        positions[vae : vae + h * w] = image_positions(start + vae, h, w)
        vit = vae + h * w + 1
        hp, wp = self.vit_grid
        positions[vit : vit + hp * wp] = image_positions(start + vit, hp, wp)
        return positions

    def span(self, start: int) -> tuple[int, int]:
        """[first VAE slot, last ViT slot + 1): the tokens that attend both ways, for ``<boi>`` at `start`."""
        return start + HEAD_TOKENS, start + HEAD_TOKENS + self.slots


def i2t_prompt_ids(tokenizer: Any, tokens: SpecialTokens, prompt: str, images: int, system: str | None = None) -> list[int]:
    """The Instruct template with images: ``<bos>{system}\n\nUser: <img>*n{prompt}\n\nAssistant: `` (each
    piece tokenized on its own, `omni_hunyuan.prompt.instruct_text`; each ``<img>`` becomes an image block)."""
    from omni_hunyuan.prompt import instruct_text

    return instruct_text(tokenizer, tokens, prompt, system=system, images=images).ids


class Aligner(nn.Module):
    """``vision_aligner``: the release's LightProjector, ``mlp_gelu`` (Linear, then GELU-Linear x depth-1,
    ``layers.{i}.*``) or ``linear`` (one Linear, ``layers.*``)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        super().__init__()
        kind = settings.get("projector_type", "mlp_gelu")
        if kind not in ("mlp_gelu", "linear"):
            raise ValueError(f"vit_aligner projector_type {kind!r} is not supported (mlp_gelu, linear)")
        width, out = int(settings["input_dim"]), int(settings["n_embed"])
        self.layers: nn.Module = nn.Linear(width, out)
        if kind == "mlp_gelu":
            layers: list[nn.Module] = [self.layers]
            for _ in range(int(settings.get("depth", 2)) - 1):
                layers += [nn.GELU(), nn.Linear(out, out)]
            self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def vit_config(section: Mapping[str, Any]) -> Any:
    """transformers' ``Siglip2VisionConfig`` of the release config's ``vit`` section, less ``model_type`` and
    ``use_return_dict``: the release stores that (its own Siglip2 tower reads it as a plain attribute), and
    on a transformers config it is a read-only property, which the constructor refuses."""
    from transformers import Siglip2VisionConfig

    return Siglip2VisionConfig(**{k: v for k, v in section.items() if k not in ("model_type", "use_return_dict")})


# How the release's code lets an input image's tokens attend (config.json ``cond_image_type`` /
# ``cond_token_attn_type``): this module builds the ``vae_vit`` block with one two-way span over its VAE
# slots, separator and ViT slots (``joint_full``); the release's other kinds are refused, not approximated.
COND_IMAGE_TYPE, COND_TOKEN_ATTN_TYPE = "vae_vit", "joint_full"


def image_block_refusal(raw: Mapping[str, Any]) -> str | None:
    """Why this checkpoint's input images cannot be read as it asks (config.json ``raw``), or None."""
    # (absent, the release's code takes "vae_vit" and "full")
    kinds = (raw.get("cond_image_type", "vae_vit"), raw.get("cond_token_attn_type", "full"))
    if kinds == (COND_IMAGE_TYPE, COND_TOKEN_ATTN_TYPE):
        return None
    return (
        f"this checkpoint's config.json asks for input images as cond_image_type {kinds[0]!r} attending as "
        f"cond_token_attn_type {kinds[1]!r}; Omni reads them only as {COND_IMAGE_TYPE!r} / {COND_TOKEN_ATTN_TYPE!r}"
    )


class ImageEncoder(nn.Module):
    """The modules that turn a `CondImage` into its embedded run, with the checkpoint's weights:
    the VAE (its encoder), ``patch_embed`` and ``time_embed``, ``timestep_emb`` (the ``<timestep>``
    slot), the Siglip2 tower and the aligner."""

    def __init__(self, config: HunyuanConfig) -> None:
        super().__init__()
        from transformers import Siglip2VisionModel

        from omni_hunyuan.vae import build_vae

        vit = config.raw.get("vit") or {}
        if not vit or not config.raw.get("vit_aligner"):
            raise ValueError("config.json has no 'vit' / 'vit_aligner' sections: this checkpoint cannot read images")
        self.refusal = image_block_refusal(config.raw)  # (the input processor refuses such requests first)
        self.config = config
        self.vae = build_vae(config.vae, parts=("encoder",))
        self.vision_model = Siglip2VisionModel(vit_config(vit))
        self.vision_aligner = Aligner(dict(config.raw["vit_aligner"]))
        self.patch_embed = UNetDown(config.latent_channels, config.hidden_size, config.patch_embed_hidden_dim)
        self.time_embed = TimestepEmbedder(config.hidden_size)
        self.timestep_emb = TimestepEmbedder(config.hidden_size)

    @classmethod
    def from_pretrained(cls, model_path: str | Path, device: Any = "cpu", dtype: torch.dtype = torch.float32) -> ImageEncoder:
        """The encoder with the checkpoint's weights: the VAE in fp32, the rest in `dtype`."""
        from omni_hunyuan.vae import load_vae
        from omni_hunyuan.weights import read_tensors

        encoder = cls(HunyuanConfig.from_pretrained(model_path))
        rest = tuple(prefix for prefix in ENCODER_PREFIXES if prefix != "vae.")
        result = encoder.load_state_dict(read_tensors(model_path, rest), strict=False)
        missing = [key for key in result.missing_keys if not key.startswith("vae.")]
        if missing or result.unexpected_keys:
            raise ValueError(f"image encoder weights do not match: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
        encoder.vae = load_vae(model_path, encoder.config.vae, device=str(device), parts=("encoder",))  # fp32
        for name, module in encoder.named_children():
            if name != "vae":
                module.to(device=device, dtype=dtype)
        return encoder.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.model[0].weight.dtype

    @torch.no_grad()
    def timestep_token(self) -> torch.Tensor:
        """``[hidden]``: the ``<timestep>`` slot's embedding (timestep 0)."""
        return self.timestep_emb(torch.zeros(1, device=self.patch_embed.model[0].weight.device))[0].to(self.dtype)

    @torch.no_grad()
    def embed(self, image: CondImage, separator: torch.Tensor, seed: int | torch.Generator = 0) -> torch.Tensor:
        """``[slots, hidden]``: VAE tokens, `separator` (``<joint_img_sep>``'s word embedding), ViT tokens.
        The VAE latent is a sample drawn from `seed` (a generator: the next draw of it)."""
        if self.refusal:
            raise ValueError(self.refusal)
        device = self.patch_embed.model[0].weight.device
        pixels = image.vae_pixels.to(device=device, dtype=torch.float32)[None]  # [1, 3, H, W]
        generator = seed if isinstance(seed, torch.Generator) else torch.Generator(device).manual_seed(seed)
        latents = self.vae.sample_latents(pixels, generator)
        t = torch.zeros(1, device=device)
        vae_tokens = self.patch_embed(latents.to(self.dtype), self.time_embed(t).to(self.dtype))[0]
        mask = image.vit_mask.to(device)
        hidden = self.vision_model(
            pixel_values=image.vit_pixels.to(device=device, dtype=self.dtype)[None],
            pixel_attention_mask=mask[None],
            spatial_shapes=torch.tensor([image.vit_grid], device=device),
        ).last_hidden_state[0]
        # (the padding slots keep what the tower gives them, as in the release: only the keys are masked)
        vit_tokens = self.vision_aligner(hidden)
        return torch.cat([vae_tokens, separator.to(self.dtype)[None], vit_tokens.to(self.dtype)])


@attrs.frozen
class Prompt:
    """A prompt with image blocks laid out: ids, embeddings, (y, x) positions, bidirectional spans."""

    ids: list[int]
    embeds: torch.Tensor  # [S, hidden]
    positions: torch.Tensor  # [S, 2]
    spans: tuple[tuple[int, int], ...]


def layout(
    ids: list[int], images: list[CondImage], tokens: SpecialTokens, wte: nn.Embedding, encoder: ImageEncoder,
    seed: int | torch.Generator = 0,
) -> Prompt:
    """Replace each ``<img>`` of `ids` (one per image, in order) by its block, embedded (the VAE
    latents: each a sample seeded with `seed`, or, given a generator, its next draws in order)."""
    placeholders = [i for i, t in enumerate(ids) if t == tokens.image]
    if len(placeholders) != len(images):
        raise ValueError(f"the prompt has {len(placeholders)} <img> placeholders for {len(images)} images")
    device = wte.weight.device
    out_ids: list[int] = []
    pieces: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []
    cursor = 0
    separator = wte(torch.tensor([tokens.joint_img_sep], device=device))[0]
    for where, image in zip(placeholders, images):
        text = ids[cursor:where]
        if text:
            pieces.append(wte(torch.tensor(text, device=device)))
            positions.append(torch.arange(len(out_ids), len(out_ids) + len(text))[:, None].repeat(1, 2))
            out_ids += text
        start = len(out_ids)
        shape = image.shape
        block = shape.ids(tokens)
        head = wte(torch.tensor(block[: HEAD_TOKENS - 1], device=device))
        pieces += [head, encoder.timestep_token()[None], encoder.embed(image, separator, seed), wte(torch.tensor([tokens.eoi], device=device))]
        positions.append(shape.positions(start))
        spans.append(shape.span(start))
        out_ids += block
        cursor = where + 1
    text = ids[cursor:]
    if text:
        pieces.append(wte(torch.tensor(text, device=device)))
        positions.append(torch.arange(len(out_ids), len(out_ids) + len(text))[:, None].repeat(1, 2))
        out_ids += text
    embeds = torch.cat([p.to(wte.weight.dtype) for p in pieces])
    return Prompt(out_ids, embeds, torch.cat(positions).to(device), tuple(spans))
