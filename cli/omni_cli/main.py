"""The ``omni`` command: a click group whose commands each live in one function.

Plugins add commands through the ``register_commands`` hook. They are loaded only when click needs
the command list (``omni --help``) or a name that is not built in, so built-in commands never pay
for plugin discovery, and this module imports no torch or vLLM.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from omni_core import __version__
from omni_core.errors import OmniError
from omni_core.families import PipelineFamily
from omni_core.plugins import PluginHost, default_plugins
from omni_cli import commands

DEBUG_ENV = "OMNI_DEBUG"
_PLUGIN_COMMANDS_KEY = "omni.plugin_commands"


def plugin_host(ctx: click.Context) -> PluginHost:
    """The plugins a command works with: a `PluginHost` passed as ``obj`` (tests), else the defaults."""
    host = ctx.find_object(PluginHost)
    return host if host is not None else default_plugins()


class OmniGroup(click.Group):
    """The ``omni`` group: turns `OmniError` into one line on stderr and adds plugins' commands."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OmniError as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            # One line: multi-line messages would be hard to read among other tools' output.
            raise click.ClickException(" ".join(str(exc).split())) from exc

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugin_commands(ctx).commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        return self._plugin_commands(ctx).get_command(ctx, cmd_name)

    def _plugin_commands(self, ctx: click.Context) -> click.Group:
        # Plugins add to a scratch group per invocation rather than to this module-level group,
        # so that running `omni` twice in one process (tests) never accumulates commands.
        root = ctx.find_root()
        group = root.meta.get(_PLUGIN_COMMANDS_KEY)
        if group is None:
            group = click.Group(self.name)
            for plugin, error in plugin_host(ctx).register_commands(group).items():
                click.echo(f"Warning: plugin {plugin!r} failed to add commands: {error}", err=True)
            for name in list(group.commands):
                if name in self.commands:
                    click.echo(
                        f"Warning: plugin command {name!r} ignored: a built-in command has this name",
                        err=True,
                    )
                    del group.commands[name]
            root.meta[_PLUGIN_COMMANDS_KEY] = group
        return group


@click.group(cls=OmniGroup)
@click.version_option(version=__version__, prog_name="omni")
def cli() -> None:
    """Omni: serve omni-modality models by chaining AR, generation and diffusion stages."""


@cli.command(name="plugins")
@click.pass_context
def plugins_command(ctx: click.Context) -> None:
    """List installed plugins, their hooks, the names they registered and load errors (JSON)."""
    click.echo(json.dumps(plugin_host(ctx).describe(), indent=2))


@cli.command(name="stages")
@click.argument("kind", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option("--markdown", is_flag=True, help="Print Markdown (docs/stage-options.md is the built-ins' output).")
@click.pass_context
def stages_command(ctx: click.Context, kind: str | None, as_json: bool, markdown: bool) -> None:
    """List the options of each stage kind (or of KIND): type, default and what each does.

    The settings every stage has (placement, replicas, ...) follow the kinds. The built-ins'
    Markdown is docs/stage-options.md; regenerate it with:

    \b
      OMNI_PLUGINS= omni stages --markdown > docs/stage-options.md
    """
    if as_json and markdown:
        raise click.UsageError("choose one of --json and --markdown")
    # Imported here: only this command imports the runtime classes (the stage_options helpers do).
    from omni_core import stage_options

    host = plugin_host(ctx)
    kinds = stage_options.kind_sections(host, None if kind is None else [kind])
    every_stage = stage_options.every_stage_section()
    if as_json:
        click.echo(stage_options.render_json(kinds, every_stage))
    elif markdown:
        click.echo(stage_options.render_markdown(kinds, every_stage), nl=False)
    else:
        click.echo(stage_options.render_text(kinds, every_stage), nl=False)


@cli.command(name="pipelines")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def pipelines_command(ctx: click.Context, as_json: bool) -> None:
    """List the registered pipeline families and the checkpoints each one serves."""
    host = plugin_host(ctx)
    rows = [_family_row(host, family) for family in sorted(host.families.values(), key=lambda f: f.name)]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("No pipeline families installed. Install a model plugin, e.g. `pip install omni-<family>`.")
        return
    table = [
        (row["name"], _matches_text(row), row["tiny"] or "-", row["plugin"] or "-", row["description"])
        for row in rows
    ]
    click.echo(_format_table(("NAME", "MATCHES", "TINY", "PLUGIN", "DESCRIPTION"), table))


def _family_row(host: PluginHost, family: PipelineFamily) -> dict[str, Any]:
    return {
        "name": family.name,
        "architectures": list(family.architectures),
        "model_types": list(family.model_types),
        "diffusers_classes": list(family.diffusers_classes),
        "tiny": f"omni-tiny/{family.name}" if family.make_tiny else None,
        "plugin": host.owner("family", family.name),
        "description": family.description,
    }


def _matches_text(row: dict[str, Any]) -> str:
    parts = [
        *(f"arch:{name}" for name in row["architectures"]),
        *(f"model_type:{name}" for name in row["model_types"]),
        *(f"diffusers:{name}" for name in row["diffusers_classes"]),
    ]
    return ", ".join(parts) or "(resolve_pipeline hook)"


def _format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = []
    for cells in (header, *rows):
        # The last column (free text) is not padded, so lines carry no trailing spaces.
        padded = [str(cell).ljust(width) for cell, width in zip(cells[:-1], widths)]
        lines.append("  ".join([*padded, str(cells[-1])]).rstrip())
    return "\n".join(lines)


cli.add_command(commands.generate)
cli.add_command(commands.serve)
cli.add_command(commands.make_tiny)
cli.add_command(commands.convert_stage_config)


def main() -> None:
    """Run the ``omni`` command (``python -m omni_cli.main``)."""
    cli()


if __name__ == "__main__":
    main()
