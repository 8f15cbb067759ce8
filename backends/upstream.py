"""Talking HTTP to an OpenAI-compatible upstream: an owned vLLM replica, or a rented provider.

Responses are always opened as streams; the caller reads or relays them and must close them. Failures surface
as `backends.http1.UpstreamError`s whose `kind` (connect, timeout, broken) the proxy acts on, so it treats
every upstream alike. The request head is prepared once per upstream; a request adds only its path, id and
length.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable

from backends.egress import GuardedDialer, Resolver, SystemResolver
from backends.http1 import (
    BROKEN,
    CONNECT,
    TIMEOUT,
    TOO_LARGE,
    Client,
    Limits,
    Response,
    UpstreamError,
    header_block,
    parse_origin,
)

__all__ = ["BROKEN", "CONNECT", "TIMEOUT", "TOO_LARGE", "Limits", "Upstream", "UpstreamError", "new_client"]


class Upstream:
    """One OpenAI-compatible API: `api_base` ends in /v1 (an owned vLLM's URL + /v1, a provider's base_url).

    Paths are vLLM's own (`/v1/chat/completions`, `/tokenize`): those under /v1/ go below `api_base`, the
    others (vLLM's extras) below its root, the URL without the trailing /v1.
    """

    def __init__(self, client: Client, api_base: str, headers: dict[str, str] | None = None,
                 timeout: float | None = None) -> None:
        self.client = client
        self.origin = parse_origin(api_base)
        self.read_timeout = timeout
        self.connect_timeout = min(timeout, 10.0) if timeout else None
        self.prefix = self.origin.path.encode("latin-1")
        self.root = self.prefix.removesuffix(b"/v1")
        self.fixed = header_block({"host": self.origin.host_header, "accept-encoding": "identity",
                                   **(headers or {})})

    async def open(self, path: str, body: bytes, request_id: str, method: str = "POST",
                   content_type: str = "application/json", stream: AsyncIterator[bytes] | None = None,
                   extra: bytes = b"") -> Response:
        """Send `method path` (a path and query the gateway built itself: no CR/LF can be in it) with `body`,
        or with the chunks of `stream` as they come (chunked encoding; `content_type` a header the HTTP
        server parsed, so without CR/LF). `extra`: more header lines, each ending in CRLF (the trace context)."""
        raw = path.encode("latin-1")
        target = self.prefix + raw[3:] if raw.startswith(b"/v1/") else self.root + raw
        typed = b"content-type: %s\r\n" % content_type.encode("latin-1") if body or stream else b""
        length = b"transfer-encoding: chunked" if stream is not None else b"content-length: %d" % len(body)
        head = b"%s %s HTTP/1.1\r\n%s%s%sx-request-id: %s\r\n%s\r\n\r\n" % (
            method.encode("latin-1"), target, self.fixed, typed, extra, request_id.encode("latin-1"), length)
        if stream is not None:
            return await self.client.request_streamed(self.origin, head, stream, read_timeout=self.read_timeout,
                                                      connect_timeout=self.connect_timeout)
        return await self.client.request(self.origin, head, body, read_timeout=self.read_timeout,
                                         connect_timeout=self.connect_timeout)


def new_client(
    connect: float,
    read: float,
    write: float | None = None,
    *,
    private_cidrs: Iterable[str] | None = None,
    resolver: Resolver | None = None,
    exempt: Iterable[tuple[str, int]] = (),
    on_refused: Callable[[str, int, str], None] | None = None,
    limits: Limits = Limits(),
) -> Client:
    """The one client pool every upstream request shares.

    With `private_cidrs`, every new connection is checked at connect time (backends/egress.py): a host must
    resolve only inside them, except the (host, port) origins in `exempt` (the rented providers).
    """
    dialer = None
    if private_cidrs is not None:
        dialer = GuardedDialer(private_cidrs, resolver or SystemResolver(), exempt, on_refused)
    return Client(connect, read, write_timeout=write, dialer=dialer, limits=limits)
