"""`omni_core.media_access`: what a request's media URLs may reach, against a real HTTP server on
127.0.0.1 (allowed and other hosts, size and time limits, redirects) and real files (a symlink and
``..`` out of the allowed directory). The served model sees these through ``omni serve``:
tests/test_vllm_omni_requests.py."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from omni_core.errors import ConfigError, InvalidRequestError
from omni_core.media_access import MediaAccess, as_data_url, read_media_url

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
LIMIT = 64 * 1024
SLOW_S = 3.0


class MediaHandler(BaseHTTPRequestHandler):
    """Serves the test media; records every path it is asked for (`server.seen`)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.seen.append(self.path)  # type: ignore[attr-defined]
        port = self.server.server_address[1]
        if self.path == "/image.png":
            self._send(200, PNG, "image/png")
        elif self.path == "/big":  # declared too large
            self._send(200, b"\0" * (LIMIT + 1), "image/png")
        elif self.path == "/big-undeclared":  # no Content-Length: the limit applies while reading
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(8):
                self.wfile.write(b"\0" * (LIMIT // 4))
        elif self.path == "/slow":
            time.sleep(SLOW_S)
            self._send(200, PNG, "image/png")
        elif self.path == "/redirect-in":
            self._redirect("/image.png")
        elif self.path == "/redirect-out":
            self._redirect(f"http://localhost:{port}/image.png")
        else:
            self._send(404, b"not found", "text/plain")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_media() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), MediaHandler)
    server.daemon_threads = True
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def base(http_media: ThreadingHTTPServer) -> str:
    http_media.seen.clear()  # type: ignore[attr-defined]
    return f"http://127.0.0.1:{http_media.server_address[1]}"


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "image.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside / "secret.png")
    return {"allowed": allowed, "outside": outside}


def web(timeout_s: float = 0.5) -> MediaAccess:
    return MediaAccess.create(allowed_media_domains=["127.0.0.1", "example.invalid"], max_bytes=LIMIT, timeout_s=timeout_s)


def refused(url: str, access: MediaAccess) -> str:
    with pytest.raises(InvalidRequestError) as info:
        read_media_url(url, access, "messages[0].content[0].image_url.url")
    assert info.value.param == "messages[0].content[0].image_url.url"
    return str(info.value)


def test_by_default_only_data_urls(base: str, http_media: ThreadingHTTPServer, files: dict[str, Path]) -> None:
    access = MediaAccess()
    assert "--allowed-media-domains" in refused(f"{base}/image.png", access)
    assert "--allowed-local-media-path" in refused((files["allowed"] / "image.png").as_uri(), access)
    assert "only data: URLs" in refused("/etc/passwd", access)
    assert "only data: URLs" in refused("ftp://127.0.0.1/image.png", access)
    assert http_media.seen == []  # type: ignore[attr-defined]
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert read_media_url(url, access, "x") == ("image/png", PNG)
    assert as_data_url(url, access, "x") == url
    assert "base64" in refused("data:image/png,raw", access)


def test_an_allowed_host_is_fetched_into_a_data_url(base: str, http_media: ThreadingHTTPServer) -> None:
    assert read_media_url(f"{base}/image.png", web(), "x") == ("image/png", PNG)
    assert as_data_url(f"{base}/image.png", web(), "x") == "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert http_media.seen == ["/image.png", "/image.png"]  # type: ignore[attr-defined]


def test_a_host_not_allowed_is_never_contacted(http_media: ThreadingHTTPServer, base: str) -> None:
    port = http_media.server_address[1]
    message = refused(f"http://localhost:{port}/image.png", web())
    assert "'localhost'" in message and "--allowed-media-domains: 127.0.0.1, example.invalid" in message
    # The allowed host as user info: the host is still localhost.
    assert "'localhost'" in refused(f"http://127.0.0.1:{port}@localhost:{port}/image.png", web())
    assert http_media.seen == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", ["/big", "/big-undeclared"])
def test_a_body_over_the_size_limit_is_refused(base: str, path: str) -> None:
    assert f"limited to {LIMIT} bytes" in refused(f"{base}{path}", web())


def test_a_slow_server_is_cut_off_at_the_time_limit(base: str) -> None:
    started = time.monotonic()
    message = refused(f"{base}/slow", web(timeout_s=0.5))
    assert time.monotonic() - started < SLOW_S - 1
    assert "longer than the limit of 0.5 s" in message


def test_redirects_are_followed_only_to_allowed_hosts(base: str, http_media: ThreadingHTTPServer) -> None:
    assert read_media_url(f"{base}/redirect-in", web(), "x") == ("image/png", PNG)
    message = refused(f"{base}/redirect-out", web())
    assert "redirected from" in message and "'localhost'" in message
    assert "/image.png" not in http_media.seen[2:]  # type: ignore[attr-defined]  # the other host was never asked
    assert "HTTP 404" in refused(f"{base}/missing", web())


def test_file_urls_only_under_the_allowed_directory(files: dict[str, Path]) -> None:
    access = MediaAccess.create(allowed_local_media_path=files["allowed"])
    assert read_media_url((files["allowed"] / "image.png").as_uri(), access, "x") == ("image/png", PNG)
    outside = [
        (files["outside"] / "secret.png").as_uri(),
        (files["allowed"] / "link.png").as_uri(),  # a symlink out of the directory
        f"file://{files['allowed']}/../outside/secret.png",  # .. out of the directory
        "file:///etc/passwd",
    ]
    for url in outside:
        message = refused(url, access)
        assert "--allowed-local-media-path" in message and "resolves outside it" in message, message
    assert "no file" in refused((files["allowed"] / "missing.png").as_uri(), access)
    assert "not a usable file path" in refused(f"file://{files['allowed']}/image.png%00.txt", access)
    assert "names no host" in refused(f"file://example.com{files['allowed']}/image.png", access)
    big = MediaAccess.create(allowed_local_media_path=files["allowed"], max_bytes=len(PNG) - 1)
    assert f"limited to {len(PNG) - 1} bytes" in refused((files["allowed"] / "image.png").as_uri(), big)


def test_the_allowed_directory_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--allowed-local-media-path"):
        MediaAccess.create(allowed_local_media_path=tmp_path / "nope")


def test_serve_takes_several_hosts_after_one_flag() -> None:
    """vLLM's spelling (argparse ``nargs="+"``): ``--allowed-media-domains a b``; the flag repeated works too."""
    from omni_cli.commands import serve

    args = ["m", "--allowed-media-domains", "a.example", "b.example", "--port", "1", "--allowed-media-domains", "c.example"]
    context = serve.make_context("serve", args)
    assert context.params["model"] == "m" and context.params["port"] == 1
    assert context.params["allowed_media_domains"] == ("a.example", "b.example", "c.example")
