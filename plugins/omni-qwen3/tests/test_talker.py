"""The talker stage on vLLM gives transformers' codec codes exactly, alone and batched.

The thinker's rows (input embeddings, layer ``accept_hidden_layer`` hidden states) come from
transformers' own thinker generate on the tiny checkpoint, as ``generate`` feeds the talker; the
`ThinkerToTalker` adapter turns them into the talker's input, and the `ar` runtime runs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import vllm  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)
import transformers  # noqa: F401  (missing, it fails the suite: CI never goes green by skipping)

import torch  # noqa: E402

from omni_core.config.resolved import ResolvedPipeline, ResolvedStage  # noqa: E402
from omni_core.errors import InvalidRequestError  # noqa: E402
from omni_core.outputs import Chunk, StageInput  # noqa: E402
from omni_core.parts import PartContext  # noqa: E402
from omni_core.stages.ar import ARStageRuntime  # noqa: E402
from omni_qwen3.edges import ThinkerToTalker  # noqa: E402
from omni_qwen3.reference import (  # noqa: E402
    ReferenceOutput,
    prepare_inputs,
    reference_generate,
    sine_wave,
    synthetic_image,
)

MAX_TEXT = 12
MAX_FRAMES = 16
PROMPTS: dict[str, Any] = {
    "text": [{"role": "user", "content": "Hello world, what is this?"}],
    "audio": [
        {
            "role": "user",
            "content": [{"type": "audio", "audio": sine_wave(1.0)}, {"type": "text", "text": "What is this sound?"}],
        }
    ],
    "image": [
        {
            "role": "user",
            "content": [{"type": "image", "image": synthetic_image(64, 96)}, {"type": "text", "text": "Describe it."}],
        }
    ],
}


@pytest.fixture(scope="module")
def cases(tiny_dir: Path, model: Any) -> dict[str, tuple[ReferenceOutput, Chunk]]:
    """Per prompt: the reference output and the thinker's output as one final chunk."""
    out = {}
    for name, messages in PROMPTS.items():
        ref = reference_generate(tiny_dir, messages, model=model, max_new_tokens=MAX_TEXT, talker_max_new_tokens=MAX_FRAMES)
        out[name] = (ref, _thinker_chunk(tiny_dir, model, messages, ref))
    return out


