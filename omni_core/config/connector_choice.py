"""Which connector each edge of a resolved pipeline uses, and the output connector.

Part of `resolve` (`omni_core.config.resolve`): a connector the user names is checked (its reach:
host-local ones only between stages on one host; its options); a family default that is host-local
yields to a cross-host connector when the user's placements put an edge's ends apart. "Same host"
comes from the placements (`Replica.host`), never from a hostname or an address.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omni_core.config.deploy import ENGINE_HOST, DeployConfig, EdgeDeploy, StageDeploy
from omni_core.config.overrides import unknown_name_message
from omni_core.config.pipeline import PipelineConfig
from omni_core.config.resolved import ResolvedEdge
from omni_core.errors import ConfigError
from omni_core.refs import accepted_keywords, load_ref

if TYPE_CHECKING:
    from omni_core.plugins import PluginHost


def resolve_edge(
    source: str,
    target: str,
    adapter: str | None,
    config: DeployConfig,
    user_raw: Mapping[str, Any],
    raw: Mapping[str, Any],
    stage_deploys: Mapping[str, StageDeploy],
    plugins: PluginHost,
) -> ResolvedEdge:
    key = f"{source}->{target}"
    edge = config.edges.get(key, EdgeDeploy())
    inline = [stage_deploys[source].placement == "inline", stage_deploys[target].placement == "inline"]
    hosts = {_host(stage_deploys[source], plugins), _host(stage_deploys[target], plugins)}
    apart = None in hosts or len(hosts) > 1
    where = f"edges.{key}.connector"
    if _chosen(edge.connector, "connector", ((user_raw.get("edges") or {}).get(key) or {}), ((raw.get("edges") or {}).get(key) or {}), apart, plugins):
        name = edge.connector
    else:
        name = _cross_host_connector(plugins, f"edge {key}", where) if apart else ("inproc" if all(inline) else "shm")
    ref = _connector_ref(name, all(inline), where, plugins)
    if apart:
        _check_reach(name, ref, f"edge {key}: stages {source!r} and {target!r} may run on different hosts", where, plugins)
    _check_connector_options(name, ref, edge.options, f"edges.{key}.options")
    return ResolvedEdge(
        source=source,
        target=target,
        adapter=adapter,
        connector=name,
        connector_ref=ref,
        connector_options=dict(edge.options),
    )


def _chosen(name: str, field: str, user: Mapping[str, Any], merged: Mapping[str, Any], apart: bool, plugins: PluginHost) -> bool:
    """Whether the connector `name` the deploy names stands: the user's choice always does (and
    is refused if it cannot reach); the family default deploy's (written for one host) yields to
    the cross-host default when the user's placements put the ends apart."""
    if field in user:
        return True
    if field not in merged:
        return False
    if not apart or name not in plugins.connectors:  # (an unknown name is reported by the caller)
        return True
    return not getattr(load_ref(plugins.connectors[name]), "host_local", True)


def _host(deploy: StageDeploy, plugins: PluginHost) -> str | None:
    """Where a stage deployed so runs (`Replica.host` of its placement)."""
    return load_ref(plugins.placements[deploy.placement]).host(deploy)


_CROSS_HOST_INSTALL = "pip install omni-connectors-mooncake"


def _cross_host_connectors(plugins: PluginHost) -> list[str]:
    """Registered connectors that reach across hosts (not `Connector.host_local`), Mooncake's
    store first: the default where two ends may be on different hosts."""
    names = [name for name, ref in sorted(plugins.connectors.items()) if not getattr(load_ref(ref), "host_local", True)]
    return sorted(names, key=lambda name: name != "mooncake-store")


def _cross_host_connector(plugins: PluginHost, what: str, key: str) -> str:
    candidates = _cross_host_connectors(plugins)
    if not candidates:
        raise ConfigError(
            f"{what}: its ends may run on different hosts and no installed connector reaches across hosts: {_CROSS_HOST_INSTALL}",
            key=key,
        )
    return candidates[0]


def _check_reach(name: str, ref: str, why: str, key: str, plugins: PluginHost) -> None:
    if not getattr(load_ref(ref), "host_local", True):
        return
    others = _cross_host_connectors(plugins)
    fix = f"use {', '.join(others)}" if others else f"install one that reaches across hosts: {_CROSS_HOST_INSTALL}"
    raise ConfigError(f"{why}, but connector {name!r} works within one host: {fix}", key=key)


def resolve_output_connector(
    pipeline: PipelineConfig,
    config: DeployConfig,
    user_raw: Mapping[str, Any],
    raw: Mapping[str, Any],
    stage_deploys: Mapping[str, StageDeploy],
    plugins: PluginHost,
) -> tuple[str, str, dict[str, Any]]:
    # The same connector carries request input into entry stages and user-facing outputs back
    # from any stage, so it can only be in-process when every stage is.
    all_inline = all(stage_deploys[spec.name].placement == "inline" for spec in pipeline.stages)
    # It links the engine with every stage: a stage off the engine's host needs a network connector.
    apart = any(_host(stage_deploys[spec.name], plugins) != ENGINE_HOST for spec in pipeline.stages)
    key = "output_connector.connector"
    if _chosen(config.output_connector.connector, "connector", user_raw.get("output_connector") or {}, raw.get("output_connector") or {}, apart, plugins):
        name = config.output_connector.connector
    else:
        name = _cross_host_connector(plugins, "output_connector", key) if apart else ("inproc" if all_inline else "shm")
    ref = _connector_ref(name, all_inline, key, plugins)
    if apart:
        _check_reach(name, ref, "output_connector: a stage may run on another host than the engine", key, plugins)
    _check_connector_options(name, ref, config.output_connector.options, "output_connector.options")
    return name, ref, dict(config.output_connector.options)


def _check_connector_options(name: str, ref: str, options: Mapping[str, Any], key: str) -> None:
    """Reject options the connector's constructor does not take (it is built as
    ``Class(**options)`` in every stage process: better now, naming the key, than there)."""
    known = accepted_keywords(load_ref(ref))
    for option in options if known is not None else ():
        if option not in known:
            raise ConfigError(unknown_name_message(f"option of connector {name!r}", option, known), key=f"{key}.{option}")


def _connector_ref(name: str, all_inline: bool, key: str, plugins: PluginHost) -> str:
    if name not in plugins.connectors:
        raise ConfigError(
            unknown_name_message("connector", name, plugins.connectors)
            + " (install the plugin that provides it)",
            key=key,
        )
    if name == "inproc" and not all_inline:
        raise ConfigError(
            "the inproc connector only links stages of one process: place both ends inline "
            "(placement: inline) or use shm",
            key=key,
        )
    return plugins.connectors[name]
