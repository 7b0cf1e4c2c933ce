"""The plugin manager: loading in isolation, allowlist, registries, family choice, reporting."""

from __future__ import annotations

import inspect
import types
from pathlib import Path
from typing import Any, Callable

import attrs
import click
import pytest

from omni_core import __version__, hookimpl, hookspecs
from omni_core.config import resolve
from omni_core.errors import ConfigError, PluginError, UnknownModelError, UnknownNameError
from omni_core.families import PipelineFamily
from omni_core.plugins import _NAMED_REGISTRIES, BUILTINS_NAME, PluginHost, default_plugins, load_plugins
from omni_core.runtime.replica import InlineReplica


@attrs.define
class FakeEntryPoint:
    """Stands in for `importlib.metadata.EntryPoint`: a name, a `load()` and a `dist`."""

    name: str
    target: Any
    version: str | None = "1.2.3"

    def load(self) -> Any:
        if isinstance(self.target, BaseException):
            raise self.target
        return self.target

    @property
    def dist(self) -> Any:
        return types.SimpleNamespace(version=self.version)


def family(name: str, **kwargs: Any) -> PipelineFamily:
    return PipelineFamily(name=name, pipeline=f"omni_{name.replace('-', '_')}.pipeline:build", **kwargs)


def families_plugin(plugin_name: str, *families: PipelineFamily) -> type:
    class Plugin:
        @hookimpl
        def register_pipelines(register: Callable[[PipelineFamily], None]) -> None:
            for item in families:
                register(item)

    Plugin.__name__ = plugin_name
    return Plugin


def resolver_plugin(plugin_name: str, answer: Callable[[str, dict], str | None], **marker: Any) -> type:
    class Plugin:
        @hookimpl(**marker)
        def resolve_pipeline(model_ref: str, hf_config: dict) -> str | None:
            return answer(model_ref, hf_config)

    Plugin.__name__ = plugin_name
    return Plugin


QWEN = family(
    "qwen3-omni",
    architectures=("Qwen3OmniMoeForConditionalGeneration",),
    model_types=("qwen3_omni_moe",),
    make_tiny="omni_qwen3.tiny:make_tiny",
    description="Qwen3-Omni thinker/talker/code2wav",
)
COSMOS = family("cosmos3", diffusers_classes=("Cosmos3OmniPipeline",), model_types=("cosmos3",))


@pytest.fixture(autouse=True)
def no_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_PLUGINS", raising=False)
    monkeypatch.delenv("OMNI_TRACE_HOOKS", raising=False)


def host_with(*plugins: object, entry_points: list[FakeEntryPoint] | None = None) -> PluginHost:
    return load_plugins(entry_points=entry_points or [], extra_plugins=plugins)


# -- loading -------------------------------------------------------------------------------------

# What `omni plugins` says of the core's own parts (`PluginHost.describe`), whatever else is installed.
BUILTINS_DESCRIPTION = {
    "name": BUILTINS_NAME,
    "version": __version__,
    "hooks": ["register_connectors", "register_placements", "register_quantization_resolvers", "register_stage_runtimes"],
    "registered": {
        "stage kinds": ["ar", "diffusion", "generation"],
        "connectors": ["inproc", "shm"],
        "quantization resolvers": ["fp8", "int8"],
        "placements": ["inline", "process", "ray"],
    },
    "error": None,
}


def test_builtins_always_loaded_first_and_register_core_parts() -> None:
    host = load_plugins(allowlist=[], entry_points=[FakeEntryPoint("omni-qwen3", families_plugin("q", QWEN))])
    assert host.describe()[0] == BUILTINS_DESCRIPTION
    assert host.stage_runtime("ar") == "omni_core.stages.ar:ARStageRuntime"
    assert host.connector("shm") == "omni_core.connectors.shm:SharedMemoryConnector"
    assert host.owner("connector", "inproc") == BUILTINS_NAME
    assert dict(host.families) == {}
    assert host.failures == {}


