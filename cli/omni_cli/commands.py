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
stage_configs_option = click.option("--stage-configs-path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="A vLLM-Omni stage-config YAML, read as the deploy config (omni convert-stage-config FILE shows what it becomes).")
set_option = click.option("--set", "overrides", multiple=True, metavar="STAGE.OPTION=VALUE", help="Override a deploy setting; repeatable, later wins.")


def _setup_logging(verbose: bool) -> None:
    # stdout carries results (--json); libraries' logs go to stderr, also in stage processes.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not verbose:
        # vLLM logs its configuration and CPU-build advice in every stage process, transformers and
        # diffusers their config and dtype notes on every load; -v shows them.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        # Libraries' deprecation notices are for their callers' developers, not for a user's run.
        os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # The engine's own progress (stage ready, pipeline ready) is worth seeing by default.
    logging.getLogger("omni_core").setLevel(logging.INFO)


@click.command()
@click.argument("model")
@click.option("--prompt", required=True, help="The text prompt.")
@click.option("--modalities", default=None, help="Comma-separated outputs, e.g. text,audio (default: the pipeline's).")
@click.option("--stage-params", default=None, metavar="JSON", help='Per-stage parameters, e.g. \'{"thinker": {"max_tokens": 32}}\'.')
@click.option("--task", default=None, help="The pipeline task to run, for a family with tasks (default: the modalities pick it).")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path), help="An input image file (repeatable), sent before the prompt in one chat message, as image_url parts: for a model that reads images (e.g. Qwen3-Omni, HunyuanImage-3.0 i2t; with --modalities image, an Instruct HunyuanImage-3.0 edits it; for Cosmos3 with --modalities action, the first frame). For a video (--modalities video, or a model whose default is one, e.g. MiniMax-H3) the first --image is the first frame and a second the last one, as /v1/videos' input_reference and last_frame.")
@click.option("--reference", "references", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path), help="A reference image or audio file for a video (repeatable, in order), as /v1/videos' references: e.g. MiniMax-H3's ref2va (up to 9 images, 3 audio). Its type comes from its name (else its bytes: an image, or audio).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Directory for media outputs (WAV, PNG, MP4).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (with prompt_token_ids and token_ids).")
@click.option("-v", "--verbose", is_flag=True, help="Show library logs (vLLM etc.).")
@deploy_option
@set_option
@click.pass_context
def generate(ctx: click.Context, model: str, prompt: str, modalities: str | None, stage_params: str | None, task: str | None, images: tuple[Path, ...], references: tuple[Path, ...], out_dir: Path | None, as_json: bool, verbose: bool, deploy: Path | None, overrides: tuple[str, ...]) -> None:
    """Run one prompt through MODEL's pipeline and print or save what it produces."""
    params = _parse_stage_params(stage_params)
    wanted = tuple(m.strip() for m in modalities.split(",") if m.strip()) if modalities else None
    _setup_logging(verbose)
    from omni_cli.main import plugin_host
    from omni_core.config import resolve
    from omni_core.engine.offline import Omni
    from omni_core.engine.request import OmniRequest

    pipeline = resolve(model, deploy=deploy, overrides=overrides, plugins=plugin_host(ctx))
    unknown = [m for m in wanted or () if m not in pipeline.modalities]
    if unknown:
        raise InvalidRequestError(f"{model} does not produce {', '.join(unknown)}; it produces {', '.join(pipeline.modalities)}", param="modalities")
    if task is not None:  # (refused before the pipeline loads, as the engine would after; no tasks: "none")
        from omni_core.config.tasks import choose_task

        choose_task(pipeline.tasks, {s.name: s for s in pipeline.stages}, task, wanted, pipeline.default_modalities)
    video = "video" in (wanted or pipeline.default_modalities)
    extra = _keyframes(images) if images and video else None  # (a video's fields: /v1/videos' frames and references)
    if references:
        if not video:
            raise click.UsageError(f"--reference is a video's reference ({model} makes {', '.join(wanted or pipeline.default_modalities)}): for an image to read, use --image")
        extra = {**(extra or {}), "references": [_reference(path) for path in references]}
    click.echo(f"Loading {model} ({pipeline.family}: {' -> '.join(s.name for s in pipeline.stages)}) ...", err=True)
    with Omni(pipeline) as omni:
        stream_text = not as_json and sys.stdout.isatty()

        def on_delta(delta: Any) -> None:
            if stream_text and delta.modality == "text":
                click.echo(delta.data.get("text", ""), nl=False)
            elif delta.modality != "text" and _worth_a_line(delta):
                click.echo(_describe(delta), err=True)

        if extra is not None:
            request = OmniRequest(prompt=prompt, modalities=wanted, params=params or {}, task=task, extra=extra)
        elif images:
            content = [*({"type": "image_url", "image_url": {"url": _data_url(path)}} for path in images), {"type": "text", "text": prompt}]
            request = OmniRequest(messages=[{"role": "user", "content": content}], modalities=wanted, params=params or {}, task=task)
        else:
            request = OmniRequest(prompt=prompt, modalities=wanted, params=params or {}, task=task)
        (result,) = omni.generate(request, on_delta=on_delta)
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


