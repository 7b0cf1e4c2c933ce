"""Typed errors of Omni. Each carries the fix in its message where there is one."""

from __future__ import annotations


class OmniError(Exception):
    """Base class of every error Omni raises on purpose."""


class PluginError(OmniError):
    """A plugin failed to load or registered something invalid."""


class UnknownModelError(OmniError):
    """No installed family matches the model reference."""


class UnknownNameError(OmniError):
    """A registry lookup (runtime kind, connector, resolver, family) found nothing."""


class ConfigError(OmniError):
    """Invalid pipeline or deploy configuration; `key` names the offending key."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


class InvalidRequestError(OmniError):
    """A request was rejected before or during processing because of its input.

    `param` names the offending request field where known (OpenAI error bodies carry it).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StageError(OmniError):
    """A stage failed while working on a request (the request gets this error)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"stage {stage!r} failed: {message}")
        self.stage = stage


class RequestCancelledError(OmniError):
    """The request was cancelled (client gone, `abort()` called or engine shut down)."""


class ConnectorError(OmniError):
    """A connector could not move a payload."""


class ConnectorFullError(ConnectorError):
    """A bounded connector stayed full for longer than the put timeout (backpressure)."""


class ConnectorClosedError(ConnectorError):
    """The connector was closed."""


class MissingDependencyError(OmniError):
    """An optional dependency is missing; the message names the install command."""