def test_plugin_that_fails_to_import_is_reported_and_others_load() -> None:
    host = host_with(
        entry_points=[
            FakeEntryPoint("omni-broken", ImportError("No module named 'flash_attn'"), version="0.3"),
            FakeEntryPoint("omni-qwen3", families_plugin("qwen", QWEN), version="2.0"),
        ]
    )
    assert host.failures == {"omni-broken": "ImportError: No module named 'flash_attn'"}
    assert host.family("qwen3-omni") == QWEN
    rows = {row["name"]: row for row in host.describe()}
    assert rows["omni-broken"] == {
        "name": "omni-broken",
        "version": "0.3",
        "hooks": [],
        "registered": {},
        "error": "ImportError: No module named 'flash_attn'",
    }
    assert rows["omni-qwen3"] == {
        "name": "omni-qwen3",
        "version": "2.0",
        "hooks": ["register_pipelines"],
        "registered": {"families": ["qwen3-omni"]},
        "error": None,
    }


def test_plugin_with_misspelled_hook_is_unregistered_and_reported() -> None:
    class Typo:

        @hookimpl
        def register_pipeline(register: Callable[[PipelineFamily], None]) -> None:
            register(family("never"))

    host = host_with(entry_points=[FakeEntryPoint("omni-typo", Typo), FakeEntryPoint("omni-qwen3", families_plugin("q", QWEN))])
    assert "register_pipeline" in host.failures["omni-typo"]
    assert "misspelled" in host.failures["omni-typo"]
    assert host.pm.get_plugin("omni-typo") is None
    assert set(host.families) == {"qwen3-omni"}
    assert {row["name"]: row["hooks"] for row in host.describe()}["omni-typo"] == []


def test_plugin_with_wrong_hook_arguments_is_reported() -> None:
    class BadArgs:

        @hookimpl
        def register_pipelines(register: Any, extra: Any) -> None:
            pass

    host = host_with(entry_points=[FakeEntryPoint("omni-bad", BadArgs), FakeEntryPoint("omni-qwen3", families_plugin("q", QWEN))])
    assert "extra" in host.failures["omni-bad"]
    assert set(host.families) == {"qwen3-omni"}


def test_same_entry_point_twice_loads_once() -> None:
    plugin = families_plugin("q", QWEN)
    host = host_with(entry_points=[FakeEntryPoint("omni-qwen3", plugin), FakeEntryPoint("omni-qwen3", plugin)])
    assert host.failures == {}
    assert [row["name"] for row in host.describe()] == [BUILTINS_NAME, "omni-qwen3"]


# -- allowlist -----------------------------------------------------------------------------------


def two_entry_points() -> list[FakeEntryPoint]:
    return [
        FakeEntryPoint("omni-qwen3", families_plugin("q", QWEN)),
        FakeEntryPoint("omni-cosmos3", families_plugin("c", COSMOS)),
    ]


def test_allowlist_parameter_selects_entry_points_and_keeps_builtins() -> None:
    host = load_plugins(allowlist=["omni-cosmos3"], entry_points=two_entry_points())
    assert set(host.families) == {"cosmos3"}
    assert [row["name"] for row in host.describe()] == [BUILTINS_NAME, "omni-cosmos3"]
    assert "ar" in host.stage_runtimes


def test_allowlist_name_that_matches_nothing_is_reported() -> None:
    host = load_plugins(allowlist=["omni-qwen3", "omni-qwen"], entry_points=two_entry_points())
    assert set(host.families) == {"qwen3-omni"}
    assert "no 'omni' entry point" in host.failures["omni-qwen"]


