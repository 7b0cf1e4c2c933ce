"""vLLM-Omni stage-config YAML (``--stage-configs-path``) -> an Omni deploy config.

vLLM-Omni (0.30) describes a model's deployment as ``stage_args`` (one entry per stage, in stage
order: ``stage_id``, ``stage_type``, ``runtime`` with ``process``/``devices``/``max_batch_size``,
``engine_args``, ``engine_input_source``, ``final_output``/``final_output_type``,
``default_sampling_params``, ``input_connectors``/``output_connectors``) and a top-level ``runtime``
(``defaults.window_size``/``max_inflight``, ``edges``, named ``connectors``) and ``async_chunk``.
Omni's model family owns the stage graph and the model parts, so the file is read against the
family's pipeline, stage by stage in order, and what has a meaning here becomes the deploy settings
of `omni_core.config.deploy`:

- ``runtime.process`` -> ``placement`` (``process`` / ``inline``); ``runtime.devices`` ``"0,1"`` ->
  ``devices: [cuda:0, cuda:1]``; ``runtime.max_batch_size`` -> the kind's batch option (vLLM-Omni
  sets vLLM's ``max_num_seqs`` from it).
- ``engine_args`` of an ``ar`` stage: the options `AROptions` types (``gpu_memory_utilization``,
  ``enforce_eager``, ``max_num_seqs``, ...) and vLLM engine arguments passed through
  (``tensor_parallel_size``, ``enable_prefix_caching``, ...: `AR_PASSTHROUGH`); of a
  ``generation`` stage (code2wav, which runs no vLLM engine here) ``dtype`` and the batch size; of a
  ``diffusion`` stage ``dtype``, the batch size and ``vae_use_tiling``.
- ``async_chunk: true`` -> ``streaming: true``; without it, ``streaming: false`` (a stage starts once
  its upstream has finished: vLLM-Omni's ``window_size`` of -1, the only window it is mapped from).
- Connectors: ``SharedMemoryConnector`` -> ``shm``, ``MooncakeConnector`` -> ``mooncake-store``
  (``master``, ``host``, ``segment`` -> ``segment_bytes``, ``localbuf`` -> ``buffer_bytes``,
  ``proto`` -> ``protocol``).

What only steers vLLM-Omni's own machinery (worker and scheduler classes, ``model_arch``,
``engine_output_type``, ``custom_process_input_func``, ``default_sampling_params``, ...) is ignored,
with one warning line per field (`IGNORED`). A field whose meaning Omni cannot reproduce (a stage
graph or final outputs other than the family's, a window of N chunks, a diffusion stage spanning
devices, a field this module does not know) is refused with a `ConfigError` giving the reason.
Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import yaml

from omni_core.config.pipeline import PipelineConfig
from omni_core.errors import ConfigError

if TYPE_CHECKING:
    from omni_core.plugins import PluginHost

# Why each ignored field means nothing here (the warning's text).
_ENGINE = "vLLM-Omni's engine internals; Omni's model family and stage runtime decide these"
IGNORED: dict[str, str] = {
    "is_comprehension": "the family's input processor and tokenizer serve every request",
    "custom_process_input_func": "the family's edge adapters turn a stage's output into the next stage's input",
    "default_sampling_params": "per-stage defaults are the family's; set parameters per request "
    "(stage_params, or sampling_params_list as in vLLM-Omni)",
    "engine_args.model_arch": _ENGINE,
    "engine_args.worker_cls": _ENGINE,
    "engine_args.scheduler_cls": _ENGINE,
    "engine_args.engine_output_type": _ENGINE,
    "engine_args.hf_config_name": "the family reads its part of the checkpoint's config",
    "engine_args.custom_process_next_stage_input_func": "the family's edge adapters stream chunks to the next stage",
    "engine_args.trust_remote_code": "Omni runs the family's own model code, never the checkpoint's",
    "engine_args.distributed_executor_backend": "Omni starts each stage's processes itself (placement)",
    "engine_args.omni_kv_config": "what passes between stages is the family's (its edge adapters)",
    "engine_args.enable_cache_dit_summary": "a log summary of vLLM-Omni's cache-dit",
    "engine_args.vae_use_slicing": "Omni's diffusion stage decodes a batch's latents together",
    "runtime.max_inflight": "stages batch every request in flight (replicas add more)",
    "runtime.enabled": "Omni always runs the stages as a pipeline",
    "modes": "the family's tasks pick the stages a request runs",
    "connector extra.shm_threshold_bytes": "Omni's shm connector carries every payload in shared memory",
    "connector extra.metadata_server": "Omni's Mooncake store needs only its master",
}
# Engine arguments of a stage that runs no vLLM engine here (a generation stage: code2wav).
_NO_ENGINE = "this stage runs no vLLM engine in Omni (a generation stage)"
GENERATION_IGNORED = frozenset(
    {"gpu_memory_utilization", "enforce_eager", "max_num_batched_tokens", "enable_prefix_caching", "async_scheduling", "max_model_len", "seed"}
)
DIFFUSION_IGNORED = frozenset({"gpu_memory_utilization", "enforce_eager", "max_num_batched_tokens", "enable_prefix_caching", "cache_config"})

# `AROptions` fields an ``ar`` stage's engine_args set under the same name.
AR_TYPED = ("gpu_memory_utilization", "enforce_eager", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "dtype", "seed", "kv_cache_memory_bytes")
# vLLM `EngineArgs` fields seen in vLLM-Omni's stage configs, passed to vLLM as they are (`AROptions.engine_args`).
AR_PASSTHROUGH = frozenset(
    {
        "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
        "enable_prefix_caching", "enable_chunked_prefill", "hf_overrides", "load_format", "block_size",
        "kv_cache_dtype", "limit_mm_per_prompt", "async_scheduling", "quantization", "max_logprobs",
        "mm_processor_kwargs", "tokenizer_mode", "swap_space", "cpu_offload_gb",
    }
)
STAGE_KEYS = frozenset(
    {
        "stage_id", "stage_type", "runtime", "engine_args", "engine_input_source", "final_output", "final_output_type",
        "is_comprehension", "default_sampling_params", "custom_process_input_func", "input_connectors", "output_connectors",
    }
)
CONNECTORS = {"SharedMemoryConnector": "shm", "MooncakeConnector": "mooncake-store"}
MOONCAKE_OPTIONS = {"master": "master", "host": "host", "segment": "segment_bytes", "localbuf": "buffer_bytes", "proto": "protocol"}


@attrs.frozen
class TargetStage:
    """What the conversion needs of one stage of the pipeline it targets."""

    name: str
    kind: str
    sources: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


@attrs.frozen
class StageConfigConversion:
    """A converted stage config: `deploy` (the raw dict a deploy YAML holds) and one `warnings`
    line per ignored field."""

    deploy: dict[str, Any]
    warnings: tuple[str, ...] = ()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.deploy, sort_keys=False, default_flow_style=False)


def target_stages(pipeline: PipelineConfig) -> list[TargetStage]:
    """The stages of a family's pipeline, in order, as the conversion reads them."""
    return [
        TargetStage(s.name, s.kind, tuple(e.source for e in s.inputs), ((s.output,) if s.output else ()) + tuple(s.extra_outputs))
        for s in pipeline.stages
    ]


