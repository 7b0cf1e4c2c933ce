"""The ``omni generate``, ``omni serve`` and ``omni make-tiny`` commands.

Heavy modules (torch, vLLM) load only inside the commands, after argument parsing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import click

from omni_core.errors import ConfigError, InvalidRequestError

deploy_option = click.option("--deploy", type=click.Path(dir_okay=False, path_type=Path), help="A deploy YAML file (over the family's default), or one a plugin ships: PACKAGE:PATH.yaml (omni_qwen3:deploy/two-nodes.yaml).")
set_option = click.option("--set", "overrides", multiple=True, metavar="STAGE.OPTION=VALUE", help="Override a deploy setting; repeatable, later wins.")


def _setup_logging(verbose: bool) -> None:
    # stdout carries results (--json); libraries' logs go to stderr, also in stage processes.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not verbose:
        # vLLM logs its configuration and CPU-build advice in every stage process; -v shows it.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # The engine's own progress (stage ready, pipeline ready) is worth seeing by default.
    logging.getLogger("omni_core").setLevel(logging.INFO)


@click.command()
@click.argument("model")
@click.option("--prompt", required=True, help="The text prompt.")
@click.option("--modalities", default=None, help="Comma-separated outputs, e.g. text,audio (default: the pipeline's).")
@click.option("--stage-params", default=None, metavar="JSON", help='Per-stage parameters, e.g. \'{"thinker": {"max_tokens": 32}}\'.')
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Directory for media outputs (WAV, PNG, MP4).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (with prompt_token_ids and token_ids).")
@click.option("-v", "--verbose", is_flag=True, help="Show library logs (vLLM etc.).")
@deploy_option
@set_option
@click.pass_context
def generate(ctx: click.Context, model: str, prompt: str, modalities: str | None, stage_params: str | None, out_dir: Path | None, as_json: bool, verbose: bool, deploy: Path | None, overrides: tuple[str, ...]) -> None:
    """Run one prompt through MODEL's pipeline and print or save what it produces."""
    params = _parse_stage_params(stage_params)
    wanted = tuple(m.strip() for m in modalities.split(",") if m.strip()) if modalities else None
    _setup_logging(verbose)
    from omni_cli.main import plugin_host
    from omni_core.config import resolve
    from omni_core.engine.offline import Omni

    pipeline = resolve(model, deploy=deploy, overrides=overrides, plugins=plugin_host(ctx))
    unknown = [m for m in wanted or () if m not in pipeline.modalities]
    if unknown:
        raise InvalidRequestError(f"{model} does not produce {', '.join(unknown)}; it produces {', '.join(pipeline.modalities)}", param="modalities")
    click.echo(f"Loading {model} ({pipeline.family}: {' -> '.join(s.name for s in pipeline.stages)}) ...", err=True)
    with Omni(pipeline) as omni:
        stream_text = not as_json and sys.stdout.isatty()

        def on_delta(delta: Any) -> None:
            if stream_text and delta.modality == "text":
                click.echo(delta.data.get("text", ""), nl=False)
            elif delta.modality != "text":
                click.echo(f"[{delta.stage}] {delta.modality} chunk {delta.index}{' (final)' if delta.final else ''}", err=True)

        (result,) = omni.generate(prompt, modalities=wanted, params_per_stage=params, on_delta=on_delta)
    paths = result.save(out_dir) if out_dir is not None else {}
    if as_json:
        click.echo(json.dumps(result.to_json(paths), indent=2))
        return
    if not stream_text:
        click.echo(result.text)
    else:
        click.echo()
    for kind, path in paths.items():
        click.echo(f"{kind}: {path}", err=True)
    if result.audio is not None and out_dir is None:
        click.echo(f"audio: {result.audio_duration:.2f} s at {result.sample_rate} Hz (pass --out DIR to save it)", err=True)


def _parse_stage_params(text: str | None) -> dict[str, dict[str, Any]]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"--stage-params is not valid JSON: {exc}", param="stage_params") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise InvalidRequestError('--stage-params must be an object of objects, e.g. {"stage": {"max_tokens": 8}}', param="stage_params")
    return value


@click.command("make-tiny")
@click.argument("family")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--size", type=click.Choice(["tiny", "bench"]), default="tiny", show_default=True, help="bench: tens of millions of parameters.")
@click.pass_context
def make_tiny(ctx: click.Context, family: str, directory: Path, size: str) -> None:
    """Write a tiny random-weight checkpoint of FAMILY's real architecture into DIRECTORY."""
    from omni_cli.main import plugin_host
    from omni_core.refs import load_ref

    host = plugin_host(ctx)
    fam = host.families.get(family)
    if fam is None:
        raise ConfigError(f"unknown family {family!r}; installed families: {', '.join(sorted(host.families)) or 'none'}")
    if fam.make_tiny is None:
        raise ConfigError(f"family {family!r} cannot write tiny checkpoints")
    if directory.exists() and any(directory.iterdir()):
        raise ConfigError(f"{directory} exists and is not empty")
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    click.echo(f"Writing a {size} {family} checkpoint to {directory} ...", err=True)
    try:
        load_ref(fam.make_tiny)(directory, size)
    except ValueError as exc:  # the family's way to refuse a size it does not have (docs/plugins.md)
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        raise ConfigError(f"family {family!r} cannot write a {size!r} checkpoint: {exc}", key="--size") from exc
    click.echo(str(directory))


@click.command()
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8091, show_default=True, type=int)
@click.option("--api-key", envvar="OMNI_API_KEY", default=None, help="Require 'Authorization: Bearer KEY' on /v1 routes.")
@click.option("--max-body-mb", default=64.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="Largest request body accepted (larger: 413).")
@click.option("-v", "--verbose", is_flag=True, help="Show library logs (vLLM etc.).")
@deploy_option
@set_option
def serve(model: str, host: str, port: int, api_key: str | None, max_body_mb: float, verbose: bool, deploy: Path | None, overrides: tuple[str, ...]) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (like `vllm serve`)."""
    _setup_logging(verbose)
    from omni_core.server.app import run_server

    run_server(model, host=host, port=port, api_key=api_key, deploy=deploy, overrides=overrides, max_body_bytes=int(max_body_mb * 1024 * 1024))
