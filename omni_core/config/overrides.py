"""``--set`` overrides and the deep merge of raw deploy dicts (later layer wins).

Override syntax (values are YAML scalars or flow collections: ``true``, ``4``, ``[a, b]``):

- ``STAGE.FIELD=value``: a `StageDeploy` field (placement, replicas, devices, load_balancer, cpu_threads, nice,
  allocator, watchdog_s, keep_freed_memory, kernel_cache);
- ``STAGE.OPTION=value`` or ``STAGE.options.OPTION=value``: a runtime option of the stage's kind
  (dots below the option name reach into a nested option);
- ``defaults.FIELD=value``: `DeployConfig.defaults`;
- ``streaming=false``;
- ``edge.SRC->DST.connector=NAME`` and ``edge.SRC->DST.OPTION=value`` (connector options);
- ``output_connector.connector=NAME`` and ``output_connector.OPTION=value``.

``stages.STAGE...`` and ``edges.SRC->DST...`` are accepted as spellings of the same keys.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import yaml

from omni_core.config.deploy import EdgeDeploy, StageDeploy
from omni_core.errors import ConfigError

STAGE_FIELDS = tuple(f.name for f in attrs.fields(StageDeploy) if f.name != "options")
EDGE_FIELDS = tuple(f.name for f in attrs.fields(EdgeDeploy) if f.name != "options")


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `update` into a copy of `base`: mappings merge key by key, anything else is replaced."""
    merged = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key=value`` and parse the value as YAML; a malformed override is a `ConfigError`."""
    key, sep, raw_value = text.partition("=")
    key = key.strip()
    if not sep and key.endswith("-"):
        # `--set edge.a->b.connector=x` unquoted: the shell took `>b.connector=x` as a redirection
        # (and wrote a file of that name); only `edge.a-` arrived.
        raise ConfigError(
            f"override {text!r} ends in '-': the shell read the '>' of '->' as a redirection. "
            "Quote the override: --set 'edge.SRC->DST.connector=NAME'",
            key=key,
        )
    if not sep:
        raise ConfigError(
            f"override {text!r} has no '=': write KEY=VALUE, e.g. thinker.replicas=2", key=key or text
        )
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"override {text!r} has an empty key: write KEY=VALUE, e.g. thinker.replicas=2", key=key or text
        )
    try:
        value = yaml.safe_load(raw_value)  # (an empty value unsets the key: `overrides_to_dict`)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"value {raw_value!r} of override {text!r} is not valid YAML ({exc})", key=key
        ) from exc
    return key, value


def overrides_to_dict(overrides: Iterable[str], stage_names: Sequence[str]) -> dict[str, Any]:
    """Turn ``--set`` overrides into a raw deploy dict layer (applied in order: later wins).

    ``KEY=`` with nothing after the ``=`` unsets KEY: it is left out of the layer and listed by
    `unset_paths`, and the merged deploy drops it, so the setting's own default applies (not the
    family default deploy's value)."""
    layer: dict[str, Any] = {}
    for text in overrides:
        key, value = parse_override(text)
        path = _deploy_path(key, stage_names)
        if _is_unset(text):
            layer = drop_path(layer, path)
            continue
        layer = deep_merge(layer, _nest(path, value))
    return layer


def unset_paths(overrides: Iterable[str], stage_names: Sequence[str]) -> list[list[str]]:
    """The deploy paths that ``KEY=`` overrides unset, in order (a later ``KEY=VALUE`` sets it again)."""
    paths: list[list[str]] = []
    for text in overrides:
        key, _ = parse_override(text)
        path = _deploy_path(key, stage_names)
        paths = [p for p in paths if p != path]
        if _is_unset(text):
            paths.append(path)
    return paths


def _is_unset(text: str) -> bool:
    return text.partition("=")[2].strip() == ""


def drop_path(data: Mapping[str, Any], path: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` without the key at `path` (absent keys are fine)."""
    result = dict(data)
    head, *rest = path
    if not rest:
        result.pop(head, None)
    elif isinstance(result.get(head), Mapping):
        result[head] = drop_path(result[head], rest)
    return result


def _deploy_path(key: str, stage_names: Sequence[str]) -> list[str]:
    head, _, rest = key.partition(".")
    if head == "streaming" and not rest:
        return ["streaming"]
    if head == "defaults":
        if not rest:
            raise ConfigError("write defaults.FIELD=value, e.g. defaults.placement=inline", key=key)
        return ["defaults", *rest.split(".")]
    if head in ("edge", "edges"):
        edge, _, field = rest.partition(".")
        if not edge or not field or "->" not in edge:
            raise ConfigError("write edge.SRC->DST.connector=NAME, quoted for the shell: --set 'edge.SRC->DST.connector=NAME'", key=key)
        return ["edges", edge, *_connector_path(field)]
    if head == "output_connector":
        if not rest:
            raise ConfigError("write output_connector.connector=NAME", key=key)
        return ["output_connector", *_connector_path(rest)]
    if head == "ray" and rest:  # ray.address=auto
        return ["ray", *rest.split(".")]
    if head == "stages":
        head, _, rest = rest.partition(".")
    if head not in stage_names:
        raise ConfigError(unknown_name_message("stage", head, stage_names), key=f"stages.{head}")
    if not rest:
        raise ConfigError(f"write {head}.OPTION=value, e.g. {head}.replicas=2", key=key)
    field, _, below = rest.partition(".")
    if field in STAGE_FIELDS and not below:
        return ["stages", head, field]
    if field == "ray" and below:  # talker.ray.resources.node_b=0.01
        return ["stages", head, "ray", *below.split(".")]
    if field == "options":
        if not below:
            raise ConfigError(f"write {head}.options.OPTION=value", key=key)
        return ["stages", head, "options", *below.split(".")]
    return ["stages", head, "options", *rest.split(".")]


def _connector_path(field: str) -> list[str]:
    name, _, below = field.partition(".")
    if name in EDGE_FIELDS and not below:
        return [name]
    if name == "options" and below:
        return ["options", *below.split(".")]
    return ["options", *field.split(".")]


def _nest(path: Sequence[str], value: Any) -> dict[str, Any]:
    nested: Any = value
    for part in reversed(path):
        nested = {part: nested}
    return nested


def unknown_name_message(what: str, name: str, known: Iterable[str]) -> str:
    """``unknown stage 'thinkr' (did you mean 'thinker'?); known: thinker, talker``."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {what} {name!r}{hint}; known: {', '.join(known) or 'none'}"
