"""`resolve()`: model reference + deploy file + ``--set`` overrides -> `ResolvedPipeline`.

The one resolution boundary: everything that can be wrong in a pipeline or its deployment is
rejected here with a `ConfigError` naming the key, before any stage starts. Layers of the deploy
config (the family's default file, the user's file or object, ``--set`` overrides) are raw dicts
deep-merged in that order (later wins) and structured once into `DeployConfig`.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import yaml

from omni_core.config.connector_choice import resolve_edge, resolve_output_connector
from omni_core.config.deploy import DeployConfig, StageDeploy
from omni_core.config.modelref import CHECKPOINT_DTYPE, checkpoint_dtype, read_hf_config, resolve_model_path
from omni_core.config.overrides import STAGE_FIELDS, deep_merge, drop_path, overrides_to_dict, unknown_name_message, unset_paths
from omni_core.config.pipeline import MODALITIES, PipelineConfig, StageSpec
from omni_core.config.tasks import check_tasks
from omni_core.config.resolved import ResolvedPipeline, ResolvedStage
from omni_core.config.structure import STRICT, structure_config
from omni_core.errors import ConfigError, PluginError
from omni_core.families import PipelineFamily
from omni_core.refs import load_ref

if TYPE_CHECKING:
    from omni_core.plugins import PluginHost

__all__ = ["resolve", "resolve_pipeline", "load_deploy", "check_pipeline", "structure_config", "STRICT"]

DeploySource = str | Path | DeployConfig | Mapping[str, Any] | None


def resolve(
    model_ref: str,
    deploy: DeploySource = None,
    overrides: Sequence[str] = (),
    plugins: PluginHost | None = None,
) -> ResolvedPipeline:
    """Resolve a model reference and its deployment into a validated `ResolvedPipeline`.

    `deploy` is a YAML file path, a `DeployConfig` (only its non-default values override the
    family's defaults) or a raw mapping; `overrides` are ``--set`` strings (see
    `omni_core.config.overrides`). `plugins` defaults to the installed plugins.
    """
    host = plugins if plugins is not None else _default_plugins()
    model_path = resolve_model_path(model_ref, host)
    hf_config = read_hf_config(model_path)
    family = host.family_for(model_ref, hf_config)
    pipeline = build_pipeline(family, model_path, hf_config)
    return resolve_pipeline(
        pipeline,
        model=model_ref,
        model_path=str(model_path),
        deploy=deploy,
        overrides=overrides,
        plugins=host,
    )


def build_pipeline(family: PipelineFamily, model_path: Path, hf_config: dict[str, Any]) -> PipelineConfig:
    """Call the family's pipeline builder and check it returned a `PipelineConfig`."""
    pipeline = load_ref(family.pipeline)(str(model_path), hf_config)
    if not isinstance(pipeline, PipelineConfig):
        raise PluginError(
            f"family {family.name!r}: {family.pipeline} returned {type(pipeline).__name__}, "
            "expected omni_core.config.pipeline.PipelineConfig"
        )
    return pipeline


