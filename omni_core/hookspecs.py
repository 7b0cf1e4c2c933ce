"""Omni's hook specifications (pluggy project ``omni``).

Plugins implement these with `omni_core.hookimpl` in their ``plugin`` module, declared under the
``omni`` entry-point group. Registration hooks receive a `register` callable and register *lazy*
``"module:attr"`` references, so discovery imports nothing heavy. Implementations may accept fewer
arguments than a spec; specs only ever grow by new arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    import click

    from omni_core.families import PipelineFamily

hookspec = pluggy.HookspecMarker("omni")
hookimpl = pluggy.HookimplMarker("omni")


# -- what a pipeline is made of -------------------------------------------------------------------


@hookspec
def register_pipelines(register: Callable[[PipelineFamily], None]) -> None:
    """Register model families: ``register(PipelineFamily(name=..., pipeline="pkg.mod:build", ...))``.

    :param register: call once per family; names must be unique across plugins.
    """


@hookspec
def register_stage_runtimes(register: Callable[[str, str], None]) -> None:
    """Register stage runtime kinds: ``register("ar", "pkg.mod:ARStageRuntime")``.

    The class subclasses `omni_core.stages.base.StageRuntime`; its `Options` attrs class types the
    kind's deploy options, each documented with ``attrs.field(..., metadata={"doc": "..."})``
    (``omni stages`` prints them). The kind's model parts subclass a base class of its own, built
    by `StageRuntime.build_model_part` as every part is (`omni_core.parts`).
    """


@hookspec
def register_connectors(register: Callable[[str, str], None]) -> None:
    """Register connectors: ``register("shm", "pkg.mod:SharedMemoryConnector")``.

    The class subclasses `omni_core.connectors.base.Connector` and passes
    `omni_core.testing.connector_contract`.
    """


@hookspec
def register_placements(register: Callable[[str, str], None]) -> None:
    """Register placements (where a stage's replicas run): ``register("ray", "pkg.mod:RayReplica")``.

    The class subclasses `omni_core.runtime.placement.Replica`: built with one `ReplicaContext`,
    it starts the stage worker wherever it places it, carries messages both ways, reports its
    death, and stops. The core's ``inline`` and ``process`` are registrations of this hook.
    """


@hookspec
def register_quantization_resolvers(register: Callable[[str, str], None]) -> None:
    """Register quantization resolvers: ``register("int8", "pkg.mod:resolve_int8")``.

    A resolver is ``(kind: str, options: dict) -> dict``: it maps a stage's ``quantization`` option
    to what that stage's runtime applies (vLLM quantization arguments for ``ar``; a linear-layer
    swap spec for ``diffusion``). It raises `ConfigError` for kinds it does not support.
    """


# -- decisions ------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def resolve_pipeline(model_ref: str, hf_config: dict[str, Any]) -> str | None:
    """Pick the family name for a checkpoint, or ``None`` to let other plugins decide.

    Stops at the first non-None result. `hf_config` is the checkpoint's ``config.json`` (or
    diffusers ``model_index.json``). The core's default matches registered families by
    ``architectures``, ``model_type`` and diffusers ``_class_name``; implement this only for
    matching that needs more.
    """


# -- entry points ---------------------------------------------------------------------------------


@hookspec
def register_commands(cli: click.Group) -> None:
    """Add subcommands to the ``omni`` CLI group."""


@hookspec
def register_routes(register: Callable[[str], None]) -> None:
    """Register extra server routes: ``register("pkg.mod:handler_or_controller")`` (Litestar).

    A handler declares what it needs by parameter name, marked ``litestar.di.NamedDependency[...]``
    (Litestar's dependency injection; unmarked, it is inferred with a deprecation warning, and not
    at all from Litestar 3): ``engine`` (`omni_core.engine.async_engine.AsyncOmniEngine`: ``await
    engine.generate(request)``, ``engine.pipeline``) and ``server``
    (`omni_core.server.state.ServerState`: the served model name, metrics, video jobs), e.g.::

        @litestar.get("/v1/my-family/info")
        async def info(engine: NamedDependency[AsyncOmniEngine]) -> dict[str, str]:
            return {"family": engine.pipeline.family}

    Errors raised as `omni_core.errors.InvalidRequestError` become OpenAI-style 400 bodies, as in
    the core's routes; a route under ``/v1`` needs the API key when the server has one.
    """