def test_allowlist_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_PLUGINS", " omni-qwen3 , ")
    assert set(load_plugins(entry_points=two_entry_points()).families) == {"qwen3-omni"}
    monkeypatch.setenv("OMNI_PLUGINS", "")
    host = load_plugins(entry_points=two_entry_points())
    assert set(host.families) == set()
    assert [row["name"] for row in host.describe()] == [BUILTINS_NAME]
    monkeypatch.delenv("OMNI_PLUGINS")
    assert set(load_plugins(entry_points=two_entry_points()).families) == {"qwen3-omni", "cosmos3"}


def test_allowlist_parameter_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_PLUGINS", "omni-qwen3")
    assert set(load_plugins(allowlist=["omni-cosmos3"], entry_points=two_entry_points()).families) == {"cosmos3"}


# -- registries ----------------------------------------------------------------------------------


def test_hook_register_pipelines_duplicate_family_names_both_plugins() -> None:
    other_qwen = family("qwen3-omni", architectures=("Other",))
    host = host_with(
        families_plugin("first", QWEN, COSMOS),
        families_plugin("second", other_qwen),
    )
    assert "qwen3-omni" not in host.families
    assert host.family("cosmos3") == COSMOS  # the rest of the plugin still works
    with pytest.raises(PluginError) as info:
        host.family("qwen3-omni")
    assert "first" in str(info.value) and "second" in str(info.value)
    assert "OMNI_PLUGINS" in str(info.value)
    assert "second" in host.failures["first"] and "first" in host.failures["second"]
    with pytest.raises(PluginError, match="several plugins"):
        host.family_for("Qwen/Qwen3-Omni", {"architectures": ["Qwen3OmniMoeForConditionalGeneration"]})


def test_hook_register_stage_runtimes_registers_and_rejects_duplicates() -> None:
    class Runtimes:

        @hookimpl
        def register_stage_runtimes(register: Callable[[str, str], None]) -> None:
            register("world", "omni_extra.world:WorldStageRuntime")
            register("ar", "omni_extra.ar:OtherAR")

    host = host_with(Runtimes)
    assert host.stage_runtime("world") == "omni_extra.world:WorldStageRuntime"
    assert host.owner("stage runtime", "world") == "Runtimes"
    assert "ar" not in host.stage_runtimes
    with pytest.raises(PluginError, match="omni-core, Runtimes"):
        host.stage_runtime("ar")


def test_hook_register_connectors_duplicate_of_builtin_names_both() -> None:
    class Connectors:

        @hookimpl
        def register_connectors(register: Callable[[str, str], None]) -> None:
            register("mooncake", "omni_mooncake.connector:MooncakeConnector")
            register("shm", "omni_mooncake.connector:NotShm")

    host = host_with(Connectors)
    assert host.connector("mooncake") == "omni_mooncake.connector:MooncakeConnector"
    assert host.connector("inproc") == "omni_core.connectors.inproc:InProcessConnector"
    with pytest.raises(PluginError) as info:
        host.connector("shm")
    assert "omni-core" in str(info.value) and "Connectors" in str(info.value)
    assert "'shm'" in host.failures["Connectors"]


def test_hook_register_placements_adds_to_the_builtin_ones() -> None:
    class Slurm:

        @hookimpl
        def register_placements(register: Callable[[str, str], None]) -> None:
            register("slurm", "omni_slurm:SlurmReplica")
            register("process", "elsewhere:Process")

    host = host_with(Slurm)
    assert host.placements["slurm"] == "omni_slurm:SlurmReplica"
    assert host.placements["inline"] == "omni_core.runtime.replica:InlineReplica"
    assert host.placements["ray"] == "omni_core.runtime.ray_placement:RayReplica"
    assert host.owner("placement", "slurm") == "Slurm"
    assert "'process'" in host.failures["Slurm"]  # a built-in name: a conflict naming both


def test_hook_register_quantization_resolvers() -> None:
    class Quant:

        @hookimpl
        def register_quantization_resolvers(register: Callable[[str, str], None]) -> None:
            register("awq", "omni_quant:resolve_awq")

    host = host_with(Quant)
    assert host.quantization_resolver("awq") == "omni_quant:resolve_awq"
    assert host.quantization_resolver("fp8") == "omni_core.quantization:resolve_fp8"
    with pytest.raises(UnknownNameError) as info:
        host.quantization_resolver("int4")
    assert "awq, fp8, int8" in str(info.value)


