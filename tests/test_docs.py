"""docs/plugins.md stays true: every hook, every field a family declares and every part's contract is
in it (a new hook, field or abstract method without its documentation fails here)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import attrs
import pytest

from omni_core import hookspecs, parts
from omni_core.config.pipeline import EdgeSpec, PipelineConfig, StageSpec
from omni_core.families import PipelineFamily
from omni_core.stages.ar_model import ARModel
from omni_core.stages.diffusion_model import DiffusionModel
from omni_core.stages.generation_model import GenerationModel

DOC = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text(encoding="utf-8")


def documented(name: str) -> bool:
    """Named in code: in backticks or in a code block (`name`, `name(`, `name=`, `name: `)."""
    return re.search(rf"(?<!\w){re.escape(name)}(?=`|\(|=|: | \(|,|\))", DOC) is not None


def test_every_hook_is_documented() -> None:
    hooks = [name for name, obj in vars(hookspecs).items() if hasattr(obj, "omni_spec")]
    assert hooks, "no hookspecs found"
    for name in hooks:
        signature = f"`{name}({', '.join(inspect.signature(getattr(hookspecs, name)).parameters)})`"
        assert signature in DOC, f"docs/plugins.md lacks the hook {signature}"


@pytest.mark.parametrize("cls", [PipelineFamily, PipelineConfig, StageSpec, EdgeSpec, parts.PartContext])
def test_every_declared_field_is_documented(cls: type) -> None:
    for field in attrs.fields(cls):
        assert documented(field.name), f"docs/plugins.md lacks {cls.__name__}.{field.name}"


def test_every_part_base_and_its_methods_are_documented() -> None:
    for name in parts.__all__:
        assert documented(name), f"docs/plugins.md lacks omni_core.parts.{name}"
    for base in (parts.EdgeAdapter, parts.OutputAdapter, parts.InputProcessor, GenerationModel, DiffusionModel):
        for method in sorted(getattr(base, "__abstractmethods__", ())):
            assert documented(method), f"docs/plugins.md lacks {base.__name__}.{method}"


@pytest.mark.parametrize("base", [ARModel, GenerationModel])
def test_every_model_part_declaration_is_documented(base: type) -> None:
    declarations = [name for name in base.__annotations__ if not name.startswith("_")]
    assert declarations
    for name in declarations:
        assert documented(name), f"docs/plugins.md lacks {base.__name__}.{name}"


def test_the_readme_and_this_page_state_the_same_measured_counts() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    for lines, code in (("65", "48"), ("63", "53"), ("56", "40"), ("60", "51"), ("86", "65"), ("95", "82"), ("110", "92")):
        assert f"| {lines} | {code} |" in DOC
        assert f"{lines} lines of Python ({code} " in readme or f"{lines} ({code})" in readme


def test_the_documented_connector_example_is_as_long_as_stated() -> None:
    example = Path(__file__).resolve().parents[1] / "docs" / "examples" / "omni-fileconn" / "omni_fileconn"
    lines = [line for path in sorted(example.glob("*.py")) for line in path.read_text(encoding="utf-8").splitlines()]
    code = [line for line in lines if line.strip() and not line.strip().startswith("#")]
    assert f"| {len(lines)} | {len(code)} |" in DOC
    assert f"directory, {len(lines)} lines of Python" in DOC
    assert len(lines) < 80
