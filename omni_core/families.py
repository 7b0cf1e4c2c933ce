"""`PipelineFamily`: what a model plugin registers to serve a family of checkpoints."""

from __future__ import annotations

import attrs


@attrs.frozen
class PipelineFamily:
    """A model family: which checkpoints it matches and how to build its pipeline.

    - `pipeline`: lazy ``"module:attr"`` of ``(model_path: str, hf_config: dict) -> PipelineConfig``.
    - `architectures` / `model_types`: matched against a transformers ``config.json``;
      `diffusers_classes` against a diffusers ``model_index.json`` ``_class_name``.
    - `make_tiny`: lazy reference to ``(directory: pathlib.Path, size: str) -> None`` writing a tiny
      random-weight checkpoint of the real architecture; enables ``omni-tiny/<name>``.
    - `tiny_format`: the version of what `make_tiny` writes. Raise it when that changes: an
      ``omni-tiny/<name>`` checkpoint cached by an older version is then written afresh (beside the
      old one, which a running process may still read) instead of being reused.
    """

    name: str
    pipeline: str
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    diffusers_classes: tuple[str, ...] = ()
    make_tiny: str | None = None
    tiny_format: int = attrs.field(default=1, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])
    description: str = ""
