"""Which image size each ``<img_ratio_k>`` token stands for (the release's resolution group).

From ``image_base_size`` B (1024 in the release) with a step of B/16: B x B, then 16 sizes growing
the height and shrinking the width by a step each (down to 2B tall, B/2 wide), and 16 the other way
round; sorted by height/width, index k is ``<img_ratio_k>``: 33 sizes. Instruct checkpoints add
four at indices 33..36 (1024x768, 1280x720, 768x1024, 720x1280 as height x width at B=1024; scaled
with B here, so a tiny checkpoint has them too). Sizes are (width, height), as the API takes them.
"""

from __future__ import annotations

import functools
import math

from omni_hunyuan.tokens import NUM_BASE_RATIOS

RATIO_TAIL_PARAM = "ratio_tail"
"""The ``ar`` stage parameter the input processor sets for think/recaption-then-draw (never a user's):
the settings of its ratio step, `omni_hunyuan.ratio_tail`."""

INSTRUCT_EXTRA = ((1024, 768), (1280, 720), (768, 1024), (720, 1280))  # (height, width) at B = 1024


@functools.lru_cache(maxsize=8)
def ratio_sizes(base_size: int, num_ratios: int = NUM_BASE_RATIOS) -> tuple[tuple[int, int], ...]:
    """(width, height) of ``<img_ratio_0>`` .. ``<img_ratio_{num_ratios-1}>``."""
    step = base_size // 16
    low, high = base_size // 2, base_size * 2
    sizes = [(base_size, base_size)]  # (height, width)
    for grow_height in (True, False):
        height = width = base_size
        while (height < high or width > low) if grow_height else (height > low or width < high):
            if grow_height:
                height, width = min(height + step, high), max(width - step, low)
            else:
                height, width = max(height - step, low), min(width + step, high)
            sizes.append((height, width))
    sizes.sort(key=lambda hw: hw[0] / hw[1])
    for height, width in INSTRUCT_EXTRA[: max(0, num_ratios - len(sizes))]:
        scaled = (height * base_size // 1024, width * base_size // 1024)
        if all(h / w != scaled[0] / scaled[1] for h, w in sizes):
            sizes.append(scaled)
    return tuple((width, height) for height, width in sizes[:num_ratios])


def drawable(base_size: int, num_ratios: int, multiple: int) -> tuple[int, ...]:
    """Ratio indices whose size the VAE can draw (both sides multiples of `multiple`)."""
    return tuple(i for i, (w, h) in enumerate(ratio_sizes(base_size, num_ratios)) if w % multiple == 0 and h % multiple == 0)


def ratio_index(size: tuple[int, int], base_size: int, num_ratios: int, multiple: int) -> int:
    """The index of `size` ((width, height)) in the table; ValueError naming the nearest drawable size."""
    sizes = ratio_sizes(base_size, num_ratios)
    valid = drawable(base_size, num_ratios, multiple)
    if size in sizes and sizes.index(size) in valid:
        return sizes.index(size)
    width, height = size
    nearest = min(valid, key=lambda i: abs(sizes[i][1] / sizes[i][0] - height / max(width, 1)))
    shown = ", ".join(f"{w}x{h}" for w, h in (sizes[i] for i in valid[:3]))
    raise ValueError(
        f"this checkpoint draws the {len(valid)} sizes of its resolution table ({shown}, ...: image_base_size "
        f"{base_size}); {width}x{height} is not one of them; nearest: {sizes[nearest][0]}x{sizes[nearest][1]}"
    )


def aligned_size(ratio: int, images: list[tuple[int, tuple[int, int]]], base_size: int, num_ratios: int) -> tuple[int, int] | None:
    """The release's ``infer_align_image_size`` after decoding: the (width, height) an image drawn at
    `ratio` is resized to, or None. `images`: the input images' (ratio index, (width, height) of their
    own). The first input image of the same ratio index decides: when its height/width ratio differs
    from the drawn size's by 0.01 or more, its own aspect ratio at about ``base_size**2`` pixels."""
    width, height = ratio_sizes(base_size, num_ratios)[ratio]
    for index, (own_width, own_height) in images:
        if index != ratio:
            continue
        if abs(own_height / own_width - height / width) < 0.01:
            return None
        scale = math.sqrt(base_size**2 / (own_width * own_height))
        return round(own_width * scale), round(own_height * scale)
    return None
