"""Lazy ``"module:attr"`` references: discovery records names, use imports them."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from omni_core.errors import PluginError


def load_ref(ref: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise PluginError(f"invalid reference {ref!r}: expected 'module:attribute'")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"invalid reference {ref!r}: {module_name} has no {attr_path}") from None
    return obj


def accepted_keywords(factory: Callable[..., Any]) -> list[str] | None:
    """The keyword arguments ``factory(**options)`` takes; None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
