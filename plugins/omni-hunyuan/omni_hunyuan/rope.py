"""2-D rotary positions of HunyuanImage-3.0's joint text/image sequence.

Every token has a (y, x) position. A text token at sequence index i has y = x = i, so text alone is
ordinary 1-D RoPE (and equals transformers' default rope on the same weights). An image of h x w
tokens that starts at index L sits on a grid centred in the span it occupies:
``y = L + (h*w - h) // 2 + row`` and ``x = L + (h*w - w) // 2 + col``. Of the head_dim/2 rotary
frequencies, the even ones turn with y and the odd ones with x; the angles use the half-split
(``rotate_half``) layout, and everything is computed in fp32 whatever the model dtype.
"""

from __future__ import annotations

import torch


def text_positions(start: int, length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[length, 2]`` (y, x) positions of text tokens at indexes start .. start+length-1."""
    index = torch.arange(start, start + length, device=device)
    return torch.stack([index, index], dim=-1)


def image_positions(start: int, height: int, width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[height*width, 2]`` (y, x) positions of an image's tokens (row-major) starting at index `start`."""
    span = height * width
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    # The grid offsets are floor((span - side) / 2): the release computes them in floats and truncates.
    y = start + (span - height) // 2 + rows
    x = start + (span - width) // 2 + cols
    return torch.stack([y, x], dim=-1)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[..., seq, head_dim]`` for (y, x) positions ``[..., seq, 2]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    # Frequency j turns with y when j is even, with x when j is odd.
    axis = torch.arange(head_dim // 2, device=positions.device) % 2
    coordinate = positions.float()[..., axis]  # [..., seq, head_dim/2]
    angles = coordinate * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [batch, heads, seq, head_dim]`` by tables ``[batch, seq, head_dim]``; fp32 out."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x.float() * cos + rotated * sin
