"""What a request's media URLs may reach, and reading them: the one rule every entry point applies.

A client's media come as base64 ``data:`` URLs. The operator may also let requests name local files
and web resources, with vLLM's own flags (``omni serve --allowed-local-media-path DIR``,
``--allowed-media-domains HOST [HOST ...]``), which make a `MediaAccess`:

- ``file://`` URLs are read only when the path, symlinks and ``..`` resolved, is a file under DIR;
- ``http(s)://`` URLs are fetched only from the listed hosts (exact host names), with a size and a
  time limit, and a redirect is followed only to a listed host;
- anything else is refused.

`read_media_url` returns the media type and the bytes; `as_data_url` turns any accepted URL into
the base64 ``data:`` URL the input processors of every family read, so a fetched image is, from
there on, the same data as an inline one. Every refusal is an `InvalidRequestError` naming the
rule (a 400 on the server). Reading is blocking I/O: callers on an event loop run it in a thread.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
import re
import time
from pathlib import Path
from typing import Iterable
from urllib.parse import unquote, urljoin, urlsplit

import attrs

from omni_core.errors import ConfigError, InvalidRequestError

DEFAULT_MAX_MEDIA_BYTES = 32 * 1024 * 1024
DEFAULT_FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 5
_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*")


@attrs.frozen
class MediaAccess:
    """What media URLs may reach: by default base64 ``data:`` URLs only.

    - `local_path`: ``file://`` URLs under this directory (resolved) are read (``None``: none).
    - `domains`: ``http(s)://`` URLs on these hosts are fetched (empty: none).
    - `max_bytes`, `timeout_s`: the size and time limit of one fetched or read medium.
    """

    local_path: Path | None = None
    domains: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    @classmethod
    def create(
        cls,
        allowed_local_media_path: str | Path | None = None,
        allowed_media_domains: Iterable[str] = (),
        max_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
        timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
    ) -> "MediaAccess":
        """From the operator's settings (vLLM's flag names); a directory that does not exist is a
        `ConfigError`."""
        local = None
        if allowed_local_media_path:
            local = Path(allowed_local_media_path).expanduser().resolve()
            if not local.is_dir():
                raise ConfigError(f"{allowed_local_media_path} is not a directory", key="--allowed-local-media-path")
        domains = tuple(d.strip().lower() for d in allowed_media_domains if d.strip())
        if max_bytes < 1 or timeout_s <= 0:
            raise ConfigError("the media size and time limits must be positive")
        return cls(local, domains, max_bytes, timeout_s)


def as_data_url(url: str, access: MediaAccess, where: str) -> str:
    """`url` as a base64 ``data:`` URL: a data URL is checked and kept, an allowed ``file://`` or
    ``http(s)://`` URL is read (`read_media_url`) and inlined."""
    if url[:5].lower() == "data:":
        _check_data_header(url, where)  # decoding is the input processor's (once)
        return url
    media_type, raw = read_media_url(url, access, where)
    if not _MEDIA_TYPE.fullmatch(media_type):  # a server's Content-Type goes into the URL's header
        media_type = "application/octet-stream"
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


def read_media_url(url: str, access: MediaAccess, where: str) -> tuple[str, bytes]:
    """(media type, bytes) of a media URL, under the rule of `access` (see the module docstring)."""
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
        return data_url_bytes(url, where)
    if scheme == "file":
        return _read_file(url, access, where)
    if scheme in ("http", "https"):
        return _fetch(url, access, where)
    raise InvalidRequestError(
        f"{where}: only data: URLs are accepted (base64 data URLs: data:<mime type>;base64,<data>){_allowed_too(access)}; got {_shown(url)}",
        param=where,
    )


def data_url_bytes(url: str, where: str) -> tuple[str, bytes]:
    """(media type, decoded bytes) of a base64 ``data:`` URL; else an `InvalidRequestError`."""
    if url[:5].lower() != "data:":
        raise InvalidRequestError(f"{where}: expected a data: URL (data:<mime type>;base64,<data>), got {_shown(url)}", param=where)
    header, payload = _check_data_header(url, where)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"{where}: invalid base64 data ({exc})", param=where) from None
    return header[5:-7].split(";")[0].strip().lower() or "application/octet-stream", raw


def _check_data_header(url: str, where: str) -> tuple[str, str]:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise InvalidRequestError(f"{where}: data: URLs must be base64 encoded (data:<mime type>;base64,<data>)", param=where)
    return header, payload


def _allowed_too(access: MediaAccess) -> str:
    allowed = []
    if access.local_path is not None:
        allowed.append(f"file:// URLs under {access.local_path}")
    if access.domains:
        allowed.append(f"http(s):// URLs on {', '.join(access.domains)}")
    return f", and {' and '.join(allowed)}" if allowed else ""


def _shown(url: str) -> str:
    return repr(url if len(url) <= 80 else f"{url[:77]}...")


