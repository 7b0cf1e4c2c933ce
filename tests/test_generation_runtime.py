"""`GenerationStageRuntime` driven directly with the toy vocoder (no vLLM, no engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.errors import InvalidRequestError, StageError
from omni_core.outputs import Chunk, StageInput
from omni_core.stages.generation import GenerationOptions, GenerationStageRuntime
from omni_toy.vocoder import ToyVocoder, VocoderConfig, write_vocoder

VOCAB = 96
HIDDEN = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("toy")
    write_vocoder(root / "vocoder", vocab_size=VOCAB, input_hidden_size=HIDDEN, seed=3)
    return root


def make_runtime(checkpoint: Path, streaming: bool = True, **options: Any) -> GenerationStageRuntime:
    stage = ResolvedStage(
        name="vocoder",
        kind="generation",
        runtime_ref="omni_core.stages.generation:GenerationStageRuntime",
        model="omni_toy.vocoder:ToyVocoder",
        output="audio",
        final=True,
        placement="inline",
        options=options,
    )
    pipeline = ResolvedPipeline(
        model=str(checkpoint), model_path=str(checkpoint), family="toy", stages=(stage,), streaming=streaming
    )
    runtime = GenerationStageRuntime(pipeline, stage)
    runtime.load()
    return runtime


def vocoder(runtime: GenerationStageRuntime) -> ToyVocoder:
    assert isinstance(runtime.model, ToyVocoder)
    return runtime.model


def full_decode(runtime: GenerationStageRuntime, codes: torch.Tensor) -> np.ndarray:
    """Reference: the whole sequence through the network at once, alone."""
    net = vocoder(runtime).net
    assert net is not None
    with torch.inference_mode():
        return net(net.features(codes[None]))[0].numpy()


def run_to_end(runtime: GenerationStageRuntime, feeds: list[tuple[str, StageInput]]) -> dict[str, list[Chunk]]:
    """Feed one input per step (interleaving input and decode), then step until idle."""
    chunks: dict[str, list[Chunk]] = {}
    started: set[str] = set()
    pending = list(feeds)
    for _ in range(1000):
        if pending:
            request_id, stage_input = pending.pop(0)
            if request_id in started:
                runtime.extend_request(request_id, stage_input)
            else:
                runtime.add_request(request_id, stage_input)
                started.add(request_id)
        if runtime.has_unfinished():
            for chunk in runtime.step():
                chunks.setdefault(chunk.request_id, []).append(chunk)
        elif not pending:
            return chunks
    raise AssertionError("the runtime did not finish")


def uneven_feeds(codes: dict[str, torch.Tensor], seed: int) -> list[tuple[str, StageInput]]:
    """Each request's codes in random-sized pieces, the requests interleaved."""
    rng = np.random.default_rng(seed)
    per_request: dict[str, list[StageInput]] = {}
    for request_id, sequence in codes.items():
        pieces, start = [], 0
        while start < len(sequence):
            size = int(rng.integers(1, 7))
            pieces.append(sequence[start : start + size])
            start += size
        per_request[request_id] = [
            StageInput(data={"codes": piece}, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)
        ]
    feeds = []
    while any(per_request.values()):
        for request_id, inputs in per_request.items():
            if inputs:
                feeds.append((request_id, inputs.pop(0)))
    return feeds