def read_stage_config(path: str | Path) -> dict[str, Any]:
    """The YAML of a vLLM-Omni stage-config file; unreadable or not a mapping: `ConfigError`."""
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the stage-config file {path}: {exc}", key=str(path)) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"the stage-config file {path} is not valid YAML: {exc}", key=str(path)) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"the stage-config file {path} must hold a mapping with stage_args", key=str(path))
    return data


def convert_for_model(path: str | Path, model: str, plugins: PluginHost | None = None) -> StageConfigConversion:
    """Read the stage-config file at `path` against `model`'s pipeline (its family's stages)."""
    from omni_core.config.modelref import read_hf_config, resolve_model_path
    from omni_core.config.resolve import build_pipeline
    from omni_core.plugins import default_plugins

    host = plugins if plugins is not None else default_plugins()
    model_path = resolve_model_path(model, host)
    hf_config = read_hf_config(model_path)
    pipeline = build_pipeline(host.family_for(model, hf_config), model_path, hf_config)
    return convert_stage_config(read_stage_config(path), target_stages(pipeline), source=str(path))


def convert_stage_config(data: Mapping[str, Any], stages: Sequence[TargetStage] | None = None, source: str = "the stage config") -> StageConfigConversion:
    """Convert a vLLM-Omni stage config (parsed YAML) for the pipeline whose stages are `stages`
    (``None``: stages named after each entry's ``engine_args.model_stage``, the graph taken from
    ``engine_input_source``)."""
    return _Converter(source).convert(data, stages)