_MEDIA_KEYS = ("image", "video", "audio", "actions")


def _data_url(path: Path) -> str:
    """A local file (the CLI user's own) as a base64 ``data:`` URL, its type from its name."""
    import base64
    import mimetypes

    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def _reference(path: Path) -> dict[str, str]:
    """A ``--reference`` file as a video request's reference, ``{"type": "image"|"audio", ...: data URL}``:
    audio when its name says so, an image when its name or (no type in its name) its header does."""
    url = _data_url(path)
    kind = url[5:].partition("/")[0]
    if kind not in ("image", "audio"):
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path):
                kind = "image"
        except Image.DecompressionBombError:
            kind = "image"  # (an image over PIL's limit: the request refuses it, naming the pixel limit)
        except (UnidentifiedImageError, OSError):
            kind = "audio"
    return {"type": kind, kind: url}


def _keyframes(images: tuple[Path, ...]) -> dict[str, str]:
    """A video request's ``--image`` files as its first and last frames: the request fields
    ``image`` and ``last_image`` that /v1/videos' ``input_reference`` and ``last_frame`` become."""
    if len(images) > 2:
        raise click.UsageError(f"a video takes at most two --image files (its first and last frames), got {len(images)}")
    return dict(zip(("image", "last_image"), map(_data_url, images)))


def _worth_a_line(delta: Any) -> bool:
    """Every chunk; of a diffusion stage's steps, the first, the last and about every tenth (a
    50-step image would otherwise print 50 lines)."""
    if delta.step_progress is None or delta.step_progress[1] <= 10:
        return True
    step, total = delta.step_progress
    return step in (1, total) or step * 10 // total != (step - 1) * 10 // total


def _describe(delta: Any) -> str:
    """A progress line for a non-text delta: a diffusion step, or what the chunk carries (a
    diffusion stage's declared output is ``video`` even when it draws an image)."""
    data = delta.data if isinstance(delta.data, dict) else {}
    if delta.step_progress is not None:
        return f"[{delta.stage}] step {delta.step_progress[0]}/{delta.step_progress[1]}"
    carried = [key for key in _MEDIA_KEYS if data.get(key) is not None] or [delta.modality]
    return f"[{delta.stage}] {', '.join(carried)} chunk {delta.index}{' (final)' if delta.final else ''}"


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


MEDIA_DOMAINS_FLAG = "--allowed-media-domains"


def spread_option(args: list[str], flag: str) -> list[str]:
    """``FLAG a b c`` -> ``FLAG a FLAG b FLAG c``: the values that follow `flag` up to the next
    option, as argparse's ``nargs="+"`` takes them (click options take one value each)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        out.append(arg)
        i += 1
        if arg == "--":
            return out + args[i:]
        if arg != flag:
            continue
        end = i
        while end < len(args) and not args[end].startswith("-"):
            end += 1
        for index, value in enumerate(args[i:end]):
            out += [value] if index == 0 else [flag, value]
        i = end
    return out


class ServeCommand(click.Command):
    """``omni serve``: ``--allowed-media-domains`` takes several hosts after one flag, as vLLM's
    does (``--allowed-media-domains a.example b.example``); repeating the flag works too."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_option(list(args), MEDIA_DOMAINS_FLAG))


