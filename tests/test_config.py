"""`resolve()`, deploy files, ``--set`` overrides and model references, with a throwaway family.

The plugin host is a stand-in with the `PluginHost` attributes `resolve()` reads, so these tests are
about config resolution alone; nothing here imports torch or starts a stage.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import pytest

from omni_core.config import (
    DeployConfig,
    EdgeSpec,
    PipelineConfig,
    ResolvedPipeline,
    StageDeploy,
    StageSpec,
    checkpoint_dtype,
    read_hf_config,
    resolve,
    resolve_dtype,
    resolve_model_path,
    resolve_pipeline,
)
from omni_core.config.deploy import RayStageDeploy
from omni_core.errors import ConfigError, UnknownModelError
from omni_core.families import PipelineFamily
from omni_core.runtime.placement import Replica
from omni_core.runtime.ray_placement import RayReplica

HERE = __name__
DEPLOY_PACKAGE = "omni_toy_deploy_pkg"
DEFAULT_DEPLOY = """
defaults:
  placement: inline
stages:
  thinker:
    replicas: 2
    options: {max_num_seqs: 16}
  talker:
    devices: [cpu]
edges:
  thinker->talker:
    options: {slots: 4}
"""


# -- the throwaway family -------------------------------------------------------------------------


@attrs.frozen
class ToyAROptions:
    """Options of the toy ``ar`` kind."""

    max_num_seqs: int = 8
    dtype: Literal["float32", "bfloat16", "checkpoint"] = "float32"
    quantization: str | None = None
    layers: tuple[int, ...] = ()


class ToyARRuntime:
    """Stands for a stage runtime class: `resolve()` only reads its `Options`, and whether it
    overrides `StageRuntime.shared_model` (``share_model_with``); as the thinker's model part, the
    options it applies (`load_options`)."""

    Options = ToyAROptions
    load_options = frozenset({"quantization"})

    def shared_model(self) -> Any:
        raise NotImplementedError


@attrs.frozen
class ToyDecodeOptions:
    """Options of the toy ``generation`` kind: different from the ``ar`` ones."""

    chunk_size: int = 25
    left_context: int = 0


class ToyDecodeRuntime:
    Options = ToyDecodeOptions


def toy_stages() -> tuple[StageSpec, ...]:
    return (
        StageSpec(
            name="thinker",
            kind="ar",
            model=f"{HERE}:ToyARRuntime",
            output="text",
            params={"stop_token_ids": (1, 2)},
            options={"dtype": "bfloat16", "max_num_seqs": 4},
        ),
        StageSpec(
            name="talker",
            kind="ar",
            model=f"{HERE}:ToyARRuntime",
            inputs=(EdgeSpec("thinker", adapter=f"{HERE}:ToyARRuntime"),),
        ),
        StageSpec(
            name="vocoder",
            kind="generation",
            model=f"{HERE}:ToyDecodeRuntime",
            inputs=(EdgeSpec("talker"),),
            output="audio",
            final=True,
        ),
    )


def toy_pipeline_with_shm(model_path: str, hf_config: dict[str, Any]) -> PipelineConfig:
    return attrs.evolve(toy_pipeline(model_path, hf_config), default_deploy=f"{DEPLOY_PACKAGE}:deploy/toy-shm.yaml")


def toy_pipeline(model_path: str, hf_config: dict[str, Any]) -> PipelineConfig:
    return PipelineConfig(
        family="toy",
        stages=toy_stages(),
        default_deploy=f"{DEPLOY_PACKAGE}:deploy/toy.yaml",
        default_modalities=("text", "audio"),
    )


TINY_CALLS: list[Path] = []


class InProc:
    """Stands in for a connector class: `resolve` checks options against its constructor."""

    def __init__(self, slots: int = 1) -> None:
        self.slots = slots


class Shm:
    def __init__(self, **options: Any) -> None:
        self.options = options


class Net(Shm):
    """A connector that reaches across hosts."""

    host_local = False


class Remote(Replica):
    """Stands in for a placement whose replicas may land on any host (as Ray's may); never started."""

    @classmethod
    def host(cls, deploy: Any) -> str | None:
        return None


def toy_fp8(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """A plugin's quantization resolver: what each kind's runtime applies."""
    return {"quantization": "fp8"} if kind == "ar" else {"method": "fp8", "kind": kind}


def toy_w4(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """A resolver for diffusion stages only."""
    raise ConfigError(f"w4 does not support {kind!r} stages")


def make_toy_tiny(directory: Path, size: str) -> None:
    TINY_CALLS.append(directory)
    time.sleep(0.2)  # long enough for a concurrent first use to overlap
    (directory / "config.json").write_text(json.dumps({"architectures": ["ToyForOmni"], "size": size}))


def make_broken_tiny(directory: Path, size: str) -> None:
    (directory / "config.json").write_text("{}")
    raise RuntimeError("disk full")


@attrs.frozen
class StandInHost:
    """The attributes of `omni_core.plugins.PluginHost` that `resolve()` uses."""

    families: Mapping[str, PipelineFamily]
    stage_runtimes: Mapping[str, str]
    connectors: Mapping[str, str]
    quantization_resolvers: Mapping[str, str]
    placements: Mapping[str, str]

    def family_for(self, model_ref: str, hf_config: Mapping[str, Any]) -> PipelineFamily:
        for family in self.families.values():
            if set(hf_config.get("architectures", ())) & set(family.architectures):
                return family
        raise UnknownModelError(f"no family for {model_ref}")


@pytest.fixture
def host() -> StandInHost:
    return StandInHost(
        families={
            "toy": PipelineFamily(
                name="toy",
                pipeline=f"{HERE}:toy_pipeline",
                architectures=("ToyForOmni",),
                make_tiny=f"{HERE}:make_toy_tiny",
            )
        },
        stage_runtimes={"ar": f"{HERE}:ToyARRuntime", "generation": f"{HERE}:ToyDecodeRuntime"},
        connectors={"inproc": f"{HERE}:InProc", "shm": f"{HERE}:Shm", "net": f"{HERE}:Net"},
        quantization_resolvers={"fp8": f"{HERE}:toy_fp8", "w4": f"{HERE}:toy_w4"},
        placements={
            "inline": "omni_core.runtime.replica:InlineReplica",
            "process": "omni_core.runtime.replica:ProcessReplica",
            "remote": f"{HERE}:Remote",
            "ray": "omni_core.runtime.ray_placement:RayReplica",
        },
    )


@pytest.fixture(scope="session")
def deploy_package_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pkgroot")
    package = root / DEPLOY_PACKAGE
    (package / "deploy").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "deploy" / "toy.yaml").write_text(DEFAULT_DEPLOY)
    (package / "deploy" / "toy-shm.yaml").write_text("defaults: {placement: process}\nedges:\n  thinker->talker: {connector: shm}\n")
    return root


@pytest.fixture(autouse=True)
def deploy_package(deploy_package_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The family's default deploy file is a package resource, as in a real plugin.
    monkeypatch.syspath_prepend(str(deploy_package_root))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "toy-ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["ToyForOmni"]}))
    return directory


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- happy path and precedence --------------------------------------------------------------------


def test_resolve_merges_family_default_user_file_and_overrides(host, checkpoint, tmp_path):
    user = write(
        tmp_path / "deploy.yaml", "stages:\n  thinker:\n    replicas: 3\n    options: {max_num_seqs: 32}\n"
    )
    resolved = resolve(str(checkpoint), deploy=user, overrides=["thinker.max_num_seqs=64"], plugins=host)

    assert resolved.family == "toy"
    assert resolved.model_path == str(checkpoint.resolve())
    assert [s.name for s in resolved.stages] == ["thinker", "talker", "vocoder"]
    thinker = resolved.stage("thinker")
    assert thinker.replicas == 3  # user file beats the family default (2)
    assert thinker.options["max_num_seqs"] == 64  # --set beats the user file (32) and family (16, 4)
    assert thinker.options["dtype"] == "bfloat16"  # the family's stage option survives
    assert thinker.placement == "inline"  # from the family default's `defaults`
    assert thinker.runtime_ref == f"{HERE}:ToyARRuntime"
    assert thinker.params == {"stop_token_ids": [1, 2]}
    talker = resolved.stage("talker")
    assert talker.devices == ("cpu",) and talker.replicas == 1
    assert talker.options == {"max_num_seqs": 8, "dtype": "float32", "quantization": None, "layers": []}
    assert resolved.stage("vocoder").options == {"chunk_size": 25, "left_context": 0}
    edge = talker.inputs[0]
    assert (edge.key, edge.connector, edge.connector_ref) == (
        "thinker->talker",
        "inproc",
        f"{HERE}:InProc",
    )
    assert edge.connector_options == {"slots": 4}
    assert edge.adapter == f"{HERE}:ToyARRuntime"
    assert resolved.output_connector == "inproc"
    assert resolved.default_modalities == ("text", "audio")
    assert resolved.modalities == ("text", "audio")


def test_override_forms(host, checkpoint):
    resolved = resolve(
        str(checkpoint),
        overrides=[
            "defaults.placement=process",
            "talker.placement=inline",
            "streaming=false",
            "thinker.devices=[cpu0, cpu1]",
            "thinker.options.layers=[1, 2]",
            "vocoder.chunk_size=50",
            "stages.vocoder.load_balancer=round_robin",
            "defaults.cpu_threads=1",
            "talker.nice=5",
            "edge.thinker->talker.connector=shm",
            "edges.talker->vocoder.timeout=2.5",
            "output_connector.connector=shm",
        ],
        plugins=host,
    )
    assert resolved.streaming is False
    assert resolved.stage("thinker").placement == "process"
    assert resolved.stage("talker").placement == "inline"
    assert resolved.stage("thinker").devices == ("cpu0", "cpu1")
    assert resolved.stage("thinker").options["layers"] == [1, 2]
    assert resolved.stage("vocoder").options["chunk_size"] == 50
    assert resolved.stage("vocoder").load_balancer == "round_robin"
    assert [s.cpu_threads for s in resolved.stages] == [1, 1, 1]
    assert [s.nice for s in resolved.stages] == [0, 5, 0]
    talker_in, vocoder_in = resolved.stage("talker").inputs[0], resolved.stage("vocoder").inputs[0]
    assert talker_in.connector == "shm"
    # Not named: a stage outside the process gets shared memory by default.
    assert (vocoder_in.connector, vocoder_in.connector_options) == ("shm", {"timeout": 2.5})
    assert resolved.output_connector == "shm"


def test_later_override_wins(host, checkpoint):
    resolved = resolve(str(checkpoint), overrides=["thinker.replicas=2", "thinker.replicas=5"], plugins=host)
    assert resolved.stage("thinker").replicas == 5


def test_deploy_config_object_overrides_only_what_it_sets(host, checkpoint):
    deploy = DeployConfig(streaming=False, stages={"talker": StageDeploy(replicas=4)})
    resolved = resolve(str(checkpoint), deploy=deploy, plugins=host)
    assert resolved.streaming is False
    assert resolved.stage("talker").replicas == 4
    # The family default file's values stay where the object left fields at their defaults.
    assert resolved.stage("talker").devices == ("cpu",)
    assert resolved.stage("talker").placement == "inline"
    assert resolved.stage("thinker").replicas == 2


def test_json_round_trip(host, checkpoint):
    resolved = resolve(str(checkpoint), overrides=["thinker.layers=[3]"], plugins=host)
    data = json.loads(json.dumps(resolved.to_dict()))
    assert ResolvedPipeline.from_dict(data) == resolved


def test_quantization_names_a_registered_resolver(host, checkpoint):
    resolved = resolve(str(checkpoint), overrides=["thinker.quantization=fp8"], plugins=host)
    assert resolved.stage("thinker").options["quantization"] == "fp8"
    # The resolver ran at resolve time: workers get plain data and import no resolver.
    assert resolved.stage("thinker").quantization == {"quantization": "fp8"}
    assert resolved.stage("talker").quantization is None
    with pytest.raises(ConfigError, match="w4 does not support 'ar' stages") as refused:
        resolve(str(checkpoint), overrides=["thinker.quantization=w4"], plugins=host)
    assert refused.value.key == "stages.thinker.options.quantization"
    with pytest.raises(ConfigError) as info:
        resolve(str(checkpoint), overrides=["thinker.quantization=int3"], plugins=host)
    assert info.value.key == "stages.thinker.options.quantization"
    assert "fp8" in str(info.value)


# -- rejections -----------------------------------------------------------------------------------


def reject(host: StandInHost, checkpoint: Path, key: str, *overrides: str, deploy: Any = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        resolve(str(checkpoint), deploy=deploy, overrides=overrides, plugins=host)
    assert info.value.key == key
    assert key in str(info.value)
    return info.value


@pytest.mark.parametrize(
    ("override", "key", "hint"),
    [
        ("thinkr.replicas=2", "stages.thinkr", "did you mean 'thinker'"),
        ("thinker.max_num_seqz=3", "stages.thinker.options.max_num_seqz", "max_num_seqs"),
        ("thinker.replicas=two", "stages.thinker.replicas", "integer"),
        ("thinker.replicas=0", "stages.thinker.replicas", "at least 1"),
        ("thinker.replicas=1.5", "stages.thinker.replicas", "integer"),
        ("thinker.placement=cloud", "stages.thinker.placement", "inline, process"),
        ("thinker.cpu_threads=0", "stages.thinker", ">= 1"),
        ("thinker.cpu_threads=all", "stages.thinker.cpu_threads", "int"),
        ("talker.nice=20", "stages.talker", "<= 19"),
        ("thinker.max_num_seqs=many", "stages.thinker.options.max_num_seqs", "integer"),
        ("thinker.dtype=fp16", "stages.thinker.options.dtype", "bfloat16"),
        ("thinker.devices=cpu", "stages.thinker.devices", "a list"),
        ("vocoder.max_num_seqs=3", "stages.vocoder.options.max_num_seqs", "chunk_size"),
        ("streaming=maybe", "streaming", "true or false"),
        ("thinker.placement=rey", "stages.thinker.placement", "unknown placement 'rey' (did you mean 'ray'?); known: inline, process, ray, remote"),
        ("edge.thinker->talker.connector=carrier-pigeon", "edges.thinker->talker.connector", "inproc, net, shm"),
        ("edge.thinker->talker.slotz=4", "edges.thinker->talker.options.slotz", "did you mean 'slots'"),
        ("edge.thinker->nobody.connector=shm", "edges.thinker->nobody", "unknown stage 'nobody'"),
        ("edge.thinker->vocoder.connector=shm", "edges.thinker->vocoder", "thinker->talker"),
        ("output_connector.connector=smoke", "output_connector.connector", "unknown connector"),
        ("defaults.options.max_num_seqs=3", "defaults.options", "per stage"),
        ("thinker.placement=process", "edges.thinker->talker.connector", "inline"),  # inproc across processes
    ],
)
def test_override_rejections_name_the_key(host, checkpoint, override, key, hint):
    error = reject(
        host,
        checkpoint,
        key,
        *(
            # The last case keeps the user's inproc choice while moving one end out of process.
            [override, "edge.thinker->talker.connector=inproc"]
            if override.endswith("=process")
            else [override]
        ),
    )
    assert hint in str(error)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("thinker.replicas", "thinker.replicas"),
        ("=3", "=3"),
        ("thinker..replicas=2", "thinker..replicas"),
        ("thinker=2", "thinker"),
    ],
)
def test_malformed_overrides(host, checkpoint, text, key):
    reject(host, checkpoint, key, text)


def test_an_edge_that_may_cross_hosts_gets_a_connector_that_reaches_across(host, checkpoint):
    resolved = resolve(str(checkpoint), overrides=["talker.placement=remote"], plugins=host)
    assert resolved.stage("talker").inputs[0].connector == "net"  # the default: one that reaches
    assert resolved.stage("vocoder").inputs[0].connector == "net"
    assert resolved.output_connector == "net"  # the engine talks to the talker across hosts too
    error = reject(host, checkpoint, "edges.thinker->talker.connector", "talker.placement=remote", "edge.thinker->talker.connector=shm")
    assert "stages 'thinker' and 'talker' may run on different hosts, but connector 'shm' works within one host: use net" in str(error)
    no_network = attrs.evolve(host, connectors={k: v for k, v in host.connectors.items() if k != "net"})
    error = reject(no_network, checkpoint, "edges.thinker->talker.connector", "talker.placement=remote")
    assert "pip install omni-connectors-mooncake" in str(error)


def test_ray_stages_pinned_alike_share_a_host_and_others_do_not(host, checkpoint):
    pin_b = ["talker.placement=ray", "vocoder.placement=ray", "talker.ray.resources.node_b=0.01", "vocoder.ray.resources.node_b=0.01"]
    resolved = resolve(str(checkpoint), overrides=pin_b, plugins=host)
    assert resolved.stage("talker").inputs[0].connector == "net"  # the engine's host -> node b
    assert resolved.stage("vocoder").inputs[0].connector == "shm"  # both on node b: shared memory is right
    assert resolved.output_connector == "net"
    talker = resolved.stage("talker")
    assert talker.placement_options == {"resources": {"node_b": 0.01}, "num_cpus": 1.0, "num_gpus": 0.0, "label_selector": {}}
    assert resolved.placements == {"ray": {"address": None}, "inline": {}}
    assert ResolvedPipeline.from_dict(json.loads(json.dumps(resolved.to_dict()))) == resolved
    # Different pins (a resource, a label), or none at all: different (or unknown) hosts.
    for vocoder in (["vocoder.ray.resources.node_c=0.01"], ["vocoder.ray.label_selector={omni-node: b}"], []):
        overrides = [*pin_b[:3], "vocoder.placement=ray", *vocoder, "edge.talker->vocoder.connector=shm"]
        error = reject(host, checkpoint, "edges.talker->vocoder.connector", *overrides)
        assert "stages 'talker' and 'vocoder' may run on different hosts" in str(error)
    # Only CPUs and GPUs pin nothing.
    assert RayReplica.host(StageDeploy(placement="ray", ray=RayStageDeploy(resources={"CPU": 2.0}, num_gpus=1))) is None


def test_ray_options_are_checked_and_the_address_is_deploy_wide(host, checkpoint):
    error = reject(host, checkpoint, "stages.talker.ray.gpus", "talker.placement=ray", "talker.ray.gpus=1")
    assert "did you mean" in str(error)
    error = reject(host, checkpoint, "stages.talker.ray", "talker.placement=ray", "talker.ray.num_cpus=-1")
    assert "'num_cpus' must be >= 0: -1" in str(error)
    resolved = resolve(str(checkpoint), overrides=["talker.placement=ray", "ray.address=10.0.0.5:6379", "talker.ray.num_gpus=1"], plugins=host)
    assert resolved.placements["ray"] == {"address": "10.0.0.5:6379"}
    assert resolved.stage("talker").placement_options["num_gpus"] == 1


def test_a_family_default_connector_yields_where_stages_move_apart_but_a_chosen_one_is_refused(host, checkpoint, tmp_path):
    # The family's default deploy names shm for thinker->talker (written for one host).
    family = host.families["toy"]
    with_shm = attrs.evolve(host, families={"toy": attrs.evolve(family, pipeline=f"{HERE}:toy_pipeline_with_shm")})
    assert resolve(str(checkpoint), plugins=with_shm).stage("talker").inputs[0].connector == "shm"
    moved = resolve(str(checkpoint), overrides=["talker.placement=remote"], plugins=with_shm)
    assert moved.stage("talker").inputs[0].connector == "net"
    error = reject(with_shm, checkpoint, "edges.thinker->talker.connector", "talker.placement=remote", "edge.thinker->talker.connector=shm")
    assert "works within one host: use net" in str(error)


@pytest.mark.parametrize("text", ["edge.thinker-", "edge.thinker.connector=shm"])
def test_an_unquoted_edge_override_says_to_quote_it(host, checkpoint, text):
    # Unquoted, `--set edge.thinker->talker.connector=shm` reaches us as `edge.thinker-` (the shell
    # redirected the rest into a file).
    error = reject(host, checkpoint, text.partition("=")[0], text)
    assert "--set 'edge.SRC->DST.connector=NAME'" in str(error)


@pytest.mark.parametrize(
    ("yaml_text", "key"),
    [
        ("stages:\n  thinkr: {replicas: 2}\n", "stages.thinkr"),
        ("stages:\n  thinker: {replicas: two}\n", "stages.thinker.replicas"),
        ("stages:\n  thinker: {options: {max_num_seqz: 1}}\n", "stages.thinker.options.max_num_seqz"),
        ("stages:\n  talker: {replicas: -1}\n", "stages.talker.replicas"),
        ("stages:\n  thinker: {colour: red}\n", "stages.thinker.colour"),
        ("edges:\n  thinker-talker: {connector: shm}\n", "edges.thinker-talker"),
    ],
)
def test_deploy_file_rejections_name_key_and_file(host, checkpoint, tmp_path, yaml_text, key):
    user = write(tmp_path / "bad.yaml", yaml_text)
    error = reject(host, checkpoint, key, deploy=user)
    if not key.endswith("max_num_seqz"):  # options are checked after merging, per stage kind
        assert str(user) in str(error)


def test_invalid_and_unreadable_deploy_files_are_named(host, checkpoint, tmp_path):
    broken = write(tmp_path / "broken.yaml", "stages: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml.*not valid YAML"):
        resolve(str(checkpoint), deploy=broken, plugins=host)
    listed = write(tmp_path / "list.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml must hold a mapping"):
        resolve(str(checkpoint), deploy=listed, plugins=host)
    with pytest.raises(ConfigError, match="cannot read deploy file .*missing.yaml"):
        resolve(str(checkpoint), deploy=tmp_path / "missing.yaml", plugins=host)


def resolve_stages(host: StandInHost, *stages: StageSpec, **pipeline: Any) -> ResolvedPipeline:
    return resolve_pipeline(
        PipelineConfig(family="toy", stages=stages, **pipeline),
        model="toy",
        model_path="/nowhere",
        plugins=host,
    )


def reject_stages(host: StandInHost, key: str, *stages: StageSpec, **pipeline: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        resolve_stages(host, *stages, **pipeline)
    assert info.value.key == key
    assert key in str(info.value)
    return info.value


def spec(name: str, *sources: str, kind: str = "ar", **fields: Any) -> StageSpec:
    return StageSpec(
        name=name, kind=kind, model="toy:Model", inputs=tuple(EdgeSpec(s) for s in sources), **fields
    )


def test_pipeline_graph_rejections(host):
    reject_stages(host, "stages.a", spec("a"), spec("a", final=True))
    error = reject_stages(host, "stages.b.inputs", spec("a"), spec("b", "nope", final=True))
    assert "unknown stage 'nope'" in str(error)
    error = reject_stages(host, "stages.a.kind", spec("a", kind="quantum", final=True))
    assert "ar, generation" in str(error)
    error = reject_stages(host, "stages.a.output", spec("a", final=True, output="smell"))
    assert "text, audio" in str(error)
    reject_stages(host, "default_modalities", spec("a", final=True), default_modalities=("smell",))
    error = reject_stages(host, "stages", spec("a"), spec("b", "a"))
    assert "no final stage" in str(error)
    error = reject_stages(host, "stages.a.final", spec("a", final=True), spec("b", "a", final=True))
    assert "feeds b" in str(error)
    reject_stages(host, "stages", default_modalities=("text",))


def test_cycle_is_named(host):
    with pytest.raises(ConfigError) as info:
        resolve_stages(host, spec("a", "c"), spec("b", "a"), spec("c", "b"), spec("out", "c", final=True))
    message = str(info.value)
    assert "cycle" in message
    assert any(cycle in message for cycle in ("a -> b -> c -> a", "b -> c -> a -> b", "c -> a -> b -> c"))
    with pytest.raises(ConfigError, match="cycle: s -> s"):
        resolve_stages(host, spec("s", "s", final=True))


def test_two_final_stages_and_no_default_deploy(host):
    resolved = resolve_stages(
        host, spec("a", output="text", final=True), spec("b", kind="generation", final=True)
    )
    assert [(s.placement, s.replicas) for s in resolved.stages] == [("process", 1), ("process", 1)]
    assert resolved.output_connector == "shm"


# -- model references -----------------------------------------------------------------------------


def test_local_directory_and_hf_config(host, checkpoint, tmp_path):
    assert resolve_model_path(str(checkpoint), host) == checkpoint.resolve()
    assert read_hf_config(checkpoint) == {"architectures": ["ToyForOmni"]}
    diffusers = tmp_path / "diffusers-ckpt"
    diffusers.mkdir()
    (diffusers / "model_index.json").write_text(json.dumps({"_class_name": "ToyPipeline"}))
    assert read_hf_config(diffusers)["_class_name"] == "ToyPipeline"
    with pytest.raises(UnknownModelError, match="neither config.json nor model_index.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        read_hf_config(tmp_path)


def test_omni_tiny_is_created_once_then_reused(host, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE", str(tmp_path / "cache"))
    TINY_CALLS.clear()
    results: list[Any] = []

    def first_use() -> None:
        try:
            results.append(resolve("omni-tiny/toy", plugins=host))
        except BaseException as exc:  # surfaced by the assertion below
            results.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(isinstance(r, ResolvedPipeline) for r in results), results
    assert len(TINY_CALLS) == 1
    target = tmp_path / "cache" / "tiny" / "toy"
    assert {r.model_path for r in results} == {str(target)}
    assert json.loads((target / "config.json").read_text())["size"] == "tiny"
    assert resolve("omni-tiny/toy", plugins=host).model == "omni-tiny/toy"
    assert len(TINY_CALLS) == 1
    # No staging directories are left behind.
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")) == ["toy"]


def test_omni_tiny_of_a_new_format_is_written_afresh(host, tmp_path, monkeypatch):
    """A family whose tiny checkpoint changed (`tiny_format`) does not reuse one an older plugin
    cached; the old one stays where it is (a running process may still read it)."""
    monkeypatch.setenv("OMNI_CACHE", str(tmp_path / "cache"))
    TINY_CALLS.clear()
    old = resolve_model_path("omni-tiny/toy", host)
    newer = attrs.evolve(host, families={"toy": attrs.evolve(host.families["toy"], tiny_format=2)})
    new = resolve_model_path("omni-tiny/toy", newer)
    assert old == tmp_path / "cache" / "tiny" / "toy" and new == tmp_path / "cache" / "tiny" / "toy.v2"
    assert len(TINY_CALLS) == 2 and (old / "config.json").is_file() and (new / "config.json").is_file()
    assert resolve_model_path("omni-tiny/toy", newer) == new and len(TINY_CALLS) == 2  # then reused
    with pytest.raises(ValueError):
        attrs.evolve(host.families["toy"], tiny_format=0)


def test_omni_tiny_unknown_family(host, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE", str(tmp_path))
    with pytest.raises(UnknownModelError, match="omni-tiny/toy"):
        resolve_model_path("omni-tiny/nope", host)


def test_omni_tiny_failed_build_leaves_nothing(host, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE", str(tmp_path))
    broken = attrs.evolve(
        host, families={"toy": attrs.evolve(host.families["toy"], make_tiny=f"{HERE}:make_broken_tiny")}
    )
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model_path("omni-tiny/toy", broken)
    assert [p.name for p in (tmp_path / "tiny").iterdir() if not p.name.endswith(".lock")] == []


def test_hub_id_from_local_cache_only(host, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snapshot = hub / "models--toy-org--toy-model" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["ToyForOmni"]}))
    (hub / "models--toy-org--toy-model" / "refs").mkdir()
    (hub / "models--toy-org--toy-model" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)  # so "toy-org/toy-model" is not a local directory
    assert resolve_model_path("toy-org/toy-model", host) == snapshot
    assert resolve("toy-org/toy-model", plugins=host).model_path == str(snapshot)
    with pytest.raises(UnknownModelError, match="not in the local Hugging Face cache"):
        resolve_model_path("toy-org/absent", host)


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("no-such-thing", "not a local directory"),
        ("a/b/c/d", "not a local directory"),
        ("", "empty model reference"),
    ],
)
def test_unknown_reference(host, tmp_path, monkeypatch, ref, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownModelError, match=message):
        resolve(ref, plugins=host)


def _safetensors(path: Path, tensors: dict[str, tuple[str, int]]) -> None:
    """A safetensors file by hand (no torch here): name -> (dtype, bytes)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, size) in tensors.items():
        width = {"I64": 8, "F32": 4}.get(dtype, 2)
        header[name] = {"dtype": dtype, "shape": [size // width], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(offset))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, "float16"),
        ({"torch_dtype": "torch.float32"}, "float32"),
    ],
)
def test_checkpoint_dtype_from_the_config(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], **config}))
    _safetensors(tmp_path / "model.safetensors", {"w": ("F32", 8)})  # the config wins
    assert checkpoint_dtype(tmp_path) == expected
    assert resolve_dtype("checkpoint", tmp_path) == expected
    assert resolve_dtype("float16", tmp_path) == "float16"  # any other value is kept


def test_checkpoint_dtype_from_the_weights_and_its_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(ConfigError, match="names no dtype"):
        checkpoint_dtype(tmp_path)
    # The first floating-point tensor of the first shard (integer buffers are skipped).
    _safetensors(tmp_path / "model-00001-of-00002.safetensors", {"ids": ("I64", 16), "w": ("BF16", 4)})
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", {"v": ("F32", 4)})
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ConfigError, match="cannot read the header"):
        checkpoint_dtype(tmp_path)


def test_checkpoint_dtype_is_checked_before_anything_starts(host, checkpoint):
    # The toy checkpoint's config names no dtype and it has no weights.
    with pytest.raises(ConfigError, match="names no dtype") as error:
        resolve(str(checkpoint), overrides=["talker.dtype=checkpoint"], plugins=host)
    assert error.value.key == "stages.talker.options.dtype"
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["ToyForOmni"], "torch_dtype": "bfloat16"}))
    resolved = resolve(str(checkpoint), overrides=["talker.dtype=checkpoint"], plugins=host)
    assert resolved.stage("talker").options["dtype"] == "checkpoint"  # the stage resolves it where it loads


def test_a_deploy_file_a_plugin_ships_is_named_package_colon_path(host, checkpoint):
    resolved = resolve(str(checkpoint), deploy=f"{DEPLOY_PACKAGE}:deploy/toy-shm.yaml", plugins=host)
    assert resolved.stage("thinker").placement == "process"
    error = reject(host, checkpoint, f"{DEPLOY_PACKAGE}:deploy/nothing.yaml", deploy=f"{DEPLOY_PACKAGE}:deploy/nothing.yaml")
    assert f"a file of package {DEPLOY_PACKAGE}" in str(error)


def test_an_empty_override_unsets_a_setting_back_to_its_own_default(host, checkpoint):
    # The family default deploy sets thinker's max_num_seqs to 16 and talker's devices to [cpu].
    resolved = resolve(str(checkpoint), overrides=["thinker.max_num_seqs=", "talker.devices=", "defaults.placement="], plugins=host)
    assert resolved.stage("thinker").options["max_num_seqs"] == 4  # the stage's own (its StageSpec's), not the deploy's 16
    assert resolved.stage("talker").devices == ()
    assert {s.placement for s in resolved.stages} == {"process"}  # StageDeploy's default
    again = resolve(str(checkpoint), overrides=["thinker.max_num_seqs=", "thinker.max_num_seqs=6"], plugins=host)
    assert again.stage("thinker").options["max_num_seqs"] == 6  # a later value sets it again


def test_share_model_with_is_checked_before_anything_starts(host, checkpoint):
    """``share_model_with``: another stage of the pipeline whose runtime offers its model, both in one
    process (both ``process`` or both ``inline``), as many replicas on the same devices, in its dtype,
    not quantized on its own; anything else is refused at resolve, naming the key."""
    shared = ["talker.share_model_with=thinker", "talker.replicas=2", "thinker.devices=[cpu]", "talker.dtype=bfloat16"]
    assert resolve(str(checkpoint), overrides=shared, plugins=host).stage("talker").share_model_with == "thinker"
    key = "stages.talker.share_model_with"
    assert "not another stage" in str(reject(host, checkpoint, key, "talker.share_model_with=nobody"))
    assert "not another stage" in str(reject(host, checkpoint, key, "talker.share_model_with=talker"))
    assert "as many replicas" in str(reject(host, checkpoint, key, "talker.share_model_with=thinker"))
    offers_none = reject(host, checkpoint, key, "talker.share_model_with=vocoder")
    assert "'generation' runtime has no loaded model to share" in str(offers_none)
    assert "placement 'process'" in str(reject(host, checkpoint, key, *shared, "thinker.placement=process"))
    in_processes = resolve(str(checkpoint), overrides=[*shared, "thinker.placement=process", "talker.placement=process"], plugins=host)
    assert in_processes.stage("talker").placement == "process"
    threads = reject(host, checkpoint, "stages.talker.cpu_threads", *shared, "thinker.placement=process", "talker.placement=process",
                     "talker.cpu_threads=2")
    assert "runs in stage 'thinker''s worker process, whose cpu_threads is None: set it on 'thinker'" in str(threads)
    assert "'ray'" in str(reject(host, checkpoint, key, *shared, "thinker.placement=ray", "talker.placement=ray"))
    dtype = reject(host, checkpoint, "stages.talker.options.dtype", *shared, "talker.dtype=float32")
    assert "which are bfloat16: set its dtype to bfloat16" in str(dtype)
    quantized = reject(host, checkpoint, "stages.talker.options.quantization", *shared, "talker.quantization=fp8")
    assert "runs on stage 'thinker''s weights, so it cannot quantize them: set quantization on 'thinker'" in str(quantized)
    mutual = reject(host, checkpoint, "stages.thinker.share_model_with", *shared, "thinker.share_model_with=talker")
    assert "itself shares" in str(mutual)
