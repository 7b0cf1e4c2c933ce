"""The plugin manager: loads the ``omni`` entry points and builds what they register.

Each entry point is loaded on its own, so a broken plugin is recorded (see `PluginHost.failures`,
``omni plugins``) and only a command that needs it fails. Registration hooks are called once, plugin
by plugin, so an exception is attributed to the plugin that raised it. After `load_plugins` returns,
a `PluginHost` never changes.

Environment:

- ``OMNI_PLUGINS``: comma-separated entry-point names to load (unset: all; empty: none). The core's
  built-ins are always loaded.
- ``OMNI_TRACE_HOOKS=1``: print every hook call and its result to stderr.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import attrs
import pluggy

from omni_core import builtins, hookspecs
from omni_core.errors import PluginError, UnknownModelError, UnknownNameError
from omni_core.families import PipelineFamily

if TYPE_CHECKING:
    import click

__all__ = [
    "BUILTINS_NAME",
    "ENTRY_POINT_GROUP",
    "PluginHost",
    "default_plugins",
    "load_plugins",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "omni"
BUILTINS_NAME = "omni-core"
ALLOWLIST_ENV = "OMNI_PLUGINS"
TRACE_ENV = "OMNI_TRACE_HOOKS"


@attrs.frozen
class _Registry:
    """A registry that a registration hook fills, and how its names are reported."""

    kind: str  # singular, in messages and `PluginHost.owner`: "stage runtime"
    heading: str  # plural, what ``omni plugins`` lists a plugin's names under: "stage kinds"


_FAMILIES = _Registry("family", "families")
# Registration hooks that take ``register(name, "module:attr")``, and the registry each one fills.
# A new registry of this shape is one line here: loading, conflicts and ``omni plugins`` follow.
_NAMED_REGISTRIES = {
    "register_stage_runtimes": _Registry("stage runtime", "stage kinds"),
    "register_connectors": _Registry("connector", "connectors"),
    "register_quantization_resolvers": _Registry("quantization resolver", "quantization resolvers"),
    "register_placements": _Registry("placement", "placements"),
}
_ROUTES = _Registry("route", "routes")
_COMMANDS_HEADING = "commands"


@attrs.frozen
class _Loaded:
    """Book-keeping for one plugin that was (or was meant to be) registered."""

    name: str
    version: str | None
    plugin: object | None  # None when it never got registered


def _check_ref(kind: str, name: object, ref: object) -> None:
    if not isinstance(name, str) or not name:
        raise PluginError(f"{kind} name must be a non-empty string, got {name!r}")
    if not isinstance(ref, str):
        raise PluginError(f"{kind} {name!r}: expected a lazy 'module:attr' string, got {ref!r}")
    module, sep, attr = ref.partition(":")
    if not (module and sep and attr):
        raise PluginError(f"{kind} {name!r}: invalid reference {ref!r}, expected 'module:attr'")


class _Builder:
    """Collects registrations plugin by plugin; names registered twice become conflicts."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}
        self.owners: dict[tuple[str, str], str] = {}
        self.conflicts: dict[tuple[str, str], tuple[str, ...]] = {}
        self.conflicting_values: dict[tuple[str, str], list[Any]] = {}
        self.routes: list[str] = []
        self.route_owners: dict[str, str] = {}
        # Every name each plugin registered, conflicting ones included: {plugin: {kind: [name]}}.
        self.registered: dict[str, dict[str, list[str]]] = {}

    def note_registered(self, kind: str, name: str, plugin: str) -> None:
        """Remember that ``plugin`` registered ``name`` of ``kind`` (for ``omni plugins``)."""
        names = self.registered.setdefault(plugin, {}).setdefault(kind, [])
        if name not in names:
            names.append(name)

    def add(self, kind: str, name: str, value: Any, plugin: str) -> list[tuple[str, str]]:
        """Record ``value``; return ``(plugin, problem)`` pairs if another plugin has the name."""
        self.note_registered(kind, name, plugin)
        key = (kind, name)
        if key in self.conflicts:
            others = self.conflicts[key]
            self.conflicts[key] = (*others, plugin)
            self.conflicting_values[key].append(value)
            return [(plugin, f"{kind} {name!r} is also registered by {', '.join(others)}")]
        if key in self.owners:
            first = self.owners.pop(key)
            self.conflicting_values[key] = [self.entries[kind].pop(name), value]
            self.conflicts[key] = (first, plugin)
            return [
                (first, f"{kind} {name!r} is also registered by plugin {plugin!r}"),
                (plugin, f"{kind} {name!r} is also registered by plugin {first!r}"),
            ]
        self.owners[key] = plugin
        self.entries.setdefault(kind, {})[name] = value
        return []