def test_hook_register_routes_collects_lazy_references() -> None:
    class Routes:

        @hookimpl
        def register_routes(register: Callable[[str], None]) -> None:
            register("omni_qwen3.routes:VoicesController")
            register("omni_qwen3.routes:VoicesController")
            register("omni_qwen3.routes:health_detail")

    host = host_with(Routes)
    assert host.routes == ("omni_qwen3.routes:VoicesController", "omni_qwen3.routes:health_detail")


def test_failing_registration_hook_is_attributed_and_discarded_atomically() -> None:
    class HalfBroken:

        @hookimpl
        def register_pipelines(register: Callable[[PipelineFamily], None]) -> None:
            register(family("partial"))
            raise RuntimeError("boom")

        @hookimpl
        def register_connectors(register: Callable[[str, str], None]) -> None:
            register("fast", "omni_half:FastConnector")

    host = host_with(HalfBroken, families_plugin("good", QWEN))
    assert host.failures == {"HalfBroken": "register_pipelines failed: RuntimeError: boom"}
    assert set(host.families) == {"qwen3-omni"}
    assert host.connector("fast") == "omni_half:FastConnector"


@pytest.mark.parametrize(
    ("register_args", "expected"),
    [
        (("bad", object), "lazy 'module:attr' string"),
        (("bad", "no_colon_here"), "expected 'module:attr'"),
        (("", "a:b"), "non-empty string"),
    ],
)
def test_invalid_registration_is_a_plugin_failure(register_args: tuple[Any, Any], expected: str) -> None:
    class Bad:

        @hookimpl
        def register_connectors(register: Callable[[str, str], None]) -> None:
            register(*register_args)

    host = host_with(Bad)
    assert expected in host.failures["Bad"]
    assert set(host.connectors) == {"inproc", "shm"}


def test_register_pipelines_rejects_non_family() -> None:
    class NotAFamily:

        @hookimpl
        def register_pipelines(register: Callable[[Any], None]) -> None:
            register({"name": "x"})

    assert "expects a PipelineFamily" in host_with(NotAFamily).failures["NotAFamily"]


def test_registries_are_read_only() -> None:
    host = host_with(families_plugin("q", QWEN))
    with pytest.raises(TypeError):
        host.families["new"] = COSMOS  # type: ignore[index]
    with pytest.raises(TypeError):
        host.connectors["new"] = "a:b"  # type: ignore[index]


def test_unknown_names_list_what_is_installed() -> None:
    host = host_with(families_plugin("q", QWEN))
    with pytest.raises(UnknownNameError, match=r"unknown stage runtime 'world'; installed: ar, diffusion, generation"):
        host.stage_runtime("world")
    with pytest.raises(UnknownNameError, match="qwen3-omni.*omni pipelines"):
        host.family("cosmos3")


# -- choosing a family ---------------------------------------------------------------------------


def test_family_for_by_architectures_model_type_and_diffusers_class() -> None:
    host = host_with(families_plugin("q", QWEN), families_plugin("c", COSMOS))
    assert host.family_for("a", {"architectures": ["Foo", "Qwen3OmniMoeForConditionalGeneration"]}) == QWEN
    assert host.family_for("b", {"model_type": "qwen3_omni_moe"}) == QWEN
    assert host.family_for("c", {"_class_name": "Cosmos3OmniPipeline", "_diffusers_version": "0.42.1"}) == COSMOS


def test_family_for_prefers_architectures_over_model_type() -> None:
    by_type = family("by-type", model_types=("shared_type",))
    by_arch = family("by-arch", architectures=("SpecialArch",))
    host = host_with(families_plugin("t", by_type), families_plugin("a", by_arch))
    assert host.family_for("m", {"architectures": ["SpecialArch"], "model_type": "shared_type"}) == by_arch
    assert host.family_for("m", {"architectures": ["Unknown"], "model_type": "shared_type"}) == by_type