def _thinker_chunk(tiny_dir: Path, model: Any, messages: Any, ref: ReferenceOutput) -> Chunk:
    inputs = prepare_inputs(tiny_dir, messages)
    with torch.inference_mode():
        result = model.thinker.generate(
            **inputs,
            max_new_tokens=MAX_TEXT,
            do_sample=False,
            repetition_penalty=1.0,
            eos_token_id=model.config.im_end_token_id,
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
    layer = model.config.talker_config.accept_hidden_layer
    prompt_len = inputs["input_ids"].shape[1]
    generated = result.sequences[0, prompt_len:].tolist()
    assert generated == ref.thinker_ids  # the same thinker run the reference talker saw
    data = {
        "prompt_token_ids": inputs["input_ids"][0].tolist(),
        "token_ids": generated,
        "thinker_embeds": torch.cat([h[0] for h in result.hidden_states], dim=1)[0],
        "thinker_hidden": torch.cat([h[layer] for h in result.hidden_states], dim=1)[0],
        "finish_reason": "stop",
    }
    if "image_grid_thw" in inputs:  # what the thinker stage sends in its first chunk
        data["image_grid_thw"] = inputs["image_grid_thw"].tolist()
    return Chunk("req", "thinker", 0, data, final=True)


@pytest.fixture(scope="module")
def talker(tiny_dir: Path) -> Iterator[tuple[ARStageRuntime, ThinkerToTalker]]:
    stage = ResolvedStage(
        name="talker",
        kind="ar",
        runtime_ref="omni_core.stages.ar:ARStageRuntime",
        model="omni_qwen3.talker:TalkerModel",
        options={"dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 8, "max_model_len": 512},
    )
    pipeline = ResolvedPipeline(
        model=str(tiny_dir), model_path=str(tiny_dir), family="qwen3-omni", stages=(stage,), streaming=True
    )
    runtime = ARStageRuntime(pipeline, stage)
    runtime.load()
    yield runtime, ThinkerToTalker(PartContext(pipeline))
    runtime.close()


def _talker_input(adapter: ThinkerToTalker, chunk: Chunk, **params: Any) -> StageInput:
    stage_input = adapter.on_chunk({}, chunk)
    assert stage_input is not None and stage_input.final
    stage_input.params = {"max_tokens": MAX_FRAMES, "temperature": 0.0, "speaker": "Ethan", **params, **stage_input.params}
    return stage_input


def _run(runtime: ARStageRuntime, inputs: dict[str, StageInput]) -> dict[str, np.ndarray]:
    """Codes per request, ``[num_code_groups, frames]`` like the reference."""
    for rid, stage_input in inputs.items():
        runtime.add_request(rid, stage_input)
    codes: dict[str, list[torch.Tensor]] = {rid: [] for rid in inputs}
    finished = set()
    while runtime.has_unfinished():
        for chunk in runtime.step():
            assert chunk.error is None, chunk.error
            codes[chunk.request_id].append(chunk.data["codes"])
            assert chunk.data["codes"].dtype == torch.long
            if chunk.final:
                finished.add(chunk.request_id)
    assert finished == set(inputs)
    return {rid: torch.cat(parts).T.numpy() for rid, parts in codes.items()}


@pytest.mark.parametrize("name", ["text", "audio"])
def test_codes_equal_transformers(talker: Any, cases: Any, name: str) -> None:
    runtime, adapter = talker
    ref, chunk = cases[name]
    assert ref.codes is not None and len(np.unique(ref.codes[0])) >= 2
    codes = _run(runtime, {name: _talker_input(adapter, chunk)})[name]
    np.testing.assert_array_equal(codes, ref.codes)


def test_image_codes_equal_transformers(talker: Any, cases: Any) -> None:
    """Image prompts: 3-D M-RoPE positions from the thinker's image_grid_thw (first chunk)."""
    runtime, adapter = talker
    ref, chunk = cases["image"]
    assert ref.codes is not None and len(np.unique(ref.codes[0])) >= 2
    codes = _run(runtime, {"image": _talker_input(adapter, chunk)})["image"]
    np.testing.assert_array_equal(codes, ref.codes)
    # Without the grid the talker runs on text positions, and its codes differ: the test can fail.
    no_grid = Chunk(chunk.request_id, chunk.stage, 0, {k: v for k, v in chunk.data.items() if k != "image_grid_thw"}, final=True)
    assert not np.array_equal(_run(runtime, {"plain": _talker_input(adapter, no_grid)})["plain"], ref.codes)


def test_streamed_thinker_chunks_give_the_same_codes(talker: Any, cases: Any) -> None:
    """The thinker's output split per token (as it streams): the talker starts on the first chunk
    (the prompt's rows and the first token; later tokens' rows come from the thinker's token
    table), is held where its text runs out and resumed as more arrives, and still gives the
    reference's codes, next to a request fed at once in the same batch."""
    runtime, adapter = talker
    for name in ("text", "image"):
        ref, chunk = cases[name]
        pieces = _split_like_the_thinker(chunk)
        state: dict[str, Any] = {}
        codes: list[torch.Tensor] = []
        started = held_steps = 0
        runtime.add_request("whole", _talker_input(adapter, cases["audio"][1]))
        whole: list[torch.Tensor] = []
        for piece in pieces:
            stage_input = adapter.on_chunk(state, piece)
            assert stage_input is not None  # no chunk waits for the next one
            if not started:
                stage_input.params = {"max_tokens": MAX_FRAMES, "temperature": 0.0, "speaker": "Ethan"}
                runtime.add_request("streamed", stage_input)
                started = 1
            else:
                runtime.extend_request("streamed", stage_input)
            # A few engine steps per thinker chunk: the talker catches up and waits for text.
            for _ in range(3):
                if not runtime.has_unfinished():
                    held_steps += 1
                    break
                for out in runtime.step():
                    assert out.error is None, out.error
                    (codes if out.request_id == "streamed" else whole).append(out.data["codes"])
        while runtime.has_unfinished():
            for out in runtime.step():
                assert out.error is None, out.error
                (codes if out.request_id == "streamed" else whole).append(out.data["codes"])
        assert held_steps > 0  # it did wait for text
        np.testing.assert_array_equal(torch.cat(codes).T.numpy(), ref.codes)
        np.testing.assert_array_equal(torch.cat(whole).T.numpy(), cases["audio"][0].codes)


def _split_like_the_thinker(chunk: Chunk) -> list[Chunk]:
    """One final thinker chunk -> the per-step chunks a streaming thinker sends: the prompt rows
    and token 0 first, then each token with the row of the token before it."""
    data = chunk.data
    prompt_len = len(data["prompt_token_ids"])
    tokens = data["token_ids"]
    pieces = []
    for i, token in enumerate(tokens):
        rows = slice(0, prompt_len) if i == 0 else slice(prompt_len + i - 1, prompt_len + i)
        piece = {"token_ids": [token], "thinker_embeds": data["thinker_embeds"][rows], "thinker_hidden": data["thinker_hidden"][rows]}
        if i == 0:
            piece["prompt_token_ids"] = data["prompt_token_ids"]
            piece.update({k: data[k] for k in ("image_grid_thw",) if k in data})
        pieces.append(Chunk(chunk.request_id, chunk.stage, i, piece, final=i == len(tokens) - 1))
    return pieces


def test_batched_requests_equal_alone(talker: Any, cases: Any, tiny_dir: Path, model: Any) -> None:
    """Several requests at different lengths in one engine batch give each its own reference codes."""
    runtime, adapter = talker
    chelsie = reference_generate(
        tiny_dir, PROMPTS["text"], model=model, speaker="Chelsie", max_new_tokens=MAX_TEXT, talker_max_new_tokens=MAX_FRAMES
    )
    inputs = {
        "text": _talker_input(adapter, cases["text"][1]),
        "audio": _talker_input(adapter, cases["audio"][1]),
        "chelsie": _talker_input(adapter, cases["text"][1], speaker="Chelsie"),
        "short": _talker_input(adapter, cases["audio"][1], max_tokens=5),
    }
    codes = _run(runtime, inputs)
    np.testing.assert_array_equal(codes["text"], cases["text"][0].codes)
    np.testing.assert_array_equal(codes["audio"], cases["audio"][0].codes)
    np.testing.assert_array_equal(codes["chelsie"], chelsie.codes)
    assert not np.array_equal(codes["chelsie"], codes["text"])
    # max_tokens=5: five codebook-0 tokens, the frames of the first four (as generate would give).
    np.testing.assert_array_equal(codes["short"], cases["audio"][0].codes[:, :4])


def test_the_edge_adapter_loads_with_the_stage(talker: Any, tiny_dir: Path) -> None:
    # Its projections and embedding tables are read when the talker's worker builds it, so the
    # first request does not wait for them.
    runtime, _ = talker
    adapter = ThinkerToTalker(PartContext(runtime.pipeline))  # no chunk has reached it
    config = json.loads((tiny_dir / "config.json").read_text())
    assert adapter.weights.codec_embedding.shape[0] == config["talker_config"]["text_config"]["vocab_size"]
    assert adapter.weights.thinker_embedding([0]).shape[1] == config["thinker_config"]["text_config"]["hidden_size"]


def test_unknown_speaker_is_rejected(talker: Any, cases: Any) -> None:
    runtime, adapter = talker
    with pytest.raises(InvalidRequestError, match="speaker"):
        runtime.add_request("nobody", _talker_input(adapter, cases["text"][1], speaker="Nobody"))
    assert not runtime.has_unfinished()


def test_sampled_request_next_to_a_greedy_one(talker: Any, cases: Any, tiny_dir: Path) -> None:
    """A sampling request (the code predictor samples its rows too) in the batch of a greedy one: the
    greedy request keeps the reference's codes; the sampled one gives valid, different codes."""
    runtime, adapter = talker
    ref, chunk = cases["text"]
    codes = _run(
        runtime,
        {
            "greedy": _talker_input(adapter, chunk),
            "sampled": _talker_input(adapter, chunk, temperature=0.9, top_k=50, seed=1),
        },
    )
    np.testing.assert_array_equal(codes["greedy"], ref.codes)
    sampled = codes["sampled"]
    assert sampled.shape[0] == ref.codes.shape[0] and sampled.shape[1] > 0
    config = json.loads((tiny_dir / "config.json").read_text())["talker_config"]
    assert 0 <= sampled.min() and sampled[0].max() < config["text_config"]["vocab_size"]
    assert sampled[1:].max() < config["code_predictor_config"]["vocab_size"]
    assert not np.array_equal(sampled[:, : ref.codes.shape[1]], ref.codes[:, : sampled.shape[1]])


def test_seeded_sampling_does_not_depend_on_streaming(talker: Any, cases: Any) -> None:
    """A sampling request with a seed gives the same codes (every codebook) run again, and fed per
    thinker token: it waits for its whole text rather than being resumed (vLLM would re-seed each
    run), and the code predictor samples from the request's own generator."""
    runtime, adapter = talker
    _, chunk = cases["text"]
    seeded = {"temperature": 0.9, "top_k": 50, "seed": 7}
    whole = _run(runtime, {"whole": _talker_input(adapter, chunk, **seeded)})["whole"]
    assert np.array_equal(_run(runtime, {"again": _talker_input(adapter, chunk, **seeded)})["again"], whole)
    state: dict[str, Any] = {}
    parts: list[torch.Tensor] = []
    started = False
    for piece in _split_like_the_thinker(chunk):
        stage_input = adapter.on_chunk(state, piece)
        if stage_input is None:
            continue
        if not started:
            stage_input.params = {"max_tokens": MAX_FRAMES, "speaker": "Ethan", **seeded}
            runtime.add_request("streamed", stage_input)
            started = True
        else:
            runtime.extend_request("streamed", stage_input)
        for out in runtime.step() if runtime.has_unfinished() else []:
            assert out.error is None, out.error
            parts.append(out.data["codes"])
    while runtime.has_unfinished():
        parts.extend(out.data["codes"] for out in runtime.step())
    np.testing.assert_array_equal(torch.cat(parts).T.numpy(), whole)
    other = _run(runtime, {"other": _talker_input(adapter, chunk, **{**seeded, "seed": 8})})["other"]
    assert not np.array_equal(other[:, : whole.shape[1]], whole[:, : other.shape[1]])


def test_resumed_requests_never_read_each_others_cached_rows(talker: Any, cases: Any) -> None:
    """Two requests with the same prompt but different text, both held and resumed, over more than
    a KV block (128 rows on CPU). vLLM sees only placeholder ids (the model fills the rows in from
    its side inputs), so to its prefix cache the two look alike: each request's runs carry their
    own cache salt, and each gives its own codes, as when fed whole."""
    runtime, adapter = talker
    base = adapter.on_chunk({}, cases["text"][1])
    assert base is not None
    extra = 120 - base.data["prompt_embeds"].shape[0]  # a prompt of 120 rows: resumed runs fill a block
    prompt = torch.cat([base.data["prompt_embeds"][:1].repeat(extra, 1), base.data["prompt_embeds"]])
    generator = torch.Generator().manual_seed(0)
    width = base.data["trailing"].shape[1]
    texts = {name: torch.randn((24, width), generator=generator) for name in ("a", "b")}
    params = {"max_tokens": 20, "min_tokens": 20, "temperature": 0.0, "speaker": "Ethan"}

    def data(text: torch.Tensor) -> dict[str, Any]:
        return {**base.data, "prompt_embeds": prompt, "speaker_row": base.data["speaker_row"] + extra, "trailing": text}

    whole = _run(runtime, {name: StageInput(data=data(text), params=dict(params), final=True) for name, text in texts.items()})
    assert not np.array_equal(whole["a"], whole["b"])
    codes: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for name, text in texts.items():  # one after the other: "b" resumes after "a" ran
        runtime.add_request(name, StageInput(data=data(text[:12]), params=dict(params), final=False))
        while runtime.has_unfinished():  # 13 tokens, then held: its text runs out
            codes[name].extend(out.data["codes"] for out in runtime.step())
        runtime.extend_request(name, StageInput(data={"trailing": text[12:]}, final=True))
        while runtime.has_unfinished():  # resumed: 133 rows
            codes[name].extend(out.data["codes"] for out in runtime.step())
    for name in texts:
        np.testing.assert_array_equal(torch.cat(codes[name]).T.numpy(), whole[name])


def test_a_thinker_capture_short_of_the_prompt_is_rejected(talker: Any, cases: Any) -> None:
    _, adapter = talker
    data = cases["text"][1].data
    short = {**data, "thinker_embeds": data["thinker_embeds"][:3], "thinker_hidden": data["thinker_hidden"][:3]}
    with pytest.raises(InvalidRequestError, match="embedding rows for a"):
        adapter.on_chunk({}, Chunk("short", "thinker", 0, short, final=True))


# Builds the talker's own layers under vLLM (one rank, gloo) with a quantization config that records
# which layers ask it for a method; a fresh process, as vLLM's parallel state is process-wide.
_QUANT_PROBE = """
import json, socket, sys
import torch
from transformers import AutoConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import QuantizationConfig

class Recording(QuantizationConfig):
    def __init__(self):
        super().__init__()
        self.asked = []
    def get_name(self): return "recording"
    def get_supported_act_dtypes(self): return [torch.float32]
    @classmethod
    def get_min_capability(cls): return 0
    @staticmethod
    def get_config_filenames(): return []
    @classmethod
    def from_config(cls, config): return cls()
    def get_quant_method(self, layer, prefix):
        self.asked.append(prefix)
        return UnquantizedLinearMethod()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    from omni_qwen3.talker_model import CodePredictor, _ResizeMLP
    talker = AutoConfig.from_pretrained(sys.argv[1]).talker_config
    recording = Recording()
    parts = {
        "code_predictor": CodePredictor(talker.code_predictor_config, prefix="code_predictor", quant_config=recording),
        "text_projection": _ResizeMLP(talker, prefix="text_projection", quant_config=recording),
    }
    linears = [f"{root}.{name}" for root, part in parts.items() for name, m in part.named_modules() if isinstance(m, LinearBase)]
    print(json.dumps({"asked": recording.asked, "linears": linears}))
"""


def test_the_stage_quantization_reaches_the_code_predictor_and_the_projection(tiny_dir: Path) -> None:
    """`talker.quantization` is vLLM's quant_config: the talker's own layers (code predictor, text
    projection) take it as vLLM's do, every linear but the codebook heads (vLLM keeps LM heads
    unquantized). No vLLM quantization runs on CPU, so the layers' requests are what is checked."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _QUANT_PROBE, str(tiny_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    expected = [name for name in probe["linears"] if ".lm_head." not in name]
    assert len(expected) >= 6 and sorted(probe["asked"]) == sorted(expected), probe