def _read_file(url: str, access: MediaAccess, where: str) -> tuple[str, bytes]:
    if access.local_path is None:
        raise InvalidRequestError(
            f"{where}: only data: URLs are accepted (base64 data URLs){_allowed_too(access)}: this server reads no local file for a request "
            "(its operator may allow a directory with --allowed-local-media-path DIR)",
            param=where,
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequestError(f"{where}: a file:// URL names no host (file:///path), got host {parts.netloc!r}", param=where)
    # Resolved first (symlinks, ``..``), checked second: a link inside DIR to a file outside it is outside.
    try:
        path = Path(unquote(parts.path)).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a symlink loop ...
        raise InvalidRequestError(f"{where}: not a usable file path ({exc})", param=where) from None
    if not path.is_relative_to(access.local_path):
        raise InvalidRequestError(
            f"{where}: only data: URLs are accepted (base64 data URLs), and file:// URLs of files under "
            f"--allowed-local-media-path {access.local_path}; {_shown(url)} resolves outside it",
            param=where,
        )
    try:
        if not path.is_file():
            raise InvalidRequestError(f"{where}: no file at {_shown(url)} under {access.local_path}", param=where)
        size = path.stat().st_size
        if size > access.max_bytes:
            raise InvalidRequestError(f"{where}: the file is {size} bytes; media are limited to {access.max_bytes} bytes", param=where)
        with path.open("rb") as file:
            raw = file.read(access.max_bytes + 1)
    except OSError as exc:
        raise InvalidRequestError(f"{where}: cannot read {_shown(url)} ({exc.strerror})", param=where) from None
    if len(raw) > access.max_bytes:
        raise InvalidRequestError(f"{where}: the file is over the limit of {access.max_bytes} bytes for media", param=where)
    return mimetypes.guess_type(path.name)[0] or "application/octet-stream", raw


def _check_host(url: str, access: MediaAccess, where: str, what: str = "") -> None:
    import httpx

    # Parsed by the client that fetches it: no second parser to disagree on which host a URL names.
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise InvalidRequestError(f"{where}: invalid URL {_shown(url)}{what} ({exc})", param=where) from None
    if parsed.scheme not in ("http", "https"):
        raise InvalidRequestError(f"{where}: {_shown(url)}{what} is not an http(s):// URL", param=where)
    host = parsed.host.lower()
    if not access.domains or host not in access.domains:
        allowed = f"this server fetches only from the hosts of --allowed-media-domains: {', '.join(access.domains)}" if access.domains else (
            "this server fetches no URL for a request (its operator may allow hosts with --allowed-media-domains HOST ...)"
        )
        raise InvalidRequestError(
            f"{where}: only data: URLs are accepted (base64 data URLs){_allowed_too(access)}; {_shown(url)}{what} is on host {host!r}: {allowed}",
            param=where,
        )


def _fetch(url: str, access: MediaAccess, where: str) -> tuple[str, bytes]:
    import httpx

    _check_host(url, access, where)
    deadline = time.monotonic() + access.timeout_s
    try:
        with httpx.Client(follow_redirects=False, timeout=access.timeout_s, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        target = urljoin(url, response.headers.get("location", ""))
                        _check_host(target, access, where, f" (redirected from {_shown(url)})")
                        url = target
                        continue
                    if response.status_code != 200:
                        raise InvalidRequestError(f"{where}: fetching {_shown(url)} failed: HTTP {response.status_code}", param=where)
                    return _content_type(response, url), _body(response, access, where, deadline)
    except httpx.TimeoutException:
        raise _too_slow(url, access, where) from None
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"{where}: fetching {_shown(url)} failed: {type(exc).__name__}: {exc}", param=where) from None
    raise InvalidRequestError(f"{where}: fetching {_shown(url)} was redirected more than {MAX_REDIRECTS} times", param=where)


def _body(response: object, access: MediaAccess, where: str, deadline: float) -> bytes:
    declared = response.headers.get("content-length")  # type: ignore[attr-defined]
    if declared is not None and declared.isdigit() and int(declared) > access.max_bytes:
        raise _too_large(access, where, f"{declared} bytes")
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_bytes():  # type: ignore[attr-defined]
        size += len(chunk)
        if size > access.max_bytes:
            raise _too_large(access, where, "more")
        if time.monotonic() > deadline:
            raise _too_slow(str(response.url), access, where)  # type: ignore[attr-defined]
        chunks.append(chunk)
    return b"".join(chunks)


def _content_type(response: object, url: str) -> str:
    declared = response.headers.get("content-type", "").split(";")[0].strip().lower()  # type: ignore[attr-defined]
    if declared and declared != "application/octet-stream":
        return declared
    return mimetypes.guess_type(urlsplit(url).path)[0] or "application/octet-stream"


def _too_large(access: MediaAccess, where: str, size: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: the medium is {size}; media are limited to {access.max_bytes} bytes", param=where)


def _too_slow(url: str, access: MediaAccess, where: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: fetching {_shown(url)} took longer than the limit of {access.timeout_s:g} s", param=where)
