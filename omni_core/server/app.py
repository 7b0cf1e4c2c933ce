"""The Litestar app factory `create_app(engine)` and `run_server` behind ``omni serve``."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from litestar import Litestar, Request
from litestar.di import Provide
from litestar.exceptions import NotAuthorizedException
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp, Receive, Scope, Send

from omni_core import __version__
from omni_core.engine.async_engine import AsyncOmniEngine
from omni_core.errors import OmniError
from omni_core.media_access import MediaAccess
from omni_core.server.bodies import JSONRequest, check_body
from omni_core.server.errors import handle_exception
from omni_core.server.metrics import ServerMetrics
from omni_core.server.requests import max_prompt_chars as default_max_prompt_chars
from omni_core.server.routes import ROUTES
from omni_core.server.state import ServerState

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


def _route_label(scope: Scope) -> str:
    """The matched route's path template (bounded label values), not the raw path."""
    return str(scope.get("path_template") or "unmatched")


def _metrics_middleware(app: ASGIApp) -> ASGIApp:
    """Count finished HTTP requests by route and status."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_wrapper)
        finally:
            server: ServerState | None = getattr(scope["app"].state, "server", None)
            if server is not None:
                server.metrics.requests.labels(route=_route_label(scope), status=str(status["code"])).inc()

    return middleware


async def _check_api_key(request: Request) -> None:
    server: ServerState = request.app.state.server
    if server.api_key is None or not request.url.path.startswith("/v1"):
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), server.api_key.encode()):
        raise NotAuthorizedException("missing or invalid API key: send 'Authorization: Bearer <key>'")


async def _before_request(request: Request) -> None:
    """The API key first (a client without one learns nothing about the routes' bodies), then the body."""
    await _check_api_key(request)
    await check_body(request)


def create_app(
    engine: AsyncOmniEngine,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    extra_routes: Sequence[Any] = (),
    url: str | None = None,
    media: MediaAccess | None = None,
    max_prompt_chars: int | None = None,
) -> Litestar:
    """Build the OpenAI-compatible app; the engine starts in its lifespan and stops on shutdown.

    `media`: what media URLs in requests may reach (default: base64 ``data:`` URLs only);
    `max_prompt_chars`: the longest prompt text, checked before tokenizing (default: from the
    first AR stage's context, `omni_core.server.requests.max_prompt_chars`)."""
    name = model_name or engine.pipeline.model
    server = ServerState(
        engine=engine, model_name=name, metrics=ServerMetrics(name, lambda: engine.num_active_requests), api_key=api_key,
        media=media or MediaAccess(),
        max_prompt_chars=max_prompt_chars if max_prompt_chars is not None else default_max_prompt_chars(engine.pipeline),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await engine.start()
        logger.info("ready: serving %s%s", name, f" at {url}/v1" if url else "")
        try:
            yield
        finally:
            server.videos.shutdown()
            await engine.shutdown()

    app = Litestar(
        route_handlers=[*ROUTES, *extra_routes],
        lifespan=[lifespan],
        before_request=_before_request,
        request_class=JSONRequest,
        exception_handlers={Exception: handle_exception},
        middleware=[_metrics_middleware],
        request_max_body_size=max_body_bytes,
        openapi_config=OpenAPIConfig(title="Omni", version=__version__, description=f"OpenAI-compatible API serving {name}"),
        logging_config=None,
        # What a handler (ours or a plugin's, `register_routes`) may declare by parameter name.
        dependencies={
            "server": Provide(lambda: server, use_cache=True, sync_to_thread=False),
            "engine": Provide(lambda: engine, use_cache=True, sync_to_thread=False),
        },
    )
    app.state.server = server  # for the API-key check and the metrics middleware (no DI there)
    return app


def plugin_routes(plugins: Any) -> list[Any]:
    """Route handlers registered by plugins (``register_routes`` hook)."""
    from omni_core.refs import load_ref

    return [load_ref(ref) for ref in getattr(plugins, "routes", ())]


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet), taken before the pipeline loads: a
    port in use fails at once instead of after minutes of loading, and nothing else can take the
    port meanwhile (vLLM's ``serve`` does the same). Port 0 takes a free one."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OmniError(f"cannot serve on host {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = "the address is already in use (another server? pick another --port)" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise OmniError(f"cannot serve on {host}:{port}: {why}") from None
    sock.set_inheritable(False)
    return sock


def run_server(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8091,
    api_key: str | None = None,
    deploy: str | Path | None = None,
    overrides: Sequence[str] = (),
    plugins: Any = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    media: MediaAccess | None = None,
    max_prompt_chars: int | None = None,
) -> None:
    """Resolve `model`, build the app and serve it with uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    from omni_core.config import resolve
    from omni_core.plugins import default_plugins

    sock = bind_socket(host, port)
    port = sock.getsockname()[1]
    host_plugins = plugins if plugins is not None else default_plugins()
    engine = AsyncOmniEngine(resolve(model, deploy=deploy, overrides=overrides, plugins=host_plugins))
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    app = create_app(
        engine, model_name=model, api_key=api_key, max_body_bytes=max_body_bytes, extra_routes=plugin_routes(host_plugins), url=url,
        media=media, max_prompt_chars=max_prompt_chars,
    )

    class Server(uvicorn.Server):
        """uvicorn's server, after the pipeline has loaded (`load_interruptibly`: the app's lifespan
        then finds the engine started)."""

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            await load_interruptibly(engine)
            try:
                await super().serve(sockets)
            finally:
                await engine.shutdown()  # (done by the app's lifespan, unless a signal came before it ran)

    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=10)
    with sock:
        try:
            Server(config).run(sockets=[sock])
        except KeyboardInterrupt:
            pass  # the server re-raises the Ctrl-C it shut down on (as `uvicorn.run` does, this ends quietly)


async def load_interruptibly(engine: AsyncOmniEngine) -> None:
    """Start `engine` (load every stage) so that Ctrl-C or SIGTERM stops the load at once.

    uvicorn, which takes the signals once it serves, only notes one that comes during its startup
    and acts after it: a pipeline that loads for minutes would ignore Ctrl-C that long. Here the
    signal cancels the load, the engine stops the stages it started, and the signal is raised again
    as uvicorn does after its shutdown (Ctrl-C: a quiet exit; SIGTERM: the default action)."""
    if threading.current_thread() is not threading.main_thread():
        await engine.start()  # (signals reach only the main thread's loop)
        return
    loop, loading = asyncio.get_running_loop(), asyncio.current_task()
    assert loading is not None
    received: list[signal.Signals] = []

    def interrupt(sig: signal.Signals) -> None:
        if not received:
            logger.info("%s while loading: stopping the stages", sig.name)
            loading.cancel()
        received.append(sig)

    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, interrupt, sig)
    try:
        await engine.start()
    except asyncio.CancelledError:
        if not received:
            raise
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)  # (back to Python's defaults, which uvicorn's serve replaces)
    if received:
        signal.raise_signal(received[0])
