"""Strict structuring of user-written config: wrong types are errors naming the key, never coerced.

cattrs' default converter coerces (``int("2")``, ``int(2.5)``, a string into a tuple of its
characters); ``replicas: "two"`` or ``devices: cuda:0`` must be errors that name the key instead.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import cattrs
from cattrs.cols import (
    homogenous_tuple_structure_factory,
    is_mapping,
    is_sequence,
    list_structure_factory,
    mapping_structure_factory,
)
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn

from omni_core.config.overrides import unknown_name_message
from omni_core.errors import ConfigError

__all__ = ["structure_config", "STRICT"]



def structure_config(data: Any, cls: type, key: str = "", source: str | None = None) -> Any:
    """Structure `data` into `cls` with `STRICT`; errors become one `ConfigError` naming the keys.

    `key` prefixes every reported key (e.g. ``stages.thinker.options``); `source` (a file name,
    ``--set``) is added to the message so the user knows where to fix it.
    """
    try:
        return STRICT.structure(data, cls)
    except Exception as exc:  # cattrs raises (groups of) whatever the hooks raised
        problems = _collect_errors(exc, key)
        first_key, message = problems[0]
        if len(problems) > 1:
            message += "; also " + "; ".join(f"{k}: {m}" for k, m in problems[1:])
        if source:
            message += f" (in {source})"
        raise ConfigError(message, key=first_key or None) from exc


def _collect_errors(exc: BaseException, path: str) -> list[tuple[str, str]]:
    """Flatten a cattrs exception tree into ``(dotted key, message)`` pairs."""
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        return [
            (_join(path, name), unknown_name_message("key", name, known)) for name in sorted(exc.extra_fields)
        ]
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without_notes = exc.group_exceptions()
        problems: list[tuple[str, str]] = []
        for sub, note in with_notes:
            if isinstance(note, AttributeValidationNote):
                segment = note.name
            elif isinstance(note, IterableValidationNote):
                segment = str(note.index)
            else:
                segment = ""
            problems += _collect_errors(sub, _join(path, segment))
        for sub in without_notes:
            problems += _collect_errors(sub, path)
        return problems or [(path, str(exc))]
    if isinstance(exc, ValueError) and len(exc.args) > 1 and isinstance(exc.args[0], str):
        return [(path, exc.args[0])]  # attrs' `in_` validator: (message, attribute, options, value)
    return [(path, str(exc) or type(exc).__name__)]


def _join(path: str, segment: str) -> str:
    if not segment:
        return path
    return f"{path}.{segment}" if path else segment


def _kind(value: Any) -> str:
    return type(value).__name__


def _structure_int(value: Any, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r} ({_kind(value)})")
    return value


def _structure_float(value: Any, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r} ({_kind(value)})")
    return float(value)


def _structure_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r} ({_kind(value)})")
    return value


def _structure_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r} ({_kind(value)})")
    return value


def _literal_hook(type_: Any) -> Callable[[Any, type], Any]:
    allowed = typing.get_args(type_)

    def structure(value: Any, _: type) -> Any:
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ValueError(f"{value!r} is not one of: {', '.join(map(str, allowed))}")
        return value

    return structure


def _is_union(type_: Any) -> bool:
    return typing.get_origin(type_) in (typing.Union, types.UnionType)


def _union_hook(type_: Any, converter: cattrs.Converter) -> Callable[[Any, type], Any]:
    members = typing.get_args(type_)

    def structure(value: Any, _: type) -> Any:
        if value is None and type(None) in members:
            return None
        # First member that takes the value as it is wins: no coercion, as everywhere else.
        for member in members:
            if member is type(None):
                continue
            try:
                return converter.structure(value, member)
            except Exception:
                continue
        names = " or ".join(
            getattr(m, "__name__", str(m)) if m is not type(None) else "null" for m in members
        )
        raise TypeError(f"expected {names}, got {value!r} ({_kind(value)})")

    return structure


def _checked(
    base: Callable[[Any, Any], Any], accepts: tuple[type, ...], expected: str
) -> Callable[[Any, Any], Any]:
    def structure(value: Any, type_: Any) -> Any:
        if not isinstance(value, accepts):
            raise TypeError(f"expected {expected}, got {value!r} ({_kind(value)})")
        return base(value, type_)

    return structure


def _is_homogenous_tuple(type_: Any) -> bool:
    args = typing.get_args(type_)
    return typing.get_origin(type_) is tuple and len(args) == 2 and args[1] is Ellipsis


def make_strict_converter() -> cattrs.Converter:
    """A converter that never coerces, forbids unknown keys and reports every error."""
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook_factory(lambda t: typing.get_origin(t) is Literal, _literal_hook)
    converter.register_structure_hook_factory(_is_union, _union_hook)
    converter.register_structure_hook_factory(
        _is_homogenous_tuple,
        lambda t, c: _checked(homogenous_tuple_structure_factory(t, c), (list, tuple), "a list"),
    )
    converter.register_structure_hook_factory(
        lambda t: is_sequence(t) and typing.get_origin(t) is not tuple and t is not tuple,
        lambda t, c: _checked(list_structure_factory(t, c), (list, tuple), "a list"),
    )
    converter.register_structure_hook_factory(
        is_mapping, lambda t, c: _checked(mapping_structure_factory(t, c), (Mapping,), "a mapping")
    )
    converter.register_structure_hook_factory(
        attrs.has, lambda t, c: _checked(make_dict_structure_fn(t, c), (Mapping,), "a mapping")
    )
    return converter


STRICT = make_strict_converter()
