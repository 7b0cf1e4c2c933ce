"""vLLM-Omni stage-config YAML: ``omni convert-stage-config`` prints the equivalent deploy file and
``omni serve MODEL --stage-configs-path FILE`` serves with it.

The YAML is written here in vLLM-Omni's documented format (docs/configuration/stage_configs.md), with
the fields and structure of its Qwen3-Omni files (vllm_omni/model_executor/stage_configs/
qwen3_omni_moe.yaml and qwen3_omni_moe_multiconnector.yaml): one entry per stage (thinker, talker,
code2wav) and the top-level runtime with its connectors and edges.
"""

from __future__ import annotations

import base64
import copy
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import soundfile
import yaml
from click.testing import CliRunner

from omni_cli.main import cli
from omni_core.config import resolve
from omni_core.config.vllm_omni import convert_stage_config, target_stages
from omni_core.errors import ConfigError
from omni_core.testing.live_server import LiveServer

MODEL = "omni-tiny/qwen3-omni"

WORKERS = {"ar": "vllm_omni.worker.gpu_ar_worker.GPUARWorker", "generation": "vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker"}
SCHEDULERS = {"ar": "vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler", "generation": "vllm_omni.core.sched.omni_generation_scheduler.OmniGenerationScheduler"}
PROCESSORS = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"


def _stage(stage_id: int, name: str, kind: str, runtime: dict[str, Any], engine: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "stage_id": stage_id,
        "stage_type": "llm",
        "runtime": runtime,
        "engine_args": {
            "model_stage": name, "model_arch": "Qwen3OmniMoeForConditionalGeneration", "worker_cls": WORKERS[kind],
            "scheduler_cls": SCHEDULERS[kind], "enforce_eager": True, "trust_remote_code": True, "enable_prefix_caching": False,
            "distributed_executor_backend": "mp", **engine,
        },
        **fields,
    }