def random_codes(lengths: dict[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {rid: torch.randint(0, VOCAB, (n,), generator=generator) for rid, n in lengths.items()}


def joined(chunks: list[Chunk]) -> np.ndarray:
    return np.concatenate([chunk.data["audio"] for chunk in chunks])


def assert_well_formed(chunks: list[Chunk]) -> None:
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(c.error is None and c.data["sample_rate"] == 16000 for c in chunks)
    assert all(c.data["audio"].dtype == np.float32 and c.data["audio"].ndim == 1 for c in chunks)


def test_chunked_batched_decode_equals_full_decode(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint)
    config = vocoder(runtime).config
    assert runtime.left_context >= config.receptive_field - 1  # the premise of seamless chunks
    codes = random_codes({"a": 1, "b": 5, "c": 23, "d": 40})
    chunks = run_to_end(runtime, uneven_feeds(codes, seed=1))

    assert set(chunks) == set(codes)
    for request_id, sequence in codes.items():
        assert_well_formed(chunks[request_id])
        audio = joined(chunks[request_id])
        assert audio.shape == (len(sequence) * config.samples_per_frame,)
        np.testing.assert_allclose(audio, full_decode(runtime, sequence), atol=1e-5, rtol=0)
    # streaming: the long request came out in several chunks of at most chunk_size frames
    sizes = [len(c.data["audio"]) // config.samples_per_frame for c in chunks["d"]]
    assert len(sizes) >= 40 // runtime.chunk_size and max(sizes) <= runtime.chunk_size
    assert not runtime.has_unfinished() and not runtime._requests


def test_too_little_left_context_shows_at_chunk_boundaries(checkpoint: Path) -> None:
    # Guards the test above: without enough context the chunked output does differ.
    runtime = make_runtime(checkpoint, left_context=0)
    codes = random_codes({"a": 24})
    chunks = run_to_end(runtime, [("a", StageInput(data={"codes": codes["a"]}, final=True))])
    assert not np.allclose(joined(chunks["a"]), full_decode(runtime, codes["a"]), atol=1e-5)


def test_streaming_and_non_streaming_give_the_same_audio(checkpoint: Path) -> None:
    codes = random_codes({"a": 9, "b": 30, "c": 2}, seed=5)
    streamed = run_to_end(make_runtime(checkpoint, streaming=True), uneven_feeds(codes, seed=2))
    runtime = make_runtime(checkpoint, streaming=False)
    whole = run_to_end(runtime, uneven_feeds(codes, seed=3))
    for request_id in codes:
        assert len(whole[request_id]) == 1 and whole[request_id][0].final
        assert len(streamed[request_id]) > 1 or len(codes[request_id]) <= runtime.chunk_size
        np.testing.assert_allclose(joined(whole[request_id]), joined(streamed[request_id]), atol=1e-5, rtol=0)
    # non-streaming waits for the final input: partial input is not work
    runtime.add_request("x", StageInput(data={"codes": codes["b"]}, final=False))
    assert not runtime.has_unfinished()


def test_one_forward_per_step_for_the_whole_batch(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint, max_batch_size=2, chunk_size=4)
    model = vocoder(runtime)

    codes = random_codes({"a": 8, "b": 8, "c": 8})
    for request_id, sequence in codes.items():
        runtime.add_request(request_id, StageInput(data={"codes": sequence}, final=True))
    served: list[list[str]] = []
    steps = 0
    while runtime.has_unfinished():
        served.append([c.request_id for c in runtime.step()])
        steps += 1
    assert steps == 3
    assert model.batch_sizes == [2, 2, 2]  # 6 chunks of 4 frames, 2 per step
    # the request left out of a full batch is served first at the next step
    assert served[0] == ["a", "b"] and served[1][0] == "c"


def test_first_chunk_catch_up_and_frame_budget_keep_the_audio_exact(checkpoint: Path) -> None:
    """A small first chunk, catch-up chunks and a per-step frame budget change only the chunking."""
    runtime = make_runtime(checkpoint, chunk_size=4, first_chunk_size=2, max_chunk_size=10, max_batch_frames=20)
    model = vocoder(runtime)
    spf = model.config.samples_per_frame
    codes = random_codes({"a": 26, "b": 26, "c": 26}, seed=7)

    # "a" streams in 1 frame at a time: a 2-frame first chunk, then chunks of 4.
    first = run_to_end(runtime, [("a", StageInput(data={"codes": codes["a"][i : i + 1]}, final=i == 25)) for i in range(26)])
    sizes = [len(c.data["audio"]) // spf for c in first["a"]]
    assert sizes[0] == 2 and set(sizes[1:-1]) == {4}
    np.testing.assert_allclose(joined(first["a"]), full_decode(runtime, codes["a"]), atol=1e-5, rtol=0)

    # All frames already there (the stage is behind): chunks of up to 10 frames catch up, and the
    # 20-frame budget (rows x the longest row, left context included: two 10-frame first chunks fit,
    # two rows of 16 + 10 do not) splits what would be one batch of two.
    model.batch_sizes.clear()
    for request_id in ("b", "c"):
        runtime.add_request(request_id, StageInput(data={"codes": codes[request_id]}, final=True))
    chunks: dict[str, list[Chunk]] = {}
    while runtime.has_unfinished():
        for chunk in runtime.step():
            chunks.setdefault(chunk.request_id, []).append(chunk)
    for request_id in ("b", "c"):
        assert_well_formed(chunks[request_id])
        assert [len(c.data["audio"]) // spf for c in chunks[request_id]] == [10, 10, 6]
        np.testing.assert_allclose(joined(chunks[request_id]), full_decode(runtime, codes[request_id]), atol=1e-5, rtol=0)
    assert max(model.batch_sizes) == 2 and 1 in model.batch_sizes  # the budget held one back at least once


def test_waiting_requests_are_idle(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint, chunk_size=4)
    codes = random_codes({"a": 6})["a"]
    runtime.add_request("a", StageInput(data={"codes": codes[:3]}, final=False))
    assert not runtime.has_unfinished()  # 3 < chunk_size frames and more input to come
    runtime.extend_request("a", StageInput(data={"codes": codes[3:5]}, final=False))
    assert runtime.has_unfinished()
    [first] = runtime.step()
    assert not first.final and len(first.data["audio"]) == 4 * 8
    assert not runtime.has_unfinished()  # 1 frame left, input not final
    runtime.extend_request("a", StageInput(data={"codes": codes[5:]}, final=True))
    [last] = runtime.step()
    assert last.final and last.index == 1 and len(last.data["audio"]) == 2 * 8
    assert not runtime.has_unfinished()


def test_final_input_without_new_frames_closes_the_stream(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint, chunk_size=4)
    forgotten: list[str] = []
    runtime.model.forget = forgotten.append  # type: ignore[method-assign]  # (a spy on this test's own model)
    runtime.add_request("a", StageInput(data={"codes": torch.arange(4)}, final=False))
    [first] = runtime.step()
    runtime.extend_request("a", StageInput(data={}, final=True))
    [last] = runtime.step()
    assert not first.final and last.final and last.index == 1 and last.data["audio"].shape == (0,)
    # The model drops the request's state (a streaming decoder's caches: the soak's code2wav leak).
    assert forgotten == ["a"]
    runtime.add_request("empty", StageInput(data={"codes": torch.zeros(0, dtype=torch.long)}, final=True))
    [only] = runtime.step()
    assert only.final and only.error is None and only.data["audio"].shape == (0,)


def test_token_id_lists_as_an_ar_stage_sends_them_decode_like_codes(checkpoint: Path) -> None:
    # An ar stage's chunks: each step's new token ids as a list, some steps none, the last often
    # empty; fed with no edge adapter (the default passes chunk data through).
    runtime = make_runtime(checkpoint, chunk_size=4)
    codes = random_codes({"a": 9}, seed=5)["a"]
    ids = codes.tolist()
    pieces = [ids[:1], [], ids[1:2], ids[2:6], [], ids[6:9], []]
    feeds = [("a", StageInput(data={"codes": piece, "text": "x"}, final=i == len(pieces) - 1)) for i, piece in enumerate(pieces)]
    chunks = run_to_end(runtime, feeds)["a"]
    assert_well_formed(chunks)
    np.testing.assert_allclose(joined(chunks), full_decode(runtime, codes), atol=1e-5)


def test_abort_frees_the_request(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint, chunk_size=4)
    runtime.add_request("a", StageInput(data={"codes": torch.arange(10)}, final=False))
    runtime.add_request("b", StageInput(data={"codes": torch.arange(10)}, final=True))
    runtime.step()
    runtime.abort_request("a")
    runtime.abort_request("unknown")  # ignored
    assert "a" not in runtime._requests
    runtime.extend_request("a", StageInput(data={"codes": torch.arange(3)}, final=True))  # late input: dropped
    ids = {c.request_id for _ in range(5) if runtime.has_unfinished() for c in runtime.step()}
    assert ids == {"b"} and not runtime._requests and not runtime.has_unfinished()


def test_buffers_keep_only_the_left_context(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint, chunk_size=4)
    runtime.add_request("a", StageInput(data={"codes": torch.randint(0, VOCAB, (100,))}, final=False))
    while runtime.has_unfinished():
        runtime.step()
    request = runtime._requests["a"]
    assert request.emitted == 100 and request.frames is not None
    assert request.frames.shape[0] == runtime.left_context and request.base == 100 - runtime.left_context


@pytest.mark.parametrize(
    "data",
    [
        {},  # no codes
        {"codes": torch.tensor([0, VOCAB])},  # out of the vocabulary
        {"codes": torch.tensor(3)},  # no frame dimension
        {"codes": torch.zeros(4, HIDDEN + 1)},  # hidden states of the wrong width
        {"codes": "not frames"},
    ],
)
def test_bad_input_is_rejected_at_add(checkpoint: Path, data: dict[str, Any]) -> None:
    runtime = make_runtime(checkpoint)
    with pytest.raises(InvalidRequestError):
        runtime.add_request("bad", StageInput(data=data))
    assert not runtime._requests and not runtime.has_unfinished()


def test_bad_params_are_rejected_at_add(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint)
    for params in ({"fail": "invalid"}, {"fail": "no such mode"}):
        with pytest.raises(InvalidRequestError) as info:
            runtime.add_request("bad", StageInput(data={"codes": torch.arange(2)}, params=params))
        assert info.value.param == "fail"
    assert not runtime._requests


def test_bad_streamed_input_drops_the_request(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint)
    runtime.add_request("a", StageInput(data={"codes": torch.arange(2)}, final=False))
    with pytest.raises(InvalidRequestError, match="changed shape or dtype"):
        runtime.extend_request("a", StageInput(data={"codes": torch.zeros(2, HIDDEN)}, final=True))
    assert not runtime._requests


def test_hidden_state_frames_decode_like_codes(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint)
    hidden = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(0))
    codes = random_codes({"c": 7})["c"]
    chunks = run_to_end(
        runtime,
        [("h", StageInput(data={"codes": hidden}, final=True)), ("c", StageInput(data={"codes": codes}, final=True))],
    )
    net = vocoder(runtime).net
    assert net is not None
    with torch.inference_mode():
        expected = net(net.features(hidden[None]))[0].numpy()
    np.testing.assert_allclose(joined(chunks["h"]), expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(joined(chunks["c"]), full_decode(runtime, codes), atol=1e-5, rtol=0)


def test_failing_request_gets_an_error_chunk_and_others_continue(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint)
    runtime.add_request("bad", StageInput(data={"codes": torch.arange(4)}, params={"fail": "request"}))
    runtime.add_request("good", StageInput(data={"codes": torch.arange(4)}))
    chunks = {c.request_id: c for c in runtime.step()}
    assert chunks["bad"].error is not None and "on purpose" in chunks["bad"].error and chunks["bad"].final
    # check() rejected the request's input: a client error naming the parameter, not a stage fault.
    assert chunks["bad"].invalid and chunks["bad"].param == "fail"
    assert chunks["good"].error is None and chunks["good"].final
    assert vocoder(runtime).batch_sizes == [1] and not runtime._requests


def test_failing_stage_raises_from_step(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint)
    runtime.add_request("a", StageInput(data={"codes": torch.arange(4)}, params={"fail": "stage"}))
    with pytest.raises(RuntimeError, match="on purpose"):
        runtime.step()


def test_options_are_validated_and_override_the_model(checkpoint: Path) -> None:
    with pytest.raises(ValueError):
        GenerationOptions(max_batch_size=0)
    with pytest.raises(ValueError):
        GenerationOptions(dtype="float8")  # type: ignore[arg-type]
    runtime = make_runtime(checkpoint, chunk_size=3, left_context=15)
    assert (runtime.chunk_size, runtime.left_context) == (3, 15)
    default = make_runtime(checkpoint)
    config = VocoderConfig.read(checkpoint / "vocoder")
    assert (default.chunk_size, default.left_context) == (config.chunk_size, config.left_context)


def test_checkpoint_dtype_loads_the_weights_as_stored(checkpoint: Path, tmp_path: Path) -> None:
    # The toy checkpoint's config names no dtype: its float32 weights decide.
    assert next(vocoder(make_runtime(checkpoint, dtype="checkpoint")).net.parameters()).dtype == torch.float32
    bf16 = tmp_path / "bf16"
    write_vocoder(bf16 / "vocoder", vocab_size=VOCAB, input_hidden_size=HIDDEN, seed=3)
    (bf16 / "config.json").write_text('{"dtype": "bfloat16"}')
    runtime = make_runtime(bf16, dtype="checkpoint")
    assert {p.dtype for p in vocoder(runtime).net.parameters()} == {torch.bfloat16}
    codes = random_codes({"a": 12})
    chunks = run_to_end(runtime, [("a", StageInput(data={"codes": codes["a"]}, final=True))])
    assert_well_formed(chunks["a"])  # float32 audio out of a bfloat16 decoder
    reference = full_decode(make_runtime(checkpoint), codes["a"])
    assert np.abs(joined(chunks["a"]) - reference).max() < 0.05 * np.abs(reference).max()


def test_use_before_load_is_a_clear_error(checkpoint: Path) -> None:
    runtime = make_runtime(checkpoint)
    runtime.close()
    with pytest.raises(StageError, match="load"):
        runtime.add_request("a", StageInput(data={"codes": torch.arange(2)}))