def test_family_for_ambiguous_match_names_both() -> None:
    twin = family("qwen3-omni-fork", architectures=("Qwen3OmniMoeForConditionalGeneration",))
    host = host_with(families_plugin("q", QWEN), families_plugin("fork", twin))
    with pytest.raises(PluginError) as info:
        host.family_for("m", {"architectures": ["Qwen3OmniMoeForConditionalGeneration"]})
    assert "qwen3-omni (plugin q)" in str(info.value) and "qwen3-omni-fork (plugin fork)" in str(info.value)


def test_hook_resolve_pipeline_overrides_default_matching() -> None:
    calls: list[tuple[str, dict]] = []

    def answer(model_ref: str, hf_config: dict) -> str | None:
        calls.append((model_ref, hf_config))
        return "cosmos3" if hf_config.get("variant") == "cosmos-in-qwen-clothing" else None

    host = host_with(families_plugin("q", QWEN), families_plugin("c", COSMOS), resolver_plugin("r", answer))
    config = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "variant": "cosmos-in-qwen-clothing"}
    assert host.family_for("org/odd", config) == COSMOS
    assert calls == [("org/odd", config)]
    # None lets the default matching decide.
    assert host.family_for("org/qwen", {"architectures": ["Qwen3OmniMoeForConditionalGeneration"]}) == QWEN


def test_resolve_pipeline_first_result_follows_pluggy_order() -> None:
    plugins = [families_plugin("q", QWEN), families_plugin("c", COSMOS)]
    early = resolver_plugin("early", lambda ref, cfg: "qwen3-omni")
    late = resolver_plugin("late", lambda ref, cfg: "cosmos3")
    # pluggy calls the most recently registered implementation first...
    assert host_with(*plugins, early, late).family_for("m", {}) == COSMOS
    # ...unless an implementation asks to go first.
    early_first = resolver_plugin("early", lambda ref, cfg: "qwen3-omni", tryfirst=True)
    assert host_with(*plugins, early_first, late).family_for("m", {}) == QWEN


def test_resolve_pipeline_to_unregistered_family_is_an_error() -> None:
    host = host_with(families_plugin("q", QWEN), resolver_plugin("liar", lambda ref, cfg: "ghost"))
    with pytest.raises(PluginError, match=r"plugin 'liar' resolved 'm' to family 'ghost'.*qwen3-omni"):
        host.family_for("m", {})


def test_resolve_pipeline_that_raises_does_not_hide_others() -> None:
    def crash(ref: str, cfg: dict) -> str | None:
        raise KeyError("foo_key")

    host = host_with(families_plugin("q", QWEN), resolver_plugin("crashy", crash))
    assert host.family_for("m", {"model_type": "qwen3_omni_moe"}) == QWEN


def test_unknown_model_error_names_architecture_families_and_fix() -> None:
    host = host_with(families_plugin("q", QWEN), families_plugin("c", COSMOS))
    with pytest.raises(UnknownModelError) as info:
        host.family_for("org/hunyuan", {"architectures": ["HunyuanImage3ForCausalMM"], "model_type": "hunyuan_image_3"})
    message = str(info.value)
    assert "'org/hunyuan'" in message
    assert "HunyuanImage3ForCausalMM" in message and "hunyuan_image_3" in message
    assert "qwen3-omni (architectures Qwen3OmniMoeForConditionalGeneration; model types qwen3_omni_moe)" in message
    assert "cosmos3 (model types cosmos3; diffusers Cosmos3OmniPipeline)" in message
    assert "pip install omni-<family>" in message
    assert "omni pipelines" in message
    assert "failed to load" not in message