def resolve_pipeline(
    pipeline: PipelineConfig,
    *,
    model: str,
    model_path: str,
    deploy: DeploySource = None,
    overrides: Sequence[str] = (),
    plugins: PluginHost,
) -> ResolvedPipeline:
    """Validate `pipeline`, merge its deployment and check every stage's runtime options."""
    check_pipeline(pipeline, plugins)
    deploy_config, raw, user_raw = load_deploy(pipeline, deploy, overrides)
    raw_stages: Mapping[str, Any] = raw.get("stages") or {}
    raw_defaults: Mapping[str, Any] = raw.get("defaults") or {}
    stage_deploys = {
        spec.name: _stage_deploy(deploy_config, spec.name, raw_defaults, raw_stages.get(spec.name) or {})
        for spec in pipeline.stages
    }
    options_classes: dict[str, type] = {}
    stages = []
    for spec in pipeline.stages:
        runtime_ref = plugins.stage_runtimes[spec.kind]
        if spec.kind not in options_classes:
            options_classes[spec.kind] = _options_class(spec.kind, runtime_ref)
        stage_deploy = stage_deploys[spec.name]
        placement_ref = _placement_ref(spec.name, stage_deploy.placement, plugins)
        options = _check_options(spec, stage_deploy, options_classes[spec.kind], plugins)
        if options.get("dtype") == CHECKPOINT_DTYPE:
            _check_checkpoint_dtype(spec.name, model_path)
        inputs = tuple(
            resolve_edge(edge.source, spec.name, edge.adapter, deploy_config, user_raw, raw, stage_deploys, plugins)
            for edge in spec.inputs
        )
        stages.append(
            ResolvedStage(
                name=spec.name,
                kind=spec.kind,
                runtime_ref=runtime_ref,
                model=spec.model,
                inputs=inputs,
                output=spec.output,
                extra_outputs=tuple(spec.extra_outputs),
                output_adapter=spec.output_adapter,
                final=spec.final,
                params=_plain(spec.params),
                placement=stage_deploy.placement,
                placement_ref=placement_ref,
                placement_options=_placement_options(placement_ref, stage_deploy, spec.name),
                replicas=stage_deploy.replicas,
                devices=stage_deploy.devices,
                load_balancer=stage_deploy.load_balancer,
                cpu_threads=stage_deploy.cpu_threads,
                nice=stage_deploy.nice,
                allocator=stage_deploy.allocator,
                watchdog_s=stage_deploy.watchdog_s,
                keep_freed_memory=stage_deploy.keep_freed_memory,
                kernel_cache=stage_deploy.kernel_cache,
                share_model_with=stage_deploy.share_model_with,
                quantization=_resolve_quantization(spec, options, plugins),
                options=options,
            )
        )
    _check_engines_per_process(stages)
    _check_shared_models(stages, model_path)
    for stage in stages:  # what each runtime refuses of the resolved stage (`StageRuntime.check_resolved`)
        check = getattr(load_ref(stage.runtime_ref), "check_resolved", None)
        if check is not None:
            check(stage, structure_config(stage.options, options_classes[stage.kind]), model_path)
    output_connector, output_ref, output_options = resolve_output_connector(
        pipeline, deploy_config, user_raw, raw, stage_deploys, plugins
    )
    return ResolvedPipeline(
        model=model,
        model_path=model_path,
        family=pipeline.family,
        stages=tuple(stages),
        streaming=deploy_config.streaming,
        input_processor=pipeline.input_processor,
        default_modalities=pipeline.default_modalities,
        tasks=pipeline.tasks,
        output_connector=output_connector,
        output_connector_ref=output_ref,
        output_connector_options=output_options,
        placements={
            stage.placement: _plain(load_ref(stage.placement_ref).deploy_options(deploy_config))
            for stage in stages
            if stage.placement_ref is not None
        },
    )


PROCESS_SETTINGS = ("cpu_threads", "nice", "allocator", "keep_freed_memory", "kernel_cache")
"""A stage's settings of its worker process: one that runs in another's process takes that one's."""


