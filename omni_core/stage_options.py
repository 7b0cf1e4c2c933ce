"""What each stage kind accepts: options read from the attrs classes that type them.

Every option documents itself where it is defined, in its field's metadata::

    max_num_seqs: int = attrs.field(default=8, metadata={"doc": "Most samples denoised at once."})

so the CLI (``omni stages``), ``docs/stage-options.md`` (`render_markdown`) and the code cannot
drift apart. A stage kind's options class is its runtime's `Options`; the settings every stage has
are `omni_core.config.deploy.StageDeploy`'s. Runtime classes are imported only here, when asked
for, through their lazy ``"module:Class"`` references.
"""

from __future__ import annotations

import json
import textwrap
import types
import typing
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import attrs

from omni_core.config.deploy import StageDeploy
from omni_core.refs import load_ref

if TYPE_CHECKING:
    from omni_core.plugins import PluginHost

__all__ = [
    "DOC_KEY",
    "EVERY_STAGE",
    "MARKDOWN_COMMAND",
    "OptionDoc",
    "OptionSection",
    "every_stage_section",
    "kind_section",
    "kind_sections",
    "option_docs",
    "render_json",
    "render_markdown",
    "render_text",
    "undocumented_options",
]

DOC_KEY = "doc"
EVERY_STAGE = "every stage"
MARKDOWN_COMMAND = "OMNI_PLUGINS= omni stages --markdown > docs/stage-options.md"

_TEXT_WIDTH = 100


@attrs.frozen
class OptionDoc:
    """One option as a reader needs it: name, type and default as text, and what it does."""

    name: str
    type: str
    required: bool
    default: Any  # the default value (a factory's product); None when `required`
    doc: str  # empty when the field has no ``doc`` metadata

    @property
    def default_text(self) -> str:
        """The default as it reads in Python (``None``, ``'auto'``, ``{}``), or ``required``."""
        return "required" if self.required else repr(self.default)


@attrs.frozen
class OptionSection:
    """The options of one stage kind, or the settings of every stage (`EVERY_STAGE`)."""

    title: str  # the kind (``ar``), or `EVERY_STAGE`
    summary: str  # first paragraph of the options class docstring
    source: str  # where the options come from: the runtime's reference, or the deploy class
    plugin: str | None  # the plugin that registered the kind
    options: tuple[OptionDoc, ...]
    error: str | None = None  # why the options could not be read (the runtime failed to import)


def option_docs(options_class: type, prefix: str = "") -> tuple[OptionDoc, ...]:
    """Every field of the attrs class `options_class`, in definition order; a field that is an
    attrs class itself (``ray``) is listed, then each of its fields as ``ray.NAME``."""
    hints = _type_hints(options_class)
    docs = []
    for field in attrs.fields(options_class):
        default = field.default
        required = default is attrs.NOTHING
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            # A factory that needs the instance has no default to show without building one.
            default = None if default.takes_self else default.factory()
        nested = hints.get(field.name)
        if isinstance(nested, type) and attrs.has(nested):
            doc = " ".join(str(field.metadata.get(DOC_KEY, "")).split())
            docs.append(OptionDoc(name=prefix + field.name, type="mapping", required=False, default={}, doc=doc))
            docs.extend(option_docs(nested, prefix=f"{prefix}{field.name}."))
            continue
        docs.append(
            OptionDoc(
                name=prefix + field.name,
                type=_type_text(hints[field.name]) if field.name in hints else str(field.type),
                required=required,
                default=None if required else default,
                doc=" ".join(str(field.metadata.get(DOC_KEY, "")).split()),
            )
        )
    return tuple(docs)


def undocumented_options(options_class: type) -> list[str]:
    """The names of `options_class`'s fields that have no ``doc`` metadata."""
    return [option.name for option in option_docs(options_class) if not option.doc]


def every_stage_section() -> OptionSection:
    """The deploy settings every stage has, whatever its kind (`StageDeploy`)."""
    return OptionSection(
        title=EVERY_STAGE,
        summary=_summary(StageDeploy),
        source=f"{StageDeploy.__module__}:{StageDeploy.__qualname__}",
        plugin=None,
        options=option_docs(StageDeploy),
    )


def kind_section(host: PluginHost, kind: str) -> OptionSection:
    """The options of stage kind `kind`, imported from its registered runtime class.

    Raises `UnknownNameError` (or `PluginError`) for a kind that is not registered (or registered
    twice); a runtime that cannot be imported gives a section with `error` set.
    """
    ref = host.stage_runtime(kind)
    plugin = host.owner("stage runtime", kind)
    try:
        runtime = load_ref(ref)
    except Exception as exc:  # noqa: BLE001 - one broken plugin must not hide the other kinds
        error = f"cannot import {ref}: {type(exc).__name__}: {exc}"
        return OptionSection(kind, "", ref, plugin, (), error)
    options_class = getattr(runtime, "Options", None)
    if options_class is None or not attrs.has(options_class):
        return OptionSection(kind, "", ref, plugin, (), f"{ref} does not set `Options` to an attrs class")
    return OptionSection(kind, _summary(options_class), ref, plugin, option_docs(options_class))