@click.command(cls=ServeCommand)
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8091, show_default=True, type=int)
@click.option("--api-key", envvar="OMNI_API_KEY", default=None, help="Require 'Authorization: Bearer KEY' on /v1 routes.")
@click.option("--max-body-mb", default=64.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="Largest request body accepted (larger: 413).")
@click.option("--allowed-local-media-path", default=None, metavar="DIR", help="Let requests name media as file:// URLs of files under DIR (symlinks and .. resolved). Default: base64 data: URLs only.")
@click.option(MEDIA_DOMAINS_FLAG, "allowed_media_domains", multiple=True, metavar="HOST [HOST ...]", help="Let requests name media as http(s):// URLs on these hosts (fetched with --max-media-mb and --media-fetch-timeout; redirects only to these hosts). Default: none.")
@click.option("--max-media-mb", default=32.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="Largest medium read from an allowed file:// or http(s):// URL.")
@click.option("--media-fetch-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True), metavar="SECONDS", help="Time limit of one allowed http(s):// media fetch.")
@click.option("--max-prompt-chars", default=None, type=click.IntRange(min=1), help="Longest prompt text accepted, checked before tokenizing (default: 32 characters per token of the first AR stage's max_model_len).")
@click.option("-v", "--verbose", is_flag=True, help="Show library logs (vLLM etc.).")
@deploy_option
@stage_configs_option
@set_option
def serve(
    model: str, host: str, port: int, api_key: str | None, max_body_mb: float, allowed_local_media_path: str | None,
    allowed_media_domains: tuple[str, ...], max_media_mb: float, media_fetch_timeout: float, max_prompt_chars: int | None,
    verbose: bool, deploy: Path | None, stage_configs_path: Path | None, overrides: tuple[str, ...],
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (like `vllm serve`)."""
    from omni_core.media_access import MediaAccess

    media = MediaAccess.create(allowed_local_media_path, allowed_media_domains, int(max_media_mb * 1024 * 1024), media_fetch_timeout)
    _setup_logging(verbose)
    from omni_core.server.app import run_server

    deploy_source: Any = deploy
    if stage_configs_path is not None:
        if deploy is not None:
            raise click.UsageError("give --deploy or --stage-configs-path, not both (omni convert-stage-config FILE prints the deploy file to start from)")
        deploy_source = _converted_stage_config(stage_configs_path, model).deploy
    run_server(
        model, host=host, port=port, api_key=api_key, deploy=deploy_source, overrides=overrides, max_body_bytes=int(max_body_mb * 1024 * 1024),
        media=media, max_prompt_chars=max_prompt_chars,
    )


@click.command("convert-stage-config")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", default=None, help="Read FILE against MODEL's pipeline (its stage names and graph); default: the stages FILE names.")
@click.pass_context
def convert_stage_config(ctx: click.Context, file: Path, model: str | None) -> None:
    """Print the Omni deploy YAML equivalent to a vLLM-Omni stage-config FILE (ignored fields: warnings on stderr)."""
    from omni_cli.main import plugin_host
    from omni_core.config.vllm_omni import convert_stage_config as convert
    from omni_core.config.vllm_omni import read_stage_config

    conversion = _converted_stage_config(file, model, plugin_host(ctx)) if model else convert(read_stage_config(file), source=str(file))
    for line in conversion.warnings:
        click.echo(f"Warning: {line}", err=True)
    click.echo(conversion.to_yaml(), nl=False)


def _converted_stage_config(path: Path, model: str, plugins: Any = None) -> Any:
    """`path` (a vLLM-Omni stage config) converted against `model`'s pipeline; for ``serve``
    (no `plugins` given) each ignored field is logged as one warning line."""
    from omni_core.config.vllm_omni import convert_for_model

    conversion = convert_for_model(path, model, plugins)
    if plugins is None:
        for line in conversion.warnings:
            logging.getLogger("omni_core.config.vllm_omni").warning("%s: %s", path, line)
    return conversion