def test_unknown_model_error_mentions_failed_plugins() -> None:
    host = host_with(entry_points=[FakeEntryPoint("omni-hunyuan", ImportError("cannot import name 'X'"))])
    with pytest.raises(UnknownModelError) as info:
        host.family_for("org/hunyuan", {"architectures": ["HunyuanImage3ForCausalMM"]})
    message = str(info.value)
    assert "Installed families: none" in message
    assert "omni-hunyuan: ImportError: cannot import name 'X'" in message
    assert "might be the one" in message


# -- reporting, commands, tracing ----------------------------------------------------------------


def test_describe_lists_every_plugin_in_load_order() -> None:
    class Everything:

        @hookimpl
        def register_routes(register: Callable[[str], None]) -> None:
            register("pkg.routes:r")

        @hookimpl
        def register_connectors(register: Callable[[str, str], None]) -> None:
            register("x", "pkg:X")

    host = host_with(
        Everything,
        entry_points=[FakeEntryPoint("omni-qwen3", families_plugin("q", QWEN), version=None)],
    )
    assert host.describe() == [
        BUILTINS_DESCRIPTION,
        {
            "name": "omni-qwen3",
            "version": None,
            "hooks": ["register_pipelines"],
            "registered": {"families": ["qwen3-omni"]},
            "error": None,
        },
        {
            "name": "Everything",
            "version": None,
            "hooks": ["register_connectors", "register_routes"],
            "registered": {"connectors": ["x"], "routes": ["pkg.routes:r"]},
            "error": None,
        },
    ]


def test_describe_lists_every_name_a_plugin_registered() -> None:
    class Everything:

        @hookimpl
        def register_pipelines(register: Callable[[PipelineFamily], None]) -> None:
            register(COSMOS)
            register(QWEN)

        @hookimpl
        def register_stage_runtimes(register: Callable[[str, str], None]) -> None:
            register("world", "omni_everything.world:WorldStageRuntime")

        @hookimpl
        def register_connectors(register: Callable[[str, str], None]) -> None:
            register("rdma", "omni_everything.rdma:RdmaConnector")
            register("shm", "omni_everything.shm:OtherShm")  # a conflict: listed, and an error

        @hookimpl
        def register_quantization_resolvers(register: Callable[[str, str], None]) -> None:
            register("awq", "omni_everything.quant:resolve_awq")

        @hookimpl
        def register_routes(register: Callable[[str], None]) -> None:
            register("omni_everything.routes:health")

        @hookimpl
        def register_commands(cli: click.Group) -> None:
            @cli.command()
            def world() -> None:
                """Simulate a world."""

    class HalfBroken:

        @hookimpl
        def register_connectors(register: Callable[[str, str], None]) -> None:
            register("lost", "omni_half:LostConnector")
            raise RuntimeError("boom")

        @hookimpl
        def register_commands(cli: click.Group) -> None:
            raise RuntimeError("no commands either")

    host = host_with(Everything, HalfBroken)
    rows = {row["name"]: row for row in host.describe()}
    assert rows["Everything"]["registered"] == {
        "families": ["cosmos3", "qwen3-omni"],
        "stage kinds": ["world"],
        "connectors": ["rdma", "shm"],
        "quantization resolvers": ["awq"],
        "routes": ["omni_everything.routes:health"],
        "commands": ["world"],
    }
    assert "'shm'" in rows["Everything"]["error"]
    assert rows[BUILTINS_NAME]["registered"]["connectors"] == ["inproc", "shm"]
    # A hook that raised registered nothing, and a failing register_commands lists no commands.
    assert rows["HalfBroken"]["registered"] == {}
    assert "boom" in rows["HalfBroken"]["error"]