class _Converter:
    def __init__(self, source: str) -> None:
        self.source = source
        self.ignored: dict[str, list[str]] = {}  # field -> where it was seen (one warning each)
        self.reasons: dict[str, str] = {}  # field -> why, where not `IGNORED`'s

    def refuse(self, key: str, reason: str) -> ConfigError:
        return ConfigError(f"{reason} (in {self.source}; Omni cannot map it faithfully)", key=key)

    def ignore(self, field: str, where: str, reason: str | None = None) -> None:
        if reason is not None:
            self.reasons[field] = reason
        self.ignored.setdefault(field, []).append(where)

    def convert(self, data: Mapping[str, Any], targets: Sequence[TargetStage] | None) -> StageConfigConversion:
        for key in data:
            if key == "modes":
                self.ignore("modes", "modes")
            elif key not in ("stage_args", "runtime", "async_chunk"):
                raise self.refuse(key, f"unknown top-level field {key!r}; vLLM-Omni's are stage_args, runtime, async_chunk")
        entries = self._entries(data.get("stage_args"))
        stages = list(targets) if targets is not None else self._stages_of(entries)
        if len(entries) != len(stages):
            raise self.refuse(
                "stage_args",
                f"{len(entries)} stages, but the model's pipeline has {len(stages)}: {', '.join(s.name for s in stages)}",
            )
        ids = {int(entry["stage_id"]): stage for entry, stage in zip(entries, stages)}
        deploy: dict[str, Any] = {"streaming": self._streaming(data, ids)}
        deploy_stages: dict[str, Any] = {}
        edges: dict[str, Any] = {}
        connectors = self._connectors(data.get("runtime") or {})
        for index, (entry, stage) in enumerate(zip(entries, stages)):
            where = f"stage_args[{index}]"
            settings = self._stage(entry, stage, where, ids)
            if settings:
                deploy_stages[stage.name] = settings
            self._stage_connectors(entry, stage, where, ids, connectors, edges)
        if deploy_stages:
            deploy["stages"] = deploy_stages
        if edges:
            deploy["edges"] = edges
        warnings = tuple(
            f"ignored {field} ({', '.join(places)}): {self.reasons.get(field) or IGNORED.get(field, _ENGINE)}"
            for field, places in self.ignored.items()
        )
        return StageConfigConversion(deploy, warnings)

    # -- the stage list ----------------------------------------------------------------------------

    def _entries(self, value: Any) -> list[Mapping[str, Any]]:
        if not isinstance(value, list) or not value:
            raise self.refuse("stage_args", "stage_args must be a non-empty list of stages")
        for index, entry in enumerate(value):
            if not isinstance(entry, Mapping) or "stage_id" not in entry:
                raise self.refuse(f"stage_args[{index}]", "each stage is a mapping with a stage_id")
        ordered = sorted(value, key=lambda e: e["stage_id"])
        if [e["stage_id"] for e in ordered] != list(range(len(ordered))):
            raise self.refuse("stage_args", f"stage ids must be 0..{len(ordered) - 1}, got {[e['stage_id'] for e in value]}")
        return ordered

    def _stages_of(self, entries: list[Mapping[str, Any]]) -> list[TargetStage]:
        """The pipeline the file itself describes (no model given)."""
        names = []
        for entry in entries:
            name = str((entry.get("engine_args") or {}).get("model_stage") or f"stage{entry['stage_id']}")
            names.append(name if name not in names else f"{name}{entry['stage_id']}")
        stages = []
        for entry, name in zip(entries, names):
            worker = str((entry.get("engine_args") or {}).get("worker_cls") or "")
            kind = "diffusion" if entry.get("stage_type") == "diffusion" else "generation" if "generation" in worker else "ar"
            sources = tuple(names[int(i)] for i in entry.get("engine_input_source") or () if 0 <= int(i) < len(names))
            outputs = (str(entry["final_output_type"]),) if entry.get("final_output") and entry.get("final_output_type") else ()
            stages.append(TargetStage(name, kind, sources, outputs))
        return stages

    def _stage(self, entry: Mapping[str, Any], stage: TargetStage, where: str, ids: dict[int, TargetStage]) -> dict[str, Any]:
        for key in entry:
            if key not in STAGE_KEYS:
                raise self.refuse(f"{where}.{key}", f"unknown stage field {key!r}; vLLM-Omni's are {', '.join(sorted(STAGE_KEYS))}")
        for key in ("is_comprehension", "custom_process_input_func", "default_sampling_params"):
            if key in entry:
                self.ignore(key, stage.name)
        self._check_kind(entry, stage, where)
        self._check_graph(entry, stage, where, ids)
        settings: dict[str, Any] = {}
        options: dict[str, Any] = {}
        runtime = entry.get("runtime") or {}
        if not isinstance(runtime, Mapping):
            raise self.refuse(f"{where}.runtime", "runtime must be a mapping")
        for key, value in runtime.items():
            if key == "process":
                settings["placement"] = "process" if value else "inline"
            elif key == "devices":
                settings["devices"] = _devices(value, f"{where}.runtime.devices", self)
            elif key == "max_batch_size":
                options[_batch_option(stage.kind)] = int(value)
            else:
                raise self.refuse(f"{where}.runtime.{key}", f"unknown runtime field {key!r}; vLLM-Omni's are process, devices, max_batch_size")
        engine_args = entry.get("engine_args") or {}
        if not isinstance(engine_args, Mapping):
            raise self.refuse(f"{where}.engine_args", "engine_args must be a mapping")
        options.update(self._engine_args(engine_args, stage, f"{where}.engine_args"))
        if options:
            settings["options"] = options
        return settings

    def _check_kind(self, entry: Mapping[str, Any], stage: TargetStage, where: str) -> None:
        stage_type = entry.get("stage_type", "llm")
        fits = stage.kind == "diffusion" if stage_type == "diffusion" else stage.kind in ("ar", "generation") if stage_type == "llm" else False
        if not fits:
            raise self.refuse(f"{where}.stage_type", f"stage_type {stage_type!r}, but stage {stage.name!r} is a {stage.kind} stage here")
        model_stage = (entry.get("engine_args") or {}).get("model_stage")
        if model_stage is not None and str(model_stage).lower() != stage.name.lower():
            self.ignore("engine_args.model_stage", f"{model_stage} is {stage.name}", "stages are matched by their order (stage_id)")

    def _check_graph(self, entry: Mapping[str, Any], stage: TargetStage, where: str, ids: dict[int, TargetStage]) -> None:
        sources = entry.get("engine_input_source") or []
        try:
            named = sorted(ids[int(i)].name for i in sources)
        except (KeyError, TypeError, ValueError):
            raise self.refuse(f"{where}.engine_input_source", f"engine_input_source {sources!r} names no stage of the file") from None
        if named != sorted(stage.sources):
            raise self.refuse(
                f"{where}.engine_input_source",
                f"stage {stage.name!r} takes input from {', '.join(named) or 'the request'} in the file, but from "
                f"{', '.join(stage.sources) or 'the request'} in the model's pipeline (the stage graph is the family's)",
            )
        if entry.get("final_output"):
            kind = entry.get("final_output_type")
            if kind not in stage.outputs:
                produced = ", ".join(stage.outputs) or "nothing a user sees"
                raise self.refuse(f"{where}.final_output_type", f"stage {stage.name!r} gives {kind!r} as a final output in the file; it produces {produced} here")

    def _engine_args(self, args: Mapping[str, Any], stage: TargetStage, where: str) -> dict[str, Any]:
        options: dict[str, Any] = {}
        passthrough: dict[str, Any] = {}
        for key, value in args.items():
            field = f"engine_args.{key}"
            if key == "model_stage":
                continue  # checked with the stage kind
            if field in IGNORED:
                self.ignore(field, stage.name)
            elif stage.kind == "ar" and key in AR_TYPED:
                options[key] = value
            elif stage.kind == "ar" and key in AR_PASSTHROUGH:
                passthrough[key] = value
            elif stage.kind == "generation" and key in GENERATION_IGNORED:
                self.ignore(field, stage.name, _NO_ENGINE)
            elif stage.kind == "generation" and key == "dtype":
                options["dtype"] = value
            elif stage.kind == "generation" and key == "max_num_seqs":
                options["max_batch_size"] = int(value)
            elif stage.kind == "generation" and key in ("tensor_parallel_size", "pipeline_parallel_size") and value == 1:
                self.ignore(field, stage.name, _NO_ENGINE)
            elif stage.kind == "diffusion" and key in DIFFUSION_IGNORED:
                self.ignore(field, stage.name, "Omni's diffusion stage runs no vLLM engine")
            elif stage.kind == "diffusion" and key in ("dtype", "max_num_seqs"):
                options[key] = value
            elif stage.kind == "diffusion" and key == "vae_use_tiling":
                options["vae_tiling"] = bool(value)
            elif stage.kind == "diffusion" and key == "cache_backend" and value is None:
                self.ignore(field, stage.name, "no cache acceleration: Omni's default too")
            elif stage.kind == "diffusion" and key == "parallel_config" and _single_device(value):
                self.ignore(field, stage.name, "one device per replica: Omni's default too")
            elif stage.kind == "diffusion" and key == "parallel_config":
                raise self.refuse(f"{where}.{key}", f"parallel_config {value!r} spreads one diffusion replica over several devices, which Omni's diffusion stage does not map from vLLM-Omni's layout; use replicas or one device")
            else:
                raise self.refuse(f"{where}.{key}", f"{key}: {value!r} has no equivalent for a {stage.kind} stage in Omni")
        if passthrough:
            options["engine_args"] = passthrough
        return options

    # -- streaming and connectors ------------------------------------------------------------------

    def _streaming(self, data: Mapping[str, Any], ids: dict[int, TargetStage]) -> bool:
        """``async_chunk: true``: stages hand on chunks as they come (Omni's streaming); else a stage
        starts once its upstream has finished (vLLM-Omni's window of -1)."""
        runtime = data.get("runtime") or {}
        if not isinstance(runtime, Mapping):
            raise self.refuse("runtime", "runtime must be a mapping")
        for key in runtime:
            if key not in ("enabled", "defaults", "edges", "connectors"):
                raise self.refuse(f"runtime.{key}", f"unknown runtime field {key!r}; vLLM-Omni's are enabled, defaults, edges, connectors")
        if "enabled" in runtime:
            self.ignore("runtime.enabled", "runtime")
        windows: list[tuple[str, Any]] = []
        defaults = runtime.get("defaults") or {}
        for key, value in defaults.items():
            if key == "window_size":
                windows.append(("runtime.defaults.window_size", value))
            elif key == "max_inflight":
                self.ignore("runtime.max_inflight", "runtime.defaults")
            else:
                raise self.refuse(f"runtime.defaults.{key}", f"unknown field {key!r}; vLLM-Omni's are window_size, max_inflight")
        pipeline_edges = {(source, stage.name) for stage in ids.values() for source in stage.sources}
        for index, edge in enumerate(runtime.get("edges") or []):
            key = f"runtime.edges[{index}]"
            try:
                pair = (ids[int(edge["from"])].name, ids[int(edge["to"])].name)
            except (KeyError, TypeError, ValueError):
                raise self.refuse(key, f"an edge names its stages by id (from, to), got {edge!r}") from None
            if pair not in pipeline_edges:
                raise self.refuse(key, f"the model's pipeline has no edge {pair[0]}->{pair[1]}")
            if "window_size" in edge:
                windows.append((f"{key}.window_size", edge["window_size"]))
        for key, value in windows:
            if value != -1:
                raise self.refuse(key, f"a window of {value} chunks: Omni streams each chunk on (async_chunk: true) or hands on whole outputs (-1)")
        return bool(data.get("async_chunk"))

    def _connectors(self, runtime: Mapping[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
        """Named connectors of ``runtime.connectors`` -> (Omni connector, options)."""
        named: dict[str, tuple[str, dict[str, Any]]] = {}
        for name, spec in (runtime.get("connectors") or {}).items():
            key = f"runtime.connectors.{name}"
            kind = spec.get("name") if isinstance(spec, Mapping) else None
            if kind not in CONNECTORS:
                raise self.refuse(key, f"connector {kind!r}; Omni maps {', '.join(CONNECTORS)}")
            options: dict[str, Any] = {}
            for option, value in (spec.get("extra") or {}).items():
                if kind == "MooncakeConnector" and option in MOONCAKE_OPTIONS:
                    options[MOONCAKE_OPTIONS[option]] = _strip_scheme(value) if option == "master" else value
                elif f"connector extra.{option}" in IGNORED:
                    self.ignore(f"connector extra.{option}", name)
                else:
                    raise self.refuse(f"{key}.extra.{option}", f"{kind} option {option!r} has no equivalent in Omni's {CONNECTORS[kind]} connector")
            named[name] = (CONNECTORS[kind], options)
        return named

    def _stage_connectors(
        self, entry: Mapping[str, Any], stage: TargetStage, where: str, ids: dict[int, TargetStage],
        connectors: dict[str, tuple[str, dict[str, Any]]], edges: dict[str, Any],
    ) -> None:
        for field, prefix in (("output_connectors", "to_stage_"), ("input_connectors", "from_stage_")):
            for link, name in (entry.get(field) or {}).items():
                key = f"{where}.{field}.{link}"
                if not str(link).startswith(prefix) or not str(link)[len(prefix):].isdigit() or int(str(link)[len(prefix):]) not in ids:
                    raise self.refuse(key, f"{field} keys are {prefix}<stage id>, got {link!r}")
                other = ids[int(str(link)[len(prefix):])].name
                source, target = (stage.name, other) if field == "output_connectors" else (other, stage.name)
                if source not in _sources(ids, target):
                    raise self.refuse(key, f"the model's pipeline has no edge {source}->{target}")
                if name not in connectors:
                    raise self.refuse(key, f"connector {name!r} is not in runtime.connectors")
                connector, options = connectors[name]
                setting = {"connector": connector, **({"options": copy.deepcopy(options)} if options else {})}
                edge = f"{source}->{target}"
                if edges.get(edge, setting) != setting:
                    raise self.refuse(key, f"edge {edge} gets two different connectors")
                edges[edge] = setting


def _sources(ids: dict[int, TargetStage], target: str) -> tuple[str, ...]:
    return next((s.sources for s in ids.values() if s.name == target), ())


def _batch_option(kind: str) -> str:
    return "max_batch_size" if kind == "generation" else "max_num_seqs"


def _devices(value: Any, key: str, converter: _Converter) -> list[str]:
    """vLLM-Omni's visible GPUs (``"0,1"``, or one index) -> Omni's device names."""
    items = [part.strip() for part in str(value).split(",") if part.strip()]
    if not items or not all(item.isdigit() for item in items):
        raise converter.refuse(key, f"devices are GPU indexes like \"0,1\", got {value!r}")
    return [f"cuda:{item}" for item in items]


def _single_device(parallel: Any) -> bool:
    """Whether a diffusion ``parallel_config`` keeps the stage on one device (every size 1, no HSDP)."""
    if not isinstance(parallel, Mapping):
        return False
    for key, value in parallel.items():
        if key == "use_hsdp":
            if value:
                return False
        elif key == "hsdp_shard_size":
            continue
        elif key == "enable_expert_parallel":
            if value:
                return False
        elif value not in (1, None):
            return False
    return True


def _strip_scheme(address: Any) -> Any:
    return address.split("://", 1)[1] if isinstance(address, str) and "://" in address else address
