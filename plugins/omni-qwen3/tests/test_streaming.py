"""The whole Qwen3-Omni pipeline streams: the talker starts on the thinker's first chunks, code2wav
on the talker's first frames, and the streamed result equals transformers' (and streaming off).

Each stage runs in its own process (the default deploy file) on the tiny checkpoint; the thinker
is made to answer at length (``ignore_eos``) so that audio can start well before the text ends.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import vllm  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)
import transformers  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)

from omni_core.engine.async_engine import AsyncOmniEngine  # noqa: E402
from omni_core.engine.request import OmniRequest  # noqa: E402
from omni_qwen3.reference import ReferenceOutput, reference_generate  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400), pytest.mark.asyncio(loop_scope="module")]

MESSAGES = [{"role": "user", "content": "Hello world, what is this?"}]
THINKER_TOKENS = 160
TALKER_TOKENS = 40
# Small code2wav chunks: the first audio after 8 frames (the default is 25).
OVERRIDES = ("code2wav.chunk_size=8",)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> ReferenceOutput:
    ref = reference_generate(
        tiny_dir, MESSAGES, max_new_tokens=THINKER_TOKENS, talker_max_new_tokens=TALKER_TOKENS
    )
    # The tiny thinker never says <|im_end|> here, so ignore_eos changes nothing but the length.
    assert len(ref.thinker_ids) == THINKER_TOKENS
    assert ref.codes is not None and ref.codes.shape[1] > 8 and len(np.unique(ref.codes[0])) > 2
    return ref


def _request() -> OmniRequest:
    return OmniRequest(
        messages=MESSAGES,
        modalities=("text", "audio"),
        params={
            "thinker": {"max_tokens": THINKER_TOKENS, "ignore_eos": True, "temperature": 0.0},
            "talker": {"max_tokens": TALKER_TOKENS, "temperature": 0.0},
        },
    )


async def _generate(tiny_dir: Path, streaming: bool) -> list[tuple[float, Any]]:
    overrides = (*OVERRIDES, f"streaming={'true' if streaming else 'false'}")
    async with AsyncOmniEngine.from_model(str(tiny_dir), overrides=overrides) as engine:
        return [(time.monotonic(), delta) async for delta in engine.generate(_request())]


def _result(deltas: list[tuple[float, Any]]) -> tuple[list[int], np.ndarray]:
    tokens = [t for _, d in deltas if d.modality == "text" for t in d.data.get("token_ids", [])]
    audio = [d.data["audio"] for _, d in deltas if d.modality == "audio" and "audio" in d.data]
    return tokens, np.concatenate(audio)


async def test_audio_streams_before_the_text_ends_and_equals_transformers(tiny_dir: Path, reference: ReferenceOutput) -> None:
    deltas = await _generate(tiny_dir, streaming=True)
    text = [i for i, (_, d) in enumerate(deltas) if d.modality == "text"]
    audio = [i for i, (_, d) in enumerate(deltas) if d.modality == "audio" and len(d.data.get("audio", ())) > 0]
    assert len(text) > 10 and len(audio) > 3  # both streamed in many pieces
    # The first audio came before the thinker's last text: talker and code2wav ran alongside it.
    assert audio[0] < text[-1], (audio[0], text[-1])
    tokens, waveform = _result(deltas)
    assert tokens == reference.thinker_ids
    assert reference.waveform is not None and waveform.shape == reference.waveform.shape
    np.testing.assert_allclose(waveform, reference.waveform, atol=1e-5)
    assert deltas[-1][1].final


async def test_streaming_off_gives_the_same_result(tiny_dir: Path, reference: ReferenceOutput) -> None:
    deltas = await _generate(tiny_dir, streaming=False)
    assert sum(d.modality == "audio" for _, d in deltas) == 1  # one final audio chunk
    tokens, waveform = _result(deltas)
    assert tokens == reference.thinker_ids
    assert reference.waveform is not None
    np.testing.assert_allclose(waveform, reference.waveform, atol=1e-5)
