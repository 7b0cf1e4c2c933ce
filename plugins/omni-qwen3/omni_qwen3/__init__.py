"""Qwen3-Omni for Omni: thinker (vLLM), talker with code predictor, code2wav.

Importing this package is cheap; the model code loads on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"