@pytest.mark.parametrize("hook_name", sorted(_NAMED_REGISTRIES))
def test_every_named_registry_is_filled_and_reported(hook_name: str) -> None:
    registry = _NAMED_REGISTRIES[hook_name]

    def register_one(register: Callable[[str, str], None]) -> None:
        register("throwaway", "omni_throwaway.mod:Thing")

    # A plugin whose one hook is `hook_name`: a new registry needs no new test.
    host = host_with(type("Plugin", (), {hook_name: hookimpl(register_one)}))
    assert host.registry(registry.kind)["throwaway"] == "omni_throwaway.mod:Thing"
    assert host.owner(registry.kind, "throwaway") == "Plugin"
    assert host.registered_by("Plugin") == {registry.heading: ["throwaway"]}


def test_registry_by_kind_and_unknown_kind() -> None:
    host = host_with(families_plugin("q", QWEN))
    assert host.registry("family") is host.families
    assert host.registry("connector") is host.connectors
    assert host.registry("placement") is host.placements
    with pytest.raises(UnknownNameError, match="unknown registry 'edge'; registries: family, stage runtime"):
        host.registry("edge")


def test_hook_register_commands_isolates_broken_plugins() -> None:
    class Adds:

        @hookimpl
        def register_commands(cli: click.Group) -> None:
            @cli.command()
            def hello() -> None:
                """Say hello."""

    class Breaks:

        @hookimpl
        def register_commands(cli: click.Group) -> None:
            raise ValueError("bad command")

    host = host_with(Adds, Breaks)
    group = click.Group("omni")
    assert host.register_commands(group) == {"Breaks": "ValueError: bad command"}
    assert list(group.commands) == ["hello"]


def test_trace_hooks_env_prints_hook_calls(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OMNI_TRACE_HOOKS", "1")
    host = host_with(families_plugin("q", QWEN))
    host.family_for("m", {"model_type": "qwen3_omni_moe"})
    err = capsys.readouterr().err
    assert "register_pipelines" in err and "register_connectors" in err
    monkeypatch.setenv("OMNI_TRACE_HOOKS", "0")
    host_with(families_plugin("q", QWEN))
    assert capsys.readouterr().err == ""


def test_default_plugins_is_loaded_once() -> None:
    host = default_plugins()
    assert default_plugins() is host
    assert host.describe()[0]["name"] == BUILTINS_NAME


# -- meta-tests (every hook documented and tested) ----------------------------------------------


HOOK_NAMES = sorted(
    name for name, obj in vars(hookspecs).items() if inspect.isfunction(obj) and hasattr(obj, "omni_spec")
)


def test_hookspecs_found() -> None:
    assert "register_pipelines" in HOOK_NAMES and "resolve_pipeline" in HOOK_NAMES


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hook_has_a_docstring(hook_name: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, hook_name)) or ""
    assert len(doc) > 20, f"hookspec {hook_name} needs a docstring"
    if getattr(hookspecs, hook_name).omni_spec.get("firstresult"):
        assert "first non-None" in doc, f"firstresult hook {hook_name} must say it stops at the first result"


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hook_has_a_test(hook_name: str) -> None:
    tests = [name for name in globals() if name.startswith(f"test_hook_{hook_name}")]
    assert tests, f"add a test named test_hook_{hook_name}_... that calls the hook"


class PickyReplica(InlineReplica):
    """A plugin placement that refuses a stage's deploy (as ``ray`` does without Ray installed)."""

    placement = "picky"

    @classmethod
    def stage_options(cls, deploy: Any) -> dict[str, Any]:
        raise ConfigError("needs a queue name", key="queue")


def test_a_placement_refusing_a_stage_names_the_stage_key(model_dir: Path) -> None:
    class Picky:

        @hookimpl
        def register_placements(register: Callable[[str, str], None]) -> None:
            register("picky", f"{__name__}:PickyReplica")

    with pytest.raises(ConfigError) as info:
        resolve(str(model_dir), overrides=["vocoder.placement=picky"], plugins=load_plugins(extra_plugins=[Picky]))
    assert info.value.key == "stages.vocoder.queue" and str(info.value) == "stages.vocoder.queue: needs a queue name"