def _check_shared_models(stages: list[ResolvedStage], model_path: str) -> None:
    """`StageDeploy.share_model_with`: the stage exists, is another one whose runtime offers its
    model, and both run in one process (both ``process``, or both ``inline``) with as many replicas
    on the same devices, in the host's dtype, with no quantization of its own."""
    from omni_core.stages.base import StageRuntime  # (it imports omni_core.parts, which imports this module)

    by_name = {stage.name: stage for stage in stages}
    for stage in stages:
        host_name = stage.share_model_with
        if host_name is None:
            continue
        key = f"stages.{stage.name}.share_model_with"
        host = by_name.get(host_name)
        if host is None or host is stage:
            raise ConfigError(
                f"stage {stage.name!r} shares the model of {host_name!r}, which is not another stage of this pipeline "
                f"({', '.join(by_name)})",
                key=key,
            )
        if host.share_model_with is not None:
            raise ConfigError(f"stage {host_name!r} itself shares {host.share_model_with!r}'s model: share that one", key=key)
        if getattr(load_ref(host.runtime_ref), "shared_model", StageRuntime.shared_model) is StageRuntime.shared_model:
            raise ConfigError(f"stage {host_name!r}: its {host.kind!r} runtime has no loaded model to share", key=key)
        if stage.placement != host.placement or host.placement not in ("inline", "process"):
            raise ConfigError(
                f"stages {host_name!r} and {stage.name!r} share one model, so they run in one process: give both the "
                f"placement 'process' ({host_name!r}'s worker process runs both) or 'inline' (the engine's), not "
                f"{host.placement!r} and {stage.placement!r}",
                key=key,
            )
        if stage.replicas != host.replicas or stage.devices != host.devices:
            raise ConfigError(
                f"stages {host_name!r} and {stage.name!r} share one model: give them as many replicas and the same "
                f"devices (replica i of one uses replica i's model), not {host.replicas} on {list(host.devices)} "
                f"and {stage.replicas} on {list(stage.devices)}",
                key=key,
            )
        if stage.placement == "process":  # one process: its settings are the host's
            for setting in PROCESS_SETTINGS:
                if getattr(stage, setting) != getattr(host, setting):
                    raise ConfigError(
                        f"stage {stage.name!r} runs in stage {host_name!r}'s worker process, whose {setting} is "
                        f"{getattr(host, setting)!r}: set it on {host_name!r} (not {getattr(stage, setting)!r} on {stage.name!r})",
                        key=f"stages.{stage.name}.{setting}",
                    )
        if stage.options.get("quantization") is not None:
            own_copy = f"give {stage.name!r} its own copy (share_model_with: null)"
            if "quantization" in getattr(load_ref(host.model), "load_options", frozenset()):  # (imports it: on this error only)
                fix = f"set quantization on {host_name!r}, or {own_copy}"
            else:
                fix = f"{host_name!r}'s model part does not apply quantization either: {own_copy} to quantize it"
            raise ConfigError(
                f"stage {stage.name!r} runs on stage {host_name!r}'s weights, so it cannot quantize them: {fix}",
                key=f"stages.{stage.name}.options.quantization",
            )
        dtypes = [other.options.get("dtype") for other in (host, stage)]
        if all(d in ("float32", "bfloat16", "float16", CHECKPOINT_DTYPE) for d in dtypes):
            host_dtype, own = (checkpoint_dtype(model_path) if d == CHECKPOINT_DTYPE else d for d in dtypes)
            if host_dtype != own:
                raise ConfigError(
                    f"stage {stage.name!r} runs on stage {host_name!r}'s weights, which are {host_dtype}: set its dtype "
                    f"to {host_dtype} (or 'checkpoint' where that is the checkpoint's), not {own}",
                    key=f"stages.{stage.name}.options.dtype",
                )


def _placement_options(placement_ref: str, stage_deploy: StageDeploy, stage: str) -> dict[str, Any]:
    """The placement's `Replica.stage_options`; its errors name the stage's key (a placement sees
    only the stage's deploy, not its name)."""
    try:
        return _plain(load_ref(placement_ref).stage_options(stage_deploy))
    except ConfigError as exc:
        if exc.key is not None and exc.key.startswith("stages."):
            raise
        raise ConfigError(exc.message, key=f"stages.{stage}.{exc.key or 'placement'}") from None


# -- the pipeline a family declares ---------------------------------------------------------------


