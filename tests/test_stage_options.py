"""Stage options read from their attrs classes: every option documented, the docs file current."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import attrs
import pytest

import omni_core
from omni_core.config.deploy import StageDeploy
from omni_core.plugins import BUILTINS_NAME, PluginHost, load_plugins
from omni_core.refs import load_ref
from omni_core.stage_options import (
    EVERY_STAGE,
    MARKDOWN_COMMAND,
    every_stage_section,
    kind_sections,
    option_docs,
    render_markdown,
    render_text,
    undocumented_options,
)

DOCS_FILE = Path(omni_core.__file__).parents[1] / "docs" / "stage-options.md"


def builtins_only() -> PluginHost:
    return load_plugins(allowlist=[], entry_points=[])


_BUILTINS = builtins_only()
BUILTIN_KINDS = sorted(kind for kind in _BUILTINS.stage_runtimes if _BUILTINS.owner("stage runtime", kind) == BUILTINS_NAME)


def test_builtin_kinds_found() -> None:
    assert BUILTIN_KINDS == ["ar", "diffusion", "generation"]


@pytest.mark.parametrize("kind", BUILTIN_KINDS)
def test_every_option_of_every_builtin_kind_is_documented(kind: str) -> None:
    options_class = load_ref(_BUILTINS.stage_runtime(kind)).Options
    assert undocumented_options(options_class) == [], (
        f"document each option of {options_class.__qualname__} with attrs.field(..., metadata={{'doc': '...'}})"
    )


def test_every_stage_setting_is_documented() -> None:
    assert undocumented_options(StageDeploy) == []


def test_docs_stage_options_md_is_current() -> None:
    expected = render_markdown(kind_sections(_BUILTINS), every_stage_section())
    assert DOCS_FILE.read_text() == expected, f"docs/stage-options.md is stale: run `{MARKDOWN_COMMAND}`"


# -- reading an options class --------------------------------------------------------------------

Mode = Literal["fast", "exact"]


@attrs.frozen
class SampleOptions:
    """Options of a sample kind."""

    name: str = attrs.field(metadata={"doc": "Required: no default."})
    mode: Mode = attrs.field(default="fast", metadata={"doc": "How to   run,\n    on two lines."})
    limit: int | None = None
    tags: tuple[str, ...] = attrs.field(factory=tuple, metadata={"doc": "Either a | or b."})
    extra: dict[str, Any] = attrs.field(factory=dict, metadata={"doc": "Passed through."})


def test_option_docs_reads_types_defaults_and_docs() -> None:
    docs = {doc.name: doc for doc in option_docs(SampleOptions)}
    assert list(docs) == ["name", "mode", "limit", "tags", "extra"]
    assert (docs["name"].type, docs["name"].required, docs["name"].default_text) == ("str", True, "required")
    assert (docs["mode"].type, docs["mode"].default_text) == ("'fast' | 'exact'", "'fast'")
    assert docs["mode"].doc == "How to run, on two lines."
    assert (docs["limit"].type, docs["limit"].default, docs["limit"].doc) == ("int | None", None, "")
    assert (docs["tags"].type, docs["tags"].default_text) == ("tuple[str, ...]", "()")
    assert (docs["extra"].type, docs["extra"].default) == ("dict[str, Any]", {})


def test_undocumented_options_are_named() -> None:
    assert undocumented_options(SampleOptions) == ["limit"]


def test_renderings_flag_missing_docs_and_escape_table_pipes() -> None:
    section = attrs.evolve(every_stage_section(), title="sample", options=option_docs(SampleOptions))
    text = render_text([section], every_stage_section())
    assert "  limit: int | None = None\n      (undocumented)" in text
    markdown = render_markdown([section], every_stage_section())
    assert "| `tags` | `tuple[str, ...]` | `()` | Either a \\| or b. |" in markdown
    assert "## `sample`" in markdown and "## Every stage" in markdown
    assert every_stage_section().title == EVERY_STAGE
