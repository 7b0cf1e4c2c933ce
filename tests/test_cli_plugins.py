"""The ``omni`` CLI skeleton: ``plugins``, ``pipelines``, plugin commands and error handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

import omni_cli
import omni_core
from omni_cli.main import cli
from omni_core import hookimpl
from omni_core.errors import UnknownModelError
from omni_core.families import PipelineFamily
from omni_core.plugins import PluginHost, load_plugins
from omni_core.testing.live_server import launch_env

QWEN = PipelineFamily(
    name="qwen3-omni",
    pipeline="omni_qwen3.pipeline:build",
    architectures=("Qwen3OmniMoeForConditionalGeneration",),
    model_types=("qwen3_omni_moe",),
    make_tiny="omni_qwen3.tiny:make_tiny",
    description="Qwen3-Omni: text and speech out",
)
COSMOS = PipelineFamily(
    name="cosmos3",
    pipeline="omni_cosmos3.pipeline:build",
    diffusers_classes=("Cosmos3OmniPipeline",),
    description="Cosmos3 world model",
)


class Families:
    @hookimpl
    def register_pipelines(register: Any) -> None:
        register(QWEN)
        register(COSMOS)


class Commands:
    @hookimpl
    def register_commands(cli: click.Group) -> None:
        @cli.command()
        @click.argument("who")
        def greet(who: str) -> None:
            """Greet someone (added by a plugin)."""
            click.echo(f"hello {who}")

        @cli.command()
        def explode() -> None:
            """Fail the way a command fails on an unknown model."""
            raise UnknownModelError("no family serves 'x'.\nInstall omni-x")

        @cli.command()
        def crash() -> None:
            """Fail with a bug (not an OmniError)."""
            raise RuntimeError("a bug")

        @cli.command(name="plugins")
        def shadow() -> None:
            """Must not replace the built-in command."""
            click.echo("shadowed")


class BrokenCommands:
    @hookimpl
    def register_commands(cli: click.Group) -> None:
        raise ValueError("cannot build command")


class FakeEntryPoint:
    name = "omni-broken"
    dist = None

    def load(self) -> Any:
        raise ImportError("No module named 'missing_dep'")


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> PluginHost:
    monkeypatch.delenv("OMNI_PLUGINS", raising=False)
    monkeypatch.delenv("OMNI_DEBUG", raising=False)
    return load_plugins(entry_points=[FakeEntryPoint()], extra_plugins=[Families, Commands, BrokenCommands])


def invoke(host: PluginHost, *args: str) -> Any:
    return CliRunner().invoke(cli, list(args), obj=host)


def test_plugins_prints_describe_as_json(host: PluginHost) -> None:
    result = invoke(host, "plugins")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert rows == host.describe()
    assert [row["name"] for row in rows] == ["omni-core", "omni-broken", "Families", "Commands", "BrokenCommands"]
    assert rows[1]["error"] == "ImportError: No module named 'missing_dep'"


def test_plugins_lists_the_names_each_plugin_registered(host: PluginHost) -> None:
    rows = {row["name"]: row for row in json.loads(invoke(host, "plugins").stdout)}
    assert rows["omni-core"]["registered"] == {
        "stage kinds": ["ar", "diffusion", "generation"],
        "connectors": ["inproc", "shm"],
        "quantization resolvers": ["fp8", "int8"],
        "placements": ["inline", "process", "ray"],
    }
    assert rows["Families"]["registered"] == {"families": ["cosmos3", "qwen3-omni"]}
    # `plugins` is what the plugin registered, though the CLI ignores it (with a warning).
    assert rows["Commands"]["registered"] == {"commands": ["crash", "explode", "greet", "plugins"]}
    assert rows["BrokenCommands"]["registered"] == {}
    assert rows["omni-broken"]["registered"] == {}


def test_pipelines_table(host: PluginHost) -> None:
    result = invoke(host, "pipelines")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "MATCHES", "TINY", "PLUGIN", "DESCRIPTION"]
    cosmos, qwen = lines[1], lines[2]
    assert cosmos.startswith("cosmos3") and "diffusers:Cosmos3OmniPipeline" in cosmos and "Cosmos3 world model" in cosmos
    for text in ("arch:Qwen3OmniMoeForConditionalGeneration", "model_type:qwen3_omni_moe", "omni-tiny/qwen3-omni"):
        assert text in qwen
    assert qwen.endswith("Qwen3-Omni: text and speech out")
    assert "omni-tiny/cosmos3" not in result.stdout


def test_pipelines_json(host: PluginHost) -> None:
    result = invoke(host, "pipelines", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [
        {
            "name": "cosmos3",
            "architectures": [],
            "model_types": [],
            "diffusers_classes": ["Cosmos3OmniPipeline"],
            "tiny": None,
            "plugin": "Families",
            "description": "Cosmos3 world model",
        },
        {
            "name": "qwen3-omni",
            "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
            "model_types": ["qwen3_omni_moe"],
            "diffusers_classes": [],
            "tiny": "omni-tiny/qwen3-omni",
            "plugin": "Families",
            "description": "Qwen3-Omni: text and speech out",
        },
    ]


def test_pipelines_with_no_families_says_how_to_add_one() -> None:
    result = CliRunner().invoke(cli, ["pipelines"], obj=load_plugins(allowlist=[], entry_points=[]))
    assert result.exit_code == 0
    assert "No pipeline families installed" in result.stdout and "pip install omni-" in result.stdout


def test_plugin_commands_are_listed_and_run(host: PluginHost) -> None:
    help_result = invoke(host, "--help")
    assert help_result.exit_code == 0
    assert "greet" in help_result.stdout and "Greet someone" in help_result.stdout
    result = invoke(host, "greet", "world")
    assert result.exit_code == 0
    assert result.stdout == "hello world\n"
    assert "plugin 'BrokenCommands' failed to add commands: ValueError: cannot build command" in result.stderr


def test_plugin_cannot_shadow_builtin_command(host: PluginHost) -> None:
    result = invoke(host, "--help")
    assert "plugin command 'plugins' ignored" in result.stderr
    assert "Must not replace" not in result.stdout
    assert json.loads(invoke(host, "plugins").stdout) == host.describe()


def test_plugin_commands_do_not_leak_between_hosts(host: PluginHost) -> None:
    assert invoke(host, "greet", "a").exit_code == 0
    bare = load_plugins(allowlist=[], entry_points=[])
    result = CliRunner().invoke(cli, ["greet", "a"], obj=bare)
    assert result.exit_code == 2
    assert "No such command 'greet'" in result.stderr


def test_omni_error_is_one_line_on_stderr_and_exit_1(host: PluginHost) -> None:
    result = invoke(host, "explode")
    assert result.exit_code == 1
    assert result.stdout == ""
    # The other stderr line is the warning about BrokenCommands.
    assert result.stderr.splitlines()[-1] == "Error: no family serves 'x'. Install omni-x"
    assert [line for line in result.stderr.splitlines() if "omni-x" in line] == [result.stderr.splitlines()[-1]]


def test_omni_debug_keeps_the_traceback(host: PluginHost, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_DEBUG", "1")
    result = invoke(host, "explode")
    assert isinstance(result.exception, UnknownModelError)


def test_other_exceptions_are_not_disguised(host: PluginHost) -> None:
    result = invoke(host, "crash")
    assert isinstance(result.exception, RuntimeError)
    assert "Error: a bug" not in result.stderr


# -- omni stages ---------------------------------------------------------------------------------


class StageKinds:
    @hookimpl
    def register_stage_runtimes(register: Any) -> None:
        register("vocoder", "omni_core.stages.generation:GenerationStageRuntime")
        register("world", "omni_missing_world.runtime:WorldStageRuntime")


@pytest.fixture
def kinds_host(monkeypatch: pytest.MonkeyPatch) -> PluginHost:
    monkeypatch.delenv("OMNI_DEBUG", raising=False)
    return load_plugins(allowlist=[], entry_points=[], extra_plugins=[StageKinds])


def headings(text: str) -> list[str]:
    return [line.split("  (")[0] for line in text.splitlines() if line and not line.startswith(" ")]


def test_stages_lists_every_kind_then_every_stage(host: PluginHost) -> None:
    result = invoke(host, "stages")
    assert result.exit_code == 0, result.output
    assert headings(result.stdout) == ["ar", "diffusion", "generation", "every stage"]
    assert "ar  (omni_core.stages.ar:ARStageRuntime, plugin omni-core)" in result.stdout
    assert "\n  max_num_seqs: int = 32\n      Most requests in one engine step" in result.stdout
    assert "\n  placement: str = 'process'\n" in result.stdout
    assert "(undocumented)" not in result.stdout


def test_stages_of_one_kind(host: PluginHost) -> None:
    result = invoke(host, "stages", "diffusion")
    assert result.exit_code == 0, result.output
    assert headings(result.stdout) == ["diffusion", "every stage"]
    for line in (
        "  dtype: 'float32' | 'bfloat16' | 'float16' | 'checkpoint' = 'float32'",
        "  vae_tile: int | None = None",
        "  cache_threshold: float = 0.1",
        "  devices: tuple[str, ...] = ()",
        "  cpu_threads: int | None = None",
    ):
        assert line in result.stdout.splitlines()


def test_stages_json(host: PluginHost) -> None:
    result = invoke(host, "stages", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert list(document["kinds"]) == ["ar", "diffusion", "generation"]
    diffusion = document["kinds"]["diffusion"]
    assert diffusion["source"] == "omni_core.stages.diffusion:DiffusionStageRuntime"
    assert diffusion["plugin"] == "omni-core" and diffusion["error"] is None
    vae_tile = next(option for option in diffusion["options"] if option["name"] == "vae_tile")
    assert vae_tile == {
        "name": "vae_tile",
        "type": "int | None",
        "required": False,
        "default": None,
        "doc": "The tile size in pixels with `vae_tiling` (``None``: the VAE's default).",
    }
    every_stage = document["every stage"]["options"]
    assert [option["name"] for option in every_stage][:3] == ["placement", "replicas", "devices"]
    assert {"name": "devices", "type": "tuple[str, ...]", "required": False, "default": []}.items() <= every_stage[2].items()
    assert all(option["doc"] for kind in document["kinds"].values() for option in kind["options"])


def test_stages_markdown_is_the_docs_generator(host: PluginHost) -> None:
    result = invoke(host, "stages", "--markdown")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("# Stage options\n")
    assert "| `max_num_seqs` | `int` | `32` | Most requests in one engine step" in result.stdout
    assert "| `placement` | `str` | `'process'` |" in result.stdout


def test_stages_json_and_markdown_exclude_each_other(host: PluginHost) -> None:
    result = invoke(host, "stages", "--json", "--markdown")
    assert result.exit_code == 2
    assert "choose one of --json and --markdown" in result.stderr


def test_stages_unknown_kind_lists_the_installed_ones(host: PluginHost) -> None:
    result = invoke(host, "stages", "world")
    assert result.exit_code == 1
    assert "Error: unknown stage runtime 'world'; installed: ar, diffusion, generation (see `omni stages`)" in result.stderr


def test_stages_lists_a_plugins_kinds_and_reports_one_that_cannot_import(kinds_host: PluginHost) -> None:
    result = CliRunner().invoke(cli, ["stages"], obj=kinds_host)
    assert result.exit_code == 0, result.output
    assert headings(result.stdout) == ["ar", "diffusion", "generation", "vocoder", "world", "every stage"]
    assert "vocoder  (omni_core.stages.generation:GenerationStageRuntime, plugin StageKinds)" in result.stdout
    world = result.stdout.split("\nworld  (")[1].split("\n\n")[0]
    assert world.startswith("omni_missing_world.runtime:WorldStageRuntime, plugin StageKinds)")
    assert "cannot list its options: cannot import omni_missing_world.runtime:WorldStageRuntime:" in world
    assert "ModuleNotFoundError" in world
    single = CliRunner().invoke(cli, ["stages", "vocoder"], obj=kinds_host)
    assert headings(single.stdout) == ["vocoder", "every stage"]
    assert "  max_batch_size: int = 16" in single.stdout.splitlines()


def refuse_bench(directory: Path, size: str) -> None:
    """A family's make_tiny that has only the tiny size (the documented ValueError)."""
    (directory / "config.json").write_text("{}")
    if size != "tiny":
        raise ValueError(f"only size 'tiny', not {size!r}")