def check_pipeline(pipeline: PipelineConfig, plugins: PluginHost) -> None:
    """Reject a malformed stage graph: names, kinds, inputs, modalities, cycles, final stages."""
    names: list[str] = []
    for spec in pipeline.stages:
        if spec.name in names:
            raise ConfigError(
                f"duplicate stage name {spec.name!r} in family {pipeline.family!r}", key=f"stages.{spec.name}"
            )
        names.append(spec.name)
    if not names:
        raise ConfigError(f"family {pipeline.family!r} declares no stages", key="stages")
    for spec in pipeline.stages:
        if spec.kind not in plugins.stage_runtimes:
            raise ConfigError(
                unknown_name_message("stage runtime kind", spec.kind, plugins.stage_runtimes)
                + " (install the plugin that provides it)",
                key=f"stages.{spec.name}.kind",
            )
        sources = [edge.source for edge in spec.inputs]
        for source in sources:
            if source not in names:
                raise ConfigError(
                    f"input from {unknown_name_message('stage', source, names)}",
                    key=f"stages.{spec.name}.inputs",
                )
            if sources.count(source) > 1:
                raise ConfigError(
                    f"more than one input from stage {source!r}", key=f"stages.{spec.name}.inputs"
                )
        for output in (spec.output, *spec.extra_outputs):
            if output is not None and output not in MODALITIES:
                raise ConfigError(
                    f"output modality {output!r} is not one of: {', '.join(MODALITIES)}",
                    key=f"stages.{spec.name}.output",
                )
    for modality in pipeline.default_modalities:
        if modality not in MODALITIES:
            raise ConfigError(
                f"{modality!r} is not one of: {', '.join(MODALITIES)}", key="default_modalities"
            )
    _check_acyclic(pipeline)
    check_tasks(pipeline)
    finals = [spec for spec in pipeline.stages if spec.final]
    if not finals:
        raise ConfigError(
            f"family {pipeline.family!r} has no final stage: "
            "mark the stage that completes a request final=True",
            key="stages",
        )
    for spec in finals:
        consumers = [
            other.name for other in pipeline.stages if any(e.source == spec.name for e in other.inputs)
        ]
        if consumers:
            raise ConfigError(
                f"final stage {spec.name!r} feeds {', '.join(consumers)}: a final stage must be a sink",
                key=f"stages.{spec.name}.final",
            )


def _check_acyclic(pipeline: PipelineConfig) -> None:
    upstream = {spec.name: [edge.source for edge in spec.inputs] for spec in pipeline.stages}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = trail[trail.index(name) :] + [name]
            # The trail walks inputs (downstream to upstream); report it in data-flow order.
            raise ConfigError(
                f"the stage graph has a cycle: {' -> '.join(reversed(cycle))}", key=f"stages.{name}"
            )
        if name in done:
            return
        for source in upstream[name]:
            visit(source, trail + [name])
        done.add(name)

    for spec in pipeline.stages:
        visit(spec.name, [])


# -- the deploy config ----------------------------------------------------------------------------


def load_deploy(
    pipeline: PipelineConfig, deploy: DeploySource = None, overrides: Sequence[str] = ()
) -> tuple[DeployConfig, dict[str, Any], dict[str, Any]]:
    """Merge the family default, the user's deploy and the overrides; return the config, the raw
    merged dict and the raw dict of the user's layers alone (the deploy and the overrides).

    Each layer is checked on its own first, so an error names the file (or ``--set``) to fix.
    """
    stage_names = [spec.name for spec in pipeline.stages]
    layers: list[tuple[str, dict[str, Any]]] = []
    if pipeline.default_deploy:
        layers.append(_read_default_deploy(pipeline))
    if deploy is not None:
        layers.append(_user_layer(deploy))
    if overrides:
        layers.append(("--set overrides", overrides_to_dict(overrides, stage_names)))
    user: dict[str, Any] = {}  # what the user's layers set (the family's defaults yield where they must)
    for _, layer in layers[1 if pipeline.default_deploy else 0 :]:
        user = deep_merge(user, layer)
    merged: dict[str, Any] = {}
    for source, layer in layers:
        _check_layer(layer, source, pipeline)
        merged = deep_merge(merged, layer)
    for path in unset_paths(overrides, stage_names):  # `--set KEY=`: back to the setting's own default
        merged = drop_path(merged, path)
    config = structure_config(merged, DeployConfig, source="the merged deploy config")
    return config, merged, user


def _read_default_deploy(pipeline: PipelineConfig) -> tuple[str, dict[str, Any]]:
    ref = pipeline.default_deploy or ""
    package, sep, resource = ref.partition(":")
    if not sep or not package or not resource:
        raise PluginError(
            f"family {pipeline.family!r}: default_deploy {ref!r} must be 'package:path/deploy.yaml'"
        )
    try:
        text = _package_file(package, resource)
    except (OSError, ModuleNotFoundError, UnicodeDecodeError) as exc:
        raise PluginError(
            f"family {pipeline.family!r}: cannot read default deploy file {ref}: {exc}"
        ) from exc
    source = f"default deploy file {ref}"
    return source, _parse_yaml(text, source)


