"""Talking HTTP to an OpenAI-compatible upstream: an owned vLLM replica, or a rented provider.

Responses are always opened as streams; the caller reads or relays them and must close them. Failures surface
as `backends.http1.UpstreamError`s whose `kind` (connect, timeout, broken) the proxy acts on, so it treats
every upstream alike. The request head is prepared once per upstream; a request adds only its path, id and
length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from backends.egress import GuardedDialer, Resolver, SystemResolver
from backends.http1 import (
    BROKEN,
    CONNECT,
    TIMEOUT,
    Client,
    Response,
    UpstreamError,
    header_block,
    parse_origin,
)

__all__ = ["BROKEN", "CONNECT", "TIMEOUT", "Upstream", "UpstreamError", "new_client"]


class Upstream:
    """One OpenAI-compatible API: `api_base` ends in /v1 (an owned vLLM's URL + /v1, a provider's base_url)."""

    def __init__(self, client: Client, api_base: str, headers: dict[str, str] | None = None,
                 timeout: float | None = None) -> None:
        self.client = client
        self.origin = parse_origin(api_base)
        self.read_timeout = timeout
        self.connect_timeout = min(timeout, 10.0) if timeout else None
        self.prefix = self.origin.path.encode("latin-1") + b"/"
        self.fixed = header_block({"host": self.origin.host_header, "content-type": "application/json",
                                   "accept-encoding": "identity", **(headers or {})})

    async def open(self, path: str, body: bytes, request_id: str, extra: bytes = b"") -> Response:
        """`extra`: more header lines, each ending in CRLF (the trace context)."""
        head = b"POST %s%s HTTP/1.1\r\n%s%sx-request-id: %s\r\ncontent-length: %d\r\n\r\n" % (
            self.prefix, path.encode("latin-1"), self.fixed, extra, request_id.encode("latin-1"), len(body))
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
) -> Client:
    """The one client pool every upstream request shares.

    With `private_cidrs`, every new connection is checked at connect time (backends/egress.py): a host must
    resolve only inside them, except the (host, port) origins in `exempt` (the rented providers).
    """
    dialer = None
    if private_cidrs is not None:
        dialer = GuardedDialer(private_cidrs, resolver or SystemResolver(), exempt, on_refused)
    return Client(connect, read, write_timeout=write, dialer=dialer)