def kind_sections(host: PluginHost, kinds: Iterable[str] | None = None) -> list[OptionSection]:
    """The sections of `kinds` (default: every registered kind, sorted)."""
    return [kind_section(host, kind) for kind in (sorted(host.stage_runtimes) if kinds is None else kinds)]


# -- rendering ------------------------------------------------------------------------------------


def render_text(kinds: Sequence[OptionSection], every_stage: OptionSection) -> str:
    """Plain text for a terminal: a heading per kind, then every stage's, each option as
    ``name: type = default`` over its doc."""
    blocks = []
    for section in [*kinds, every_stage]:
        origin = section.source if section.plugin is None else f"{section.source}, plugin {section.plugin}"
        lines = [f"{section.title}  ({origin})"]
        if section.error:
            lines.append(f"  cannot list its options: {section.error}")
        if section.summary:
            lines.extend(textwrap.wrap(section.summary, _TEXT_WIDTH, initial_indent="  ", subsequent_indent="  "))
        for option in section.options:
            lines.append("")
            lines.append(f"  {option.name}: {option.type} = {option.default_text}")
            doc = option.doc or "(undocumented)"
            lines.extend(textwrap.wrap(doc, _TEXT_WIDTH, initial_indent="      ", subsequent_indent="      "))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def render_json(kinds: Sequence[OptionSection], every_stage: OptionSection) -> str:
    """JSON: ``{"kinds": {KIND: {...}}, "every stage": {...}}``; each option has ``name``,
    ``type``, ``required``, ``default`` (JSON, else its ``repr``) and ``doc``."""
    document = {
        "kinds": {section.title: _section_json(section) for section in kinds},
        EVERY_STAGE: _section_json(every_stage),
    }
    return json.dumps(document, indent=2)


def render_markdown(kinds: Sequence[OptionSection], every_stage: OptionSection) -> str:
    """Markdown for ``docs/stage-options.md``: a table of options per stage kind, then every stage's."""
    lines = [
        "# Stage options",
        "",
        f"<!-- Generated from the options classes (omni_core.stage_options); regenerate with: {MARKDOWN_COMMAND} -->",
        "",
        "What a stage of each kind accepts under `options` in a deploy file (or `--set STAGE.OPTION=VALUE`),",
        "then the settings every stage has, whatever its kind. `omni stages [KIND]` prints the same,",
        "including the kinds that installed plugins add.",
    ]
    for section in [*kinds, every_stage]:
        title = "Every stage" if section is every_stage else f"`{section.title}`"
        lines += ["", f"## {title}", ""]
        if section.error:
            lines += [f"Its options cannot be listed: {section.error}", ""]
        if section.summary:
            lines += [section.summary, ""]
        lines.append(f"Defined by `{section.source}`.")
        lines += ["", "| Option | Type | Default | Description |", "| --- | --- | --- | --- |"]
        for option in section.options:
            cells = [f"`{option.name}`", _code(option.type), _code(option.default_text), option.doc]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _section_json(section: OptionSection) -> dict[str, Any]:
    return {
        "summary": section.summary,
        "source": section.source,
        "plugin": section.plugin,
        "error": section.error,
        "options": [
            {
                "name": option.name,
                "type": option.type,
                "required": option.required,
                "default": _jsonable(option.default),
                "doc": option.doc,
            }
            for option in section.options
        ],
    }


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return list(value) if isinstance(value, tuple) else value


def _code(text: str) -> str:
    # A backtick inside (a default string holding one) needs a longer fence.
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _summary(options_class: type) -> str:
    doc = options_class.__doc__ or ""
    first_paragraph = textwrap.dedent(doc).strip().split("\n\n")[0]
    return " ".join(first_paragraph.split())


def _type_hints(options_class: type) -> dict[str, Any]:
    # Annotations are strings (``from __future__ import annotations``); resolving them in the
    # class's module turns aliases such as ``Dtype`` into the values they allow.
    try:
        return typing.get_type_hints(options_class)
    except Exception:  # noqa: BLE001 - a name under TYPE_CHECKING: fall back to the annotation text
        return {}


def _type_text(hint: Any) -> str:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is type(None):
        return "None"
    if hint is Any:
        return "Any"
    if origin is typing.Literal:
        return " | ".join(repr(arg) for arg in args)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_text(arg) for arg in args)
    if origin is not None and args:
        inner = ", ".join("..." if arg is Ellipsis else _type_text(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(hint, "__name__", str(hint))