def _package_file(package: str, resource: str) -> str:
    return importlib.resources.files(package).joinpath(resource).read_text(encoding="utf-8")


_PACKAGE_REF = re.compile(r"^[A-Za-z_][\w.]*:[\w./-]+\.ya?ml$")


def _user_layer(deploy: str | Path | DeployConfig | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(deploy, DeployConfig):
        return "the deploy argument", _explicit_values(deploy)
    if isinstance(deploy, Mapping):
        return "the deploy argument", dict(deploy)
    path = Path(deploy).expanduser()
    if not path.exists() and _PACKAGE_REF.match(str(deploy)):
        # ``omni_qwen3:deploy/two-nodes.yaml``: a deploy file a plugin ships
        package, _, resource = str(deploy).partition(":")
        try:
            text = _package_file(package, resource)
        except (OSError, ModuleNotFoundError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read deploy file {deploy} (a file of package {package}): {exc}", key=str(deploy)) from exc
        source = f"deploy file {deploy}"
        return source, _parse_yaml(text, source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read deploy file {path}: {exc}", key=str(path)) from exc
    source = f"deploy file {path}"
    return source, _parse_yaml(text, source)


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source} must hold a mapping (streaming, defaults, stages, edges), not {type(data).__name__}"
        )
    return data


def _explicit_values(obj: Any) -> Any:
    """Unstructure an attrs object keeping only values that differ from their defaults.

    A `DeployConfig` built in code says nothing about the fields it leaves at their defaults, so
    those must not erase the family's default deploy file.
    """
    if attrs.has(type(obj)):
        out: dict[str, Any] = {}
        for field in attrs.fields(type(obj)):
            value = getattr(obj, field.name)
            default = field.default
            if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                default = default.factory()  # type: ignore[union-attr]
            if value != default:
                out[field.name] = _explicit_values(value)
        return out
    if isinstance(obj, Mapping):
        return {key: _explicit_values(value) for key, value in obj.items()}
    if isinstance(obj, tuple):
        return list(obj)
    return obj


def _check_layer(layer: dict[str, Any], source: str, pipeline: PipelineConfig) -> None:
    config: DeployConfig = structure_config(layer, DeployConfig, source=source)
    names = [spec.name for spec in pipeline.stages]
    edges = [f"{edge.source}->{spec.name}" for spec in pipeline.stages for edge in spec.inputs]
    for name in config.stages:
        if name not in names:
            raise ConfigError(
                f"{unknown_name_message('stage', name, names)} (in {source})", key=f"stages.{name}"
            )
    for key in config.edges:
        source_name, arrow, target = key.partition("->")
        if not arrow:
            raise ConfigError(f"edge keys are 'SOURCE->TARGET' (in {source})", key=f"edges.{key}")
        for end in (source_name, target):
            if end not in names:
                raise ConfigError(
                    f"edge names {unknown_name_message('stage', end, names)} (in {source})",
                    key=f"edges.{key}",
                )
        if key not in edges:
            raise ConfigError(
                f"the pipeline has no edge {key}; its edges: {', '.join(edges) or 'none'} (in {source})",
                key=f"edges.{key}",
            )
    if config.defaults.options:
        raise ConfigError(
            "runtime options are typed per stage kind: set them per stage (stages.NAME.options) "
            f"(in {source})",
            key="defaults.options",
        )
    for name, stage in [
        ("defaults", config.defaults),
        *((f"stages.{n}", s) for n, s in config.stages.items()),
    ]:
        if stage.replicas < 1:
            raise ConfigError(
                f"replicas must be at least 1, got {stage.replicas} (in {source})", key=f"{name}.replicas"
            )


def _placement_ref(stage: str, placement: str, plugins: PluginHost) -> str:
    if placement not in plugins.placements:
        raise ConfigError(
            unknown_name_message("placement", placement, plugins.placements) + " (install the plugin that provides it)",
            key=f"stages.{stage}.placement",
        )
    return plugins.placements[placement]


def _check_engines_per_process(stages: Sequence[ResolvedStage]) -> None:
    """Refuse more inline replicas of a kind than its runtime allows in one process
    (`StageRuntime.max_inline_replicas`: an engine with process-wide state, such as vLLM's)."""
    inline: dict[str, list[str]] = {}
    for stage in stages:
        if stage.placement == "inline":
            inline.setdefault(stage.kind, []).extend([stage.name] * stage.replicas)
    for kind, names in inline.items():
        limit = getattr(load_ref(next(s.runtime_ref for s in stages if s.kind == kind)), "max_inline_replicas", None)
        if limit is not None and len(names) > limit:
            listed = ", ".join(sorted(set(names)))
            raise ConfigError(
                f"{len(names)} replicas of {kind!r} stages ({listed}) are placed inline, but the {kind!r} runtime allows "
                f"{limit} in one process: place the others in processes (--set STAGE.placement=process)",
                key=f"stages.{names[-1]}.placement",
            )


def _stage_deploy(
    config: DeployConfig, name: str, raw_defaults: Mapping[str, Any], raw_stage: Mapping[str, Any]
) -> StageDeploy:
    # `defaults` fill what the stage's own entry leaves unset; the structured entry alone cannot
    # tell "unset" from "set to the class default", hence the raw dict.
    own = config.stages.get(name, StageDeploy())
    fields = {field: getattr(own, field) for field in STAGE_FIELDS if field in raw_stage}
    return attrs.evolve(config.defaults, options=own.options, **fields)


def _options_class(kind: str, runtime_ref: str) -> type:
    try:
        runtime = load_ref(runtime_ref)
    except ImportError as exc:
        raise PluginError(
            f"stage runtime kind {kind!r} ({runtime_ref}) cannot be imported: {exc}; its module must "
            "import without heavy dependencies (import torch/vllm inside functions)"
        ) from exc
    options_class = getattr(runtime, "Options", None)
    if options_class is None or not attrs.has(options_class):
        raise PluginError(f"stage runtime {runtime_ref} must set `Options` to an attrs class")
    return options_class


def _check_options(
    spec: StageSpec, deploy: StageDeploy, options_class: type, plugins: PluginHost
) -> dict[str, Any]:
    key = f"stages.{spec.name}.options"
    merged = deep_merge(spec.options, deploy.options)
    options = structure_config(
        merged, options_class, key=key, source=f"options of {spec.kind!r} stage {spec.name!r}"
    )
    quantization = getattr(options, "quantization", None)
    if quantization is not None and quantization not in plugins.quantization_resolvers:
        raise ConfigError(
            unknown_name_message("quantization", str(quantization), plugins.quantization_resolvers)
            + " (install the plugin that provides it)",
            key=f"{key}.quantization",
        )
    return _plain(STRICT.unstructure(options))


def _resolve_quantization(spec: StageSpec, options: dict[str, Any], plugins: PluginHost) -> dict[str, Any] | None:
    """Call the registered resolver of the stage's ``quantization`` option (checked to exist by
    `_check_options`) for its kind: what the runtime applies, as plain data."""
    name = options.get("quantization")
    if name is None:
        return None
    key = f"stages.{spec.name}.options.quantization"
    resolver = load_ref(plugins.quantization_resolvers[name])
    try:
        resolved = resolver(spec.kind, dict(options))
    except ConfigError as exc:
        raise ConfigError(f"stage {spec.name!r}: {exc}", key=key) from exc
    if not isinstance(resolved, dict):
        raise ConfigError(
            f"quantization resolver {name!r} returned {type(resolved).__name__}, not a dict, for {spec.kind!r} stage {spec.name!r}",
            key=key,
        )
    return _plain(resolved)


def _check_checkpoint_dtype(stage: str, model_path: str) -> None:
    """``dtype: checkpoint`` needs a checkpoint that says its dtype: fail now, not in the stage."""
    try:
        checkpoint_dtype(model_path)
    except ConfigError as exc:
        raise ConfigError(str(exc), key=f"stages.{stage}.options.dtype") from exc


def _plain(value: Any) -> Any:
    """JSON-shaped copy (tuples become lists), so `ResolvedPipeline` survives a JSON round trip."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _default_plugins() -> PluginHost:
    from omni_core.plugins import default_plugins

    return default_plugins()