def test_make_tiny_refusing_a_size_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    class OneSize:
        @hookimpl
        def register_pipelines(register: Any) -> None:
            register(PipelineFamily(name="one-size", pipeline="x:y", architectures=("X",), make_tiny=f"{__name__}:refuse_bench"))

    host = load_plugins(allowlist=[], entry_points=[], extra_plugins=[OneSize])
    result = invoke(host, "make-tiny", "one-size", str(tmp_path / "ckpt"), "--size", "bench")
    assert result.exit_code == 1
    assert "Error: --size: family 'one-size' cannot write a 'bench' checkpoint: only size 'tiny'" in result.stderr
    assert not (tmp_path / "ckpt").exists()
    assert invoke(host, "make-tiny", "one-size", str(tmp_path / "ckpt")).exit_code == 0


def test_version(host: PluginHost) -> None:
    result = invoke(host, "--version")
    assert result.stdout.strip() == f"omni, version {omni_core.__version__}"


# -- in a fresh interpreter ----------------------------------------------------------------------


def _env() -> dict[str, str]:
    # omni-core may not be installed in the test environment: point a child at the same sources.
    roots = [str(Path(omni_core.__file__).parents[1]), str(Path(omni_cli.__file__).parents[1])]
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join([*roots, env.get("PYTHONPATH", "")])
    return env


def test_omni_help_runs_as_a_program() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omni_cli.main", "--help"], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "plugins" in result.stdout and "pipelines" in result.stdout


HEAVY = ("torch", "vllm", "transformers", "diffusers")


def test_importing_the_cli_imports_nothing_heavy() -> None:
    code = (
        "import sys, omni_cli.main\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_listing_stage_options_imports_nothing_heavy() -> None:
    # `omni stages` imports every registered runtime class: their modules must import torch lazily.
    code = (
        "import sys\n"
        "from omni_cli.main import cli\n"
        "cli.main(['stages', '--json'], standalone_mode=False)\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert '"omni_core.stages.ar:ARStageRuntime"' in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_listing_installed_plugins_imports_nothing_heavy() -> None:
    # Installed plugins' `plugin` modules must stay light too (design rule): `omni --help` loads them.
    code = (
        "import sys\n"
        "from omni_cli.main import cli\n"
        "cli.main(['plugins'], standalone_mode=False)\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