def qwen3_omni_stage_config(gpus: bool = True) -> dict[str, Any]:
    """Qwen3-Omni's three stages as vLLM-Omni writes them; `gpus`: its devices and tensor parallelism."""
    devices = (lambda d: {"devices": d}) if gpus else (lambda d: {})
    return {
        "stage_args": [
            _stage(
                0, "thinker", "ar", {"process": True, **devices("0,1"), "max_batch_size": 4},
                {"gpu_memory_utilization": 0.6, "engine_output_type": "latent", "max_num_batched_tokens": 32768,
                 "hf_config_name": "thinker_config", **({"tensor_parallel_size": 2} if gpus else {})},
                final_output=True, final_output_type="text", is_comprehension=True,
                default_sampling_params={"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 2048, "seed": 42, "detokenize": True, "repetition_penalty": 1.05},
                output_connectors={"to_stage_1": "connector_of_shared_memory"},
            ),
            _stage(
                1, "talker", "ar", {"process": True, **devices("1"), "max_batch_size": 4},
                {"gpu_memory_utilization": 0.3, "engine_output_type": "latent", "max_num_batched_tokens": 32768, "hf_config_name": "talker_config"},
                engine_input_source=[0], custom_process_input_func=f"{PROCESSORS}.thinker2talker",
                default_sampling_params={"temperature": 0.9, "top_k": 50, "max_tokens": 4096, "seed": 42, "detokenize": False, "repetition_penalty": 1.05, "stop_token_ids": [2150]},
                input_connectors={"from_stage_0": "connector_of_shared_memory"},
                output_connectors={"to_stage_2": "connector_of_shared_memory"},
            ),
            _stage(
                2, "code2wav", "generation", {"process": True, **devices("0"), "max_batch_size": 2},
                {"gpu_memory_utilization": 0.1, "engine_output_type": "audio", "max_num_batched_tokens": 1000000, "hf_config_name": "thinker_config"},
                engine_input_source=[1], custom_process_input_func=f"{PROCESSORS}.talker2code2wav",
                final_output=True, final_output_type="audio",
                default_sampling_params={"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42, "detokenize": True, "repetition_penalty": 1.1},
                input_connectors={"from_stage_1": "connector_of_shared_memory"},
            ),
        ],
        "runtime": {
            "enabled": True,
            "defaults": {"window_size": -1, "max_inflight": 1},
            "connectors": {"connector_of_shared_memory": {"name": "SharedMemoryConnector", "extra": {"shm_threshold_bytes": 65536}}},
            "edges": [{"from": 0, "to": 1, "window_size": -1}, {"from": 1, "to": 2, "window_size": -1}],
        },
    }


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


EXPECTED_DEPLOY = {
    "streaming": False,  # no async_chunk: a stage starts once its upstream has finished (window_size -1)
    "stages": {
        "thinker": {
            "placement": "process",
            "devices": ["cuda:0", "cuda:1"],
            "options": {"max_num_seqs": 4, "gpu_memory_utilization": 0.6, "enforce_eager": True, "max_num_batched_tokens": 32768,
                        "engine_args": {"enable_prefix_caching": False, "tensor_parallel_size": 2}},
        },
        "talker": {
            "placement": "process",
            "devices": ["cuda:1"],
            "options": {"max_num_seqs": 4, "gpu_memory_utilization": 0.3, "enforce_eager": True, "max_num_batched_tokens": 32768,
                        "engine_args": {"enable_prefix_caching": False}},
        },
        "code2wav": {"placement": "process", "devices": ["cuda:0"], "options": {"max_batch_size": 2}},
    },
    "edges": {"thinker->talker": {"connector": "shm"}, "talker->code2wav": {"connector": "shm"}},
}

# Each ignored field: one warning line, naming the stages where it was.
IGNORED_LINES = {
    "engine_args.worker_cls": "thinker, talker, code2wav",
    "engine_args.scheduler_cls": "thinker, talker, code2wav",
    "engine_args.model_arch": "thinker, talker, code2wav",
    "engine_args.engine_output_type": "thinker, talker, code2wav",
    "engine_args.hf_config_name": "thinker, talker, code2wav",
    "engine_args.trust_remote_code": "thinker, talker, code2wav",
    "engine_args.distributed_executor_backend": "thinker, talker, code2wav",
    "default_sampling_params": "thinker, talker, code2wav",
    "custom_process_input_func": "talker, code2wav",
    "is_comprehension": "thinker",
    "engine_args.gpu_memory_utilization": "code2wav",
    "engine_args.enforce_eager": "code2wav",
    "engine_args.enable_prefix_caching": "code2wav",
    "engine_args.max_num_batched_tokens": "code2wav",
    "runtime.enabled": "runtime",
    "runtime.max_inflight": "runtime.defaults",
    "connector extra.shm_threshold_bytes": "connector_of_shared_memory",
}


def test_convert_stage_config_prints_the_deploy_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path / "qwen3_omni_moe.yaml", qwen3_omni_stage_config())
    result = CliRunner().invoke(cli, ["convert-stage-config", str(path), "--model", MODEL])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == EXPECTED_DEPLOY
    warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning: ignored ")]
    assert len(warnings) == len(IGNORED_LINES) == len(result.stderr.splitlines())
    for field, stages in IGNORED_LINES.items():
        (line,) = [w for w in warnings if w.startswith(f"Warning: ignored {field} (")]
        assert f"({stages}):" in line
    # Without --model, the stages are those the file names: the same deploy.
    alone = CliRunner().invoke(cli, ["convert-stage-config", str(path)])
    assert alone.exit_code == 0 and yaml.safe_load(alone.stdout) == EXPECTED_DEPLOY
    # The deploy resolves against the family's default deploy, its settings typed and checked.
    resolved = resolve(MODEL, deploy=EXPECTED_DEPLOY)
    thinker = resolved.stage("thinker")
    assert not resolved.streaming and thinker.devices == ("cuda:0", "cuda:1") and thinker.options["max_num_seqs"] == 4
    assert thinker.options["engine_args"] == {"enable_prefix_caching": False, "tensor_parallel_size": 2}
    assert resolved.stage("code2wav").options["max_batch_size"] == 2
    assert thinker.options["dtype"] == "checkpoint"  # the family's default deploy, which the file does not set


def test_mooncake_connectors_and_async_chunk() -> None:
    data = qwen3_omni_stage_config()
    data["async_chunk"] = True
    data["runtime"]["connectors"]["connector_of_mooncake"] = {
        "name": "MooncakeConnector",
        "extra": {"host": "127.0.0.1", "metadata_server": "http://10.0.0.1:8080/metadata", "master": "10.0.0.1:50051", "segment": 512000000, "localbuf": 64000000, "proto": "tcp"},
    }
    data["stage_args"][1]["output_connectors"] = {"to_stage_2": "connector_of_mooncake"}
    data["stage_args"][2]["input_connectors"] = {"from_stage_1": "connector_of_mooncake"}
    conversion = convert_stage_config(data)
    assert conversion.deploy["streaming"] is True
    assert conversion.deploy["edges"]["talker->code2wav"] == {
        "connector": "mooncake-store",
        "options": {"host": "127.0.0.1", "master": "10.0.0.1:50051", "segment_bytes": 512000000, "buffer_bytes": 64000000, "protocol": "tcp"},
    }
    assert sum("connector extra.metadata_server" in line for line in conversion.warnings) == 1


def _edited(edit: Any) -> dict[str, Any]:
    data = copy.deepcopy(qwen3_omni_stage_config())
    edit(data)
    return data


UNMAPPABLE = {
    "a window of chunks": (lambda d: d["runtime"]["edges"][0].update(window_size=2), "runtime.edges[0].window_size", "window of 2"),
    "an unknown engine argument": (lambda d: d["stage_args"][0]["engine_args"].update(speculative_magic=True), "stage_args[0].engine_args.speculative_magic", "no equivalent"),
    "another stage graph": (lambda d: d["stage_args"][2].update(engine_input_source=[0]), "stage_args[2].engine_input_source", "the stage graph is the family's"),
    "a final output the stage lacks": (lambda d: d["stage_args"][1].update(final_output=True, final_output_type="text"), "stage_args[1].final_output_type", "talker"),
    "a diffusion stage type": (lambda d: d["stage_args"][0].update(stage_type="diffusion"), "stage_args[0].stage_type", "ar stage"),
    "a stage too many": (lambda d: d["stage_args"].append({**d["stage_args"][2], "stage_id": 3}), "stage_args", "3: thinker, talker, code2wav"),
    "an unknown connector": (lambda d: d["runtime"]["connectors"]["connector_of_shared_memory"].update(name="RdmaMagic"), "runtime.connectors.connector_of_shared_memory", "RdmaMagic"),
    "an unknown stage field": (lambda d: d["stage_args"][0].update(priority=3), "stage_args[0].priority", "priority"),
}


@pytest.mark.parametrize("case", list(UNMAPPABLE))
def test_unmappable_fields_are_refused_naming_them(case: str) -> None:
    edit, key, said = UNMAPPABLE[case]
    qwen3 = target_stages_of_model()
    with pytest.raises(ConfigError) as refused:
        convert_stage_config(_edited(edit), qwen3)
    assert refused.value.key == key and said in str(refused.value) and "cannot map it faithfully" in str(refused.value)


def test_the_cli_names_the_refused_field(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.yaml", _edited(lambda d: d["runtime"]["edges"][1].update(window_size=4)))
    result = CliRunner().invoke(cli, ["convert-stage-config", str(path), "--model", MODEL])
    assert result.exit_code != 0 and "runtime.edges[1].window_size" in result.output


def target_stages_of_model() -> list[Any]:
    from omni_core.config.modelref import read_hf_config, resolve_model_path
    from omni_core.config.resolve import build_pipeline
    from omni_core.plugins import default_plugins

    host = default_plugins()
    path = resolve_model_path(MODEL, host)
    config = read_hf_config(path)
    return target_stages(build_pipeline(host.family_for(MODEL, config), path, config))


# -- serving ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The same file as vLLM-Omni would run it on this machine's CPU: no GPU devices, no tensor parallelism."""
    path = _write(tmp_path_factory.mktemp("stage-config") / "qwen3_omni_moe.yaml", qwen3_omni_stage_config(gpus=False))
    live = LiveServer.start(MODEL, args=["--stage-configs-path", str(path)])
    try:
        yield live
    finally:
        live.close()


@pytest.mark.vllm
def test_serve_with_stage_configs_path(served: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0.0,
        extra_body={"stage_params": {"talker": {"max_tokens": 16, "temperature": 0.0}}},
    )
    message = completion.choices[0].message
    assert message.content and message.audio is not None  # no modalities: text and audio, as vLLM-Omni
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
    assert rate > 0 and len(samples) > 0
    log = served.log_tail(200_000)
    assert log.count("ignored engine_args.worker_cls (thinker, talker, code2wav)") == 1, log[-3000:]