class PluginHost:
    """Omni's loaded plugins and everything they registered; immutable after `load_plugins`.

    Names registered by two plugins are left out of the registries (neither silently wins) and the
    lookup methods (`family`, `stage_runtime`, ...) raise a `PluginError` naming both plugins.
    """

    def __init__(
        self,
        pm: pluggy.PluginManager,
        loaded: Sequence[_Loaded],
        failures: Mapping[str, str],
        builder: _Builder,
    ) -> None:
        self.pm = pm
        self._loaded = tuple(loaded)
        self.failures: Mapping[str, str] = types.MappingProxyType(dict(failures))
        self._registries: Mapping[str, Mapping[str, Any]] = types.MappingProxyType(
            {
                registry.kind: types.MappingProxyType(dict(builder.entries.get(registry.kind, {})))
                for registry in (_FAMILIES, *_NAMED_REGISTRIES.values())
            }
        )
        self.families: Mapping[str, PipelineFamily] = self.registry("family")
        self.stage_runtimes: Mapping[str, str] = self.registry("stage runtime")
        self.connectors: Mapping[str, str] = self.registry("connector")
        self.quantization_resolvers: Mapping[str, str] = self.registry("quantization resolver")
        self.placements: Mapping[str, str] = self.registry("placement")
        self.routes: tuple[str, ...] = tuple(builder.routes)
        self._registered = {
            plugin: {kind: tuple(names) for kind, names in kinds.items()}
            for plugin, kinds in builder.registered.items()
        }
        self._owners = dict(builder.owners)
        self._conflicts = dict(builder.conflicts)
        # Families registered twice still match checkpoints, so that the user learns of the clash.
        self._clashing_families: tuple[PipelineFamily, ...] = tuple(
            value
            for (kind, _), values in builder.conflicting_values.items()
            if kind == "family"
            for value in values
        )

    # -- lookups ----------------------------------------------------------------------------------

    def registry(self, kind: str) -> Mapping[str, Any]:
        """The read-only registry of ``kind`` (``"family"``, ``"stage runtime"``, ...): name -> value.

        Names registered by several plugins are left out (see the lookup methods).
        """
        if kind not in self._registries:
            raise UnknownNameError(f"unknown registry {kind!r}; registries: {', '.join(self._registries)}")
        return self._registries[kind]

    def owner(self, kind: str, name: str) -> str | None:
        """The plugin that registered ``name`` of ``kind`` (``"family"``, ``"connector"``, ...)."""
        return self._owners.get((kind, name))

    def family(self, name: str) -> PipelineFamily:
        """The registered family ``name``."""
        return self._lookup("family", name, self.families, "pipeline family", "omni pipelines")

    def stage_runtime(self, kind: str) -> str:
        """The lazy reference of the stage runtime class for ``kind`` (``"ar"``, ...)."""
        return self._lookup("stage runtime", kind, self.stage_runtimes, "stage runtime", "omni stages")

    def connector(self, name: str) -> str:
        """The lazy reference of the connector class ``name``."""
        return self._lookup("connector", name, self.connectors, "connector", "omni plugins")

    def quantization_resolver(self, name: str) -> str:
        """The lazy reference of the quantization resolver ``name``."""
        return self._lookup(
            "quantization resolver", name, self.quantization_resolvers, "quantization", "omni plugins"
        )

    def _lookup(self, kind: str, name: str, table: Mapping[str, Any], what: str, command: str) -> Any:
        if name in table:
            return table[name]
        self._raise_if_conflict(kind, name)
        known = ", ".join(sorted(table)) or "none"
        message = f"unknown {what} {name!r}; installed: {known} (see `{command}`)"
        if self.failures:
            message += f"; plugins that failed to load (see `omni plugins`): {self._failures_text()}"
        raise UnknownNameError(message)

    def _raise_if_conflict(self, kind: str, name: str) -> None:
        plugins = self._conflicts.get((kind, name))
        if plugins:
            raise PluginError(
                f"{kind} {name!r} is registered by several plugins ({', '.join(plugins)}); "
                f"uninstall all but one, or choose with {ALLOWLIST_ENV}=<entry-point names>"
            )

    def _failures_text(self) -> str:
        return "; ".join(f"{name}: {error}" for name, error in self.failures.items())

    # -- choosing a family ------------------------------------------------------------------------

    def family_for(self, model_ref: str, hf_config: Mapping[str, Any] | None) -> PipelineFamily:
        """The family that serves ``model_ref``.

        Asks the `resolve_pipeline` hooks first (first non-None answer wins), then matches registered
        families by ``architectures``, then ``model_type``, then diffusers ``_class_name``.
        """
        config = dict(hf_config or {})
        chosen = self._resolve_by_hook(model_ref, config)
        if chosen is not None:
            return chosen
        architectures = config.get("architectures") or []
        if isinstance(architectures, str):
            architectures = [architectures]
        criteria: list[tuple[str, Iterable[Any], Callable[[PipelineFamily], tuple[str, ...]]]] = [
            ("architectures", architectures, lambda f: f.architectures),
            ("model_type", [config.get("model_type")], lambda f: f.model_types),
            ("_class_name", [config.get("_class_name")], lambda f: f.diffusers_classes),
        ]
        for field, values, matched_by in criteria:
            wanted = {v for v in values if isinstance(v, str) and v}
            if not wanted:
                continue
            candidates = [*self.families.values(), *self._clashing_families]
            matches = [f for f in candidates if wanted & set(matched_by(f))]
            for match in matches:
                self._raise_if_conflict("family", match.name)
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                names = ", ".join(f"{f.name} (plugin {self.owner('family', f.name)})" for f in matches)
                raise PluginError(
                    f"{model_ref!r}: {field} {sorted(wanted)} is claimed by several families: {names}; "
                    f"uninstall all but one, or choose with {ALLOWLIST_ENV}=<entry-point names>"
                )
        raise UnknownModelError(self._unknown_model_message(model_ref, config))

    def _resolve_by_hook(self, model_ref: str, config: dict[str, Any]) -> PipelineFamily | None:
        # Call implementations one by one, in pluggy's own order, so a plugin that raises is named
        # and skipped instead of hiding every other plugin's answer.
        for impl in reversed(self.pm.hook.resolve_pipeline.get_hookimpls()):
            try:
                name = self._call_one("resolve_pipeline", impl.plugin, model_ref=model_ref, hf_config=config)
            except Exception as exc:  # noqa: BLE001 - a plugin bug must not hide the others
                logger.warning("plugin %r failed in resolve_pipeline: %s", impl.plugin_name, _describe(exc))
                continue
            if name is None:
                continue
            if name in self.families:
                return self.families[name]
            self._raise_if_conflict("family", name)
            raise PluginError(
                f"plugin {impl.plugin_name!r} resolved {model_ref!r} to family {name!r}, which is not "
                f"registered (registered: {', '.join(sorted(self.families)) or 'none'}); "
                "the plugin must also register that family in register_pipelines"
            )
        return None

    def _unknown_model_message(self, model_ref: str, config: Mapping[str, Any]) -> str:
        seen = []
        for key in ("architectures", "model_type", "_class_name"):
            if config.get(key):
                seen.append(f"{key} {config[key]!r}")
        described = ", ".join(seen) if seen else "no architectures, model_type or _class_name"
        if self.families:
            installed = "; ".join(
                f"{f.name} ({_matches_text(f)})" for f in sorted(self.families.values(), key=lambda f: f.name)
            )
        else:
            installed = "none"
        message = (
            f"no installed pipeline family serves {model_ref!r} ({described}). "
            f"Installed families: {installed}. "
            "Install the plugin for this model family (e.g. `pip install omni-<family>`); "
            "see `omni pipelines` for what is installed"
        )
        if self.failures:
            message += (
                f". Some plugins failed to load and might be the one for this model (see `omni plugins`): "
                f"{self._failures_text()}"
            )
        return message

    # -- reporting --------------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """One entry per plugin: ``name``, ``version``, ``hooks`` (sorted), ``registered`` and ``error``.

        ``registered`` maps a heading (``"families"``, ``"stage kinds"``, ``"connectors"``,
        ``"quantization resolvers"``, ``"routes"``, ``"commands"``) to the sorted names the plugin
        registered under it; headings it registered nothing under are left out. Names another
        plugin also registered are listed for both (``error`` tells of the conflict); a hook that
        raised registered nothing. ``error`` is None for a plugin that loaded cleanly.
        """
        commands = self.command_names()
        rows = []
        for loaded in self._loaded:
            hooks: list[str] = []
            if loaded.plugin is not None:
                callers = self.pm.get_hookcallers(loaded.plugin) or []
                hooks = sorted(caller.name for caller in callers)
            registered = self.registered_by(loaded.name)
            if loaded.name in commands:
                registered[_COMMANDS_HEADING] = commands[loaded.name]
            rows.append(
                {
                    "name": loaded.name,
                    "version": loaded.version,
                    "hooks": hooks,
                    "registered": registered,
                    "error": self.failures.get(loaded.name),
                }
            )
        return rows

    def registered_by(self, plugin: str) -> dict[str, list[str]]:
        """The names ``plugin`` registered through the registration hooks, by heading (`describe`).

        Commands are not included: they are added to a click group later (see `command_names`).
        """
        own = self._registered.get(plugin, {})
        registries = (_FAMILIES, *_NAMED_REGISTRIES.values(), _ROUTES)
        return {r.heading: sorted(own[r.kind]) for r in registries if own.get(r.kind)}

    def command_names(self) -> dict[str, list[str]]:
        """The command names each plugin adds through ``register_commands``: ``{plugin: sorted names}``.

        Each plugin's hook runs on a scratch group of its own, so the names are attributed to it
        (the CLI's group mixes every plugin's). A plugin whose hook raises is left out here:
        `register_commands` reports it where the CLI is built.
        """
        import click  # only reporting needs it; loading plugins (the server, tests) does not

        names: dict[str, list[str]] = {}
        for impl in self.pm.hook.register_commands.get_hookimpls():
            group = click.Group()
            try:
                self._call_one("register_commands", impl.plugin, cli=group)
            except Exception:  # noqa: BLE001 - reported by register_commands, not here
                continue
            if group.commands:
                names[impl.plugin_name] = sorted(group.commands)
        return names

    # -- hooks called later -----------------------------------------------------------------------

    def register_commands(self, cli: click.Group) -> dict[str, str]:
        """Let every plugin add commands to ``cli``; return ``{plugin: error}`` for those that raised."""
        errors: dict[str, str] = {}
        for impl in self.pm.hook.register_commands.get_hookimpls():
            try:
                self._call_one("register_commands", impl.plugin, cli=cli)
            except Exception as exc:  # noqa: BLE001 - one plugin's bug must not remove the CLI
                errors[impl.plugin_name] = _describe(exc)
        return errors

    def _call_one(self, hook_name: str, plugin: object, **kwargs: Any) -> Any:
        # A subset caller keeps pluggy's argument handling and tracing for a single plugin.
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        return self.pm.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)


def _matches_text(family: PipelineFamily) -> str:
    parts = []
    if family.architectures:
        parts.append("architectures " + ", ".join(family.architectures))
    if family.model_types:
        parts.append("model types " + ", ".join(family.model_types))
    if family.diffusers_classes:
        parts.append("diffusers " + ", ".join(family.diffusers_classes))
    return "; ".join(parts) if parts else "matches through resolve_pipeline only"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _allowlist_from_env() -> set[str] | None:
    value = os.environ.get(ALLOWLIST_ENV)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def _dist_version(entry_point: Any) -> str | None:
    dist = getattr(entry_point, "dist", None)
    return getattr(dist, "version", None) if dist is not None else None


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    if os.environ.get(TRACE_ENV, "").strip() not in ("", "0"):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    return pm


def load_plugins(
    allowlist: Iterable[str] | None = None,
    entry_points: Iterable[Any] | None = None,
    extra_plugins: Iterable[object] = (),
) -> PluginHost:
    """Load the built-ins, the ``omni`` entry points and `extra_plugins`, and build their registries.

    :param allowlist: entry-point names to load; None reads ``OMNI_PLUGINS`` (unset: all).
    :param entry_points: entry points to use instead of the installed ``omni`` group (tests).
    :param extra_plugins: plugin objects registered after the entry points, regardless of the
        allowlist (tests, embedding applications).
    """
    pm = _new_manager()
    loaded: list[_Loaded] = []
    failures: dict[str, str] = {}

    from omni_core import __version__

    pm.register(builtins, name=BUILTINS_NAME)
    loaded.append(_Loaded(BUILTINS_NAME, __version__, builtins))

    allowed = set(allowlist) if allowlist is not None else _allowlist_from_env()
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen: set[str] = set()
    for ep in entry_points:
        if allowed is not None and ep.name not in allowed:
            continue
        if ep.name in seen:
            # The same distribution visible twice on sys.path yields the entry point twice.
            continue
        seen.add(ep.name)
        version = _dist_version(ep)
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # noqa: BLE001 - isolate each plugin; the rest must still load
            failures[ep.name] = _describe(exc)
            loaded.append(_Loaded(ep.name, version, None))
            logger.warning("omni plugin %r failed to load: %s", ep.name, failures[ep.name])
            continue
        loaded.append(_Loaded(ep.name, version, plugin))
    for name in sorted((allowed or set()) - seen):
        failures[name] = f"listed in {ALLOWLIST_ENV} but no '{ENTRY_POINT_GROUP}' entry point has this name"
        logger.warning("omni plugin %r: %s", name, failures[name])
        loaded.append(_Loaded(name, None, None))

    for plugin in extra_plugins:
        name = getattr(plugin, "__name__", None) or pm.get_canonical_name(plugin)
        try:
            pm.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001
            failures[name] = _describe(exc)
            loaded.append(_Loaded(name, None, None))
            continue
        loaded.append(_Loaded(name, None, plugin))

    _drop_unknown_hooks(pm, loaded, failures)
    builder = _run_registration_hooks(pm, failures)
    return PluginHost(pm, loaded, failures, builder)


def _drop_unknown_hooks(pm: pluggy.PluginManager, loaded: list[_Loaded], failures: dict[str, str]) -> None:
    """Unregister each plugin that implements a hook no spec declares (usually a typo)."""
    while True:
        try:
            pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            name = pm.get_name(exc.plugin) or repr(exc.plugin)
            if name == BUILTINS_NAME:
                raise
            pm.unregister(exc.plugin)
            failures[name] = f"{exc} (misspelled hook name? see omni_core.hookspecs)"
            logger.warning("omni plugin %r disabled: %s", name, failures[name])
            for i, item in enumerate(loaded):
                if item.name == name:
                    loaded[i] = attrs.evolve(item, plugin=None)


def _run_registration_hooks(pm: pluggy.PluginManager, failures: dict[str, str]) -> _Builder:
    builder = _Builder()

    def note(plugin_name: str, problem: str) -> None:
        failures[plugin_name] = f"{failures[plugin_name]}; {problem}" if plugin_name in failures else problem
        logger.warning("omni plugin %r: %s", plugin_name, problem)

    MakeRegister = Callable[[list[tuple[Any, ...]]], Callable[..., None]]

    def run(hook_name: str, make_register: MakeRegister) -> list[tuple[str, list[tuple[Any, ...]]]]:
        # Each plugin's registrations are kept only if its hook implementation returns normally.
        results = []
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            collected: list[tuple[Any, ...]] = []
            others = [p for p in pm.get_plugins() if p is not impl.plugin]
            try:
                pm.subset_hook_caller(hook_name, remove_plugins=others)(register=make_register(collected))
            except Exception as exc:  # noqa: BLE001 - attribute the failure to this plugin only
                note(impl.plugin_name, f"{hook_name} failed: {_describe(exc)}")
                continue
            results.append((impl.plugin_name, collected))
        return results

    def family_register(collected: list[tuple[Any, ...]]) -> Callable[..., None]:
        def register(family: PipelineFamily) -> None:
            if not isinstance(family, PipelineFamily):
                raise PluginError(f"register_pipelines expects a PipelineFamily, got {family!r}")
            _check_ref("family", family.name, family.pipeline)
            if family.make_tiny is not None:
                _check_ref("family make_tiny", family.name, family.make_tiny)
            collected.append((family.name, family))

        return register

    for plugin_name, items in run("register_pipelines", family_register):
        for name, family in items:
            for culprit, problem in builder.add(_FAMILIES.kind, name, family, plugin_name):
                note(culprit, problem)

    for hook_name, registry in _NAMED_REGISTRIES.items():
        kind = registry.kind

        def named_register(collected: list[tuple[Any, ...]], kind: str = kind) -> Callable[..., None]:
            def register(name: str, ref: str) -> None:
                _check_ref(kind, name, ref)
                collected.append((name, ref))

            return register

        for plugin_name, items in run(hook_name, named_register):
            for name, ref in items:
                for culprit, problem in builder.add(kind, name, ref, plugin_name):
                    note(culprit, problem)

    def route_register(collected: list[tuple[Any, ...]]) -> Callable[..., None]:
        def register(ref: str) -> None:
            _check_ref("route", ref, ref)
            collected.append((ref,))

        return register

    for plugin_name, items in run("register_routes", route_register):
        for (ref,) in items:
            builder.note_registered(_ROUTES.kind, ref, plugin_name)
            if ref not in builder.route_owners:
                builder.route_owners[ref] = plugin_name
                builder.routes.append(ref)
    return builder


@functools.cache
def default_plugins() -> PluginHost:
    """The process's plugins, loaded on first use from the installed entry points.

    Cached rather than a registry: the host is immutable once loaded, so sharing it is safe, and
    loading once keeps plugin imports (and their failure warnings) to one per process. Tests and
    embedding applications that need other plugins call `load_plugins` directly.
    """
    return load_plugins()
