"""The one factory rule of every part (`omni_core.parts.build_part`), and the bases' constructors."""

from __future__ import annotations

from typing import Any

import pytest

from omni_core.config.resolved import ResolvedEdge, ResolvedPipeline, ResolvedStage
from omni_core.errors import PluginError
from omni_core.outputs import Chunk, StageInput
from omni_core.parts import EdgeAdapter, InputProcessor, OutputAdapter, PartContext, PassThroughAdapter, build_part
from omni_core.stages.ar_model import ARModel

HERE = __name__
EDGE = ResolvedEdge(source="a", target="b", adapter=f"{HERE}:Doubler", connector="inproc", connector_ref="x:y")
STAGE = ResolvedStage(name="b", kind="generation", runtime_ref="x:y", model="x:y", inputs=(EDGE,))
PIPELINE = ResolvedPipeline(model="m", model_path="/ckpt", family="f", stages=(STAGE,))


class Doubler(EdgeAdapter):
    """No constructor of its own: the base keeps the context."""

    def on_chunk(self, state: dict[str, Any], chunk: Chunk) -> StageInput | None:
        return StageInput(data={"x": 2 * chunk.data["x"]}, final=chunk.final)


class Labels(OutputAdapter):
    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self.label = context.stage.name if context.stage else "?"

    def to_output(self, chunk: Chunk) -> dict[str, Any]:
        return {"text": f"{self.label}:{chunk.data['x']}"}


class Prompts(InputProcessor):
    def process(self, request: Any) -> dict[str, StageInput]:
        return {"a": StageInput(data={"prompt": request})}


class LM(ARModel):
    subfolder = "lm"


def make_doubler(context: PartContext) -> Doubler:
    """A factory function serves as well as a class."""
    return Doubler(context)


A_DOUBLER = Doubler(PartContext(PIPELINE))


def test_every_part_is_built_from_one_context() -> None:
    context = PartContext(PIPELINE, STAGE, EDGE, replica=1)
    adapter = build_part(f"{HERE}:Doubler", context, EdgeAdapter, "edge adapter")
    assert adapter.context is context and context.model_path == "/ckpt"
    assert adapter.on_chunk({}, Chunk("r", "a", 0, {"x": 3}, final=True)) == StageInput(data={"x": 6})
    assert isinstance(build_part(f"{HERE}:make_doubler", context, EdgeAdapter, "edge adapter"), Doubler)
    assert build_part(f"{HERE}:Labels", PartContext(PIPELINE, STAGE), OutputAdapter, "out").to_output(Chunk("r", "b", 0, {"x": 1})) == {"text": "b:1"}
    processor = build_part(f"{HERE}:Prompts", PartContext(PIPELINE), InputProcessor, "input processor")
    processor.load()  # the default: nothing to load
    assert processor.process("hi") == {"a": StageInput(data={"prompt": "hi"})}
    lm = build_part(f"{HERE}:LM", PartContext(PIPELINE, STAGE), ARModel, "model part")
    assert lm.engine_args()["model"] == "/ckpt/lm"
    assert PassThroughAdapter(context).on_chunk({}, Chunk("r", "a", 0, {"x": 1})) == StageInput(data={"x": 1}, final=False)


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (f"{HERE}:A_DOUBLER", "is an instance of Doubler; refer to a factory"),
        (f"{HERE}:HERE", "is a str, not a factory"),
        (f"{HERE}:Labels", "returned a Labels; it must return a omni_core.parts.EdgeAdapter"),
        (f"{HERE}:Nowhere", "has no Nowhere"),
    ],
)
def test_a_wrong_reference_says_what_the_rule_is(ref: str, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        build_part(ref, PartContext(PIPELINE, STAGE, EDGE), EdgeAdapter, "edge 'a->b' adapter")
