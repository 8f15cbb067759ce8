"""A lean HTTP/1.1 client for the gateway's upstreams: keep-alive pool, streamed bodies, three timeouts.

Why not httpx (the first choice): on the benchmark in tests/benchmarks/peers its connection pool took ~87% of
the gateway's CPU per request (pool bookkeeping walked on every request); this client is an asyncio Protocol
around httptools (the parser uvicorn uses), so a request is one `write` and a response is parsed as it arrives,
with no per-request task and no copy beyond joining what arrived between two reads.

What it does, and only that:
- one idle-connection stack per origin (last used first), idle connections dropped after `keepalive_expiry`
  (below vLLM's own 5 s keep-alive) and when the server closes them; a request that finds its reused
  connection closed before any byte of the answer is sent once more on a fresh one (the keep-alive race);
- bodies arrive as chunks (chunked encoding removed); reading pauses when the reader falls behind;
- closing a response before its end closes the connection, so the backend sees the client go (vLLM aborts);
- connect timeout per new connection, read timeout per wait for the next bytes, write timeout while a request
  body cannot be handed to the kernel (the backend is not reading);
- a request body may also be streamed (chunked encoding, `request(..., body_stream=)`): each chunk is handed to
  the kernel before the next is pulled, so an upload flows through at the backend's pace, never held whole;
- errors are `UpstreamError`s with a `kind`: connect (nothing reached the server: safe to retry elsewhere),
  timeout, broken (failed mid-exchange), too_large (an answer past one of the client's `Limits`);
- an answer is bounded (`Limits`): its status line and headers in size and, once their first byte came, in
  time (a head dripped a byte at a time); a body read whole (`read(limit)`, `get`) in size; `get` (health
  checks, /metrics scrapes) also in total time. A streamed body is bounded per event by its reader.
Connections are made by a `Dialer`; the egress guard (backends/egress.py) is one that checks addresses first.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

CONNECT, TIMEOUT, BROKEN, TOO_LARGE = "connect", "timeout", "broken", "too_large"
PAUSE_ABOVE = 1 << 20  # bytes buffered for a slow reader before the socket stops being read
GET_MAX_BYTES = 1 << 20  # a health check's body, unless the caller says otherwise


@dataclass(frozen=True, slots=True)
class Limits:
    """What one answer may be. `head_bytes`: the status line and headers (counted as they arrive, so a head
    that never ends is cut at this size); `head_seconds`: from the head's first byte to its end; `body_bytes`:
    a body read whole (a non-streamed answer); `event_bytes`: one event of a streamed body (read by the
    relay above, which takes it from here). The names are the policy's (`upstream.*`), so errors name them."""

    head_bytes: int = 64 * 1024
    head_seconds: float = 30.0
    body_bytes: int = 32 * 1024 * 1024
    event_bytes: int = 8 * 1024 * 1024


class UpstreamError(Exception):
    kind = BROKEN
    bound = False  # True: the message names the gateway's limit that was crossed, and may be shown as it is


class ConnectFailed(UpstreamError):
    kind = CONNECT


class ConnectTimedOut(ConnectFailed):
    pass


class ReadTimedOut(UpstreamError):
    kind = TIMEOUT


class WriteTimedOut(UpstreamError):
    kind = TIMEOUT


class Broken(UpstreamError):
    kind = BROKEN


class TooLarge(UpstreamError):
    """A body or event went past a limit of the gateway's (named in the message): its size may follow the
    request (a huge prompt echoed back), so this says nothing by itself of the backend's health."""

    kind = TOO_LARGE
    bound = True


class HeadTooLarge(Broken):
    """The status line and headers went past `upstream.max_header_bytes`: no sane answer does that, whatever
    was asked, so it counts as a broken exchange."""

    bound = True


class HeadTimedOut(ReadTimedOut):
    bound = True


class _Stale(Broken):
    """A reused connection was closed before any byte of the answer: the request may go again."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str  # as connected to and checked: IDNA, lower case, IPv6 without brackets
    port: int
    path: str  # the URL's path prefix, without a trailing slash
    host_header: str

    @property
    def tls(self) -> bool:
        return self.scheme == "https"


def parse_origin(url: str) -> Origin:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parts.hostname.encode("idna").decode("ascii").lower() if not _is_ipv6(parts.hostname) else parts.hostname
    default = 443 if parts.scheme == "https" else 80
    port = parts.port or default
    shown = f"[{host}]" if _is_ipv6(host) else host
    return Origin(parts.scheme, host, port, parts.path.rstrip("/"), shown if port == default else f"{shown}:{port}")


def _is_ipv6(host: str) -> bool:
    return ":" in host


def header_block(headers: dict[str, str]) -> bytes:
    """Header lines, refusing any name or value that could end the line early (CR/LF) or is not latin-1."""
    lines = []
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0") or ":" in name:
            raise ValueError(f"header {name!r} has a forbidden character")
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    return b"".join(lines)


class Dialer(Protocol):
    async def dial(self, host: str, port: int, *, tls: bool, server_name: str, timeout: float | None,
                   factory: Callable[[], Connection]) -> Connection:
        """Open a connection to `host` (a name or an address) and return its protocol (made by `factory`)."""


class SocketDialer:
    """Plain TCP (and TLS, verified against `server_name`) through the event loop."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.ssl_context = ssl_context

    async def dial(self, host: str, port: int, *, tls: bool, server_name: str, timeout: float | None,
                   factory: Callable[[], Connection]) -> Connection:
        context = None
        if tls:
            context = self.ssl_context = self.ssl_context or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    factory, host, port, ssl=context, server_hostname=server_name if tls else None)
        except TimeoutError:
            raise ConnectTimedOut(f"connecting to {server_name}:{port} timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {server_name}:{port}: {exc.strerror or exc}") from None
        return connection


class Response:
    """One answer. Read it with `read()` or `next_chunk()`; always `close()` it (it is idempotent)."""

    __slots__ = ("_conn", "_client", "_timeout", "status", "raw_headers", "headers", "_chunks", "_buffered",
                 "_paused", "complete", "keep_alive", "_error", "_waiter", "_headers_done", "_got_bytes",
                 "_until_close", "_closed", "_reusable", "_head_bytes", "_head_timer")

    def __init__(self, conn: Connection, client: Client, timeout: float | None) -> None:
        self._conn = conn
        self._client = client
        self._timeout = timeout
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self.complete = False
        self.keep_alive = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._headers_done = False
        self._got_bytes = False
        self._until_close = False
        self._closed = False
        self._reusable = True  # False when the request's body was not sent whole (the backend answered first)
        self._head_bytes = 0  # bytes received while the head was not complete
        self._head_timer: asyncio.TimerHandle | None = None

    # -- the reader's side ------------------------------------------------------------------------------

    async def read(self, limit: int | None = None, name: str = "upstream.max_body_bytes") -> bytes:
        """The whole body; past `limit` bytes (`name` says which setting) the connection is closed and TooLarge
        raised, so no more than about `limit` is ever held."""
        if limit is not None:
            length = self.headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                self.close()
                raise TooLarge(f"answered {int(length)} bytes, over the {name} of {limit} bytes")
        parts = []
        size = 0
        while chunk := await self.next_chunk():
            size += len(chunk)
            if limit is not None and size > limit:
                self.close()
                raise TooLarge(f"answered more than the {name} of {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def next_chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at the end."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self._conn.resume()
                return data
            if self._error is not None:
                raise self._error
            if self.complete:
                self.close()
                return b""
            await self._wait()

    def close(self) -> None:
        """Give the connection back when the answer was read to its end, else close it (aborting upstream)."""
        if self._closed:
            return
        self._closed = True
        if self._head_timer is not None:
            self._head_timer.cancel()
        conn = self._conn
        conn.response = None
        if self.complete and self.keep_alive and self._reusable and self._error is None and not conn.closed:
            self._client._release(conn)
        else:
            conn.close()

    async def _wait_headers(self) -> None:
        while not self._headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def _wait(self) -> None:
        loop = self._client.loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(self._timeout, self._timed_out) if self._timeout else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self) -> None:
        self._fail(ReadTimedOut(f"no answer from {self._conn.origin.host_header} within {self._timeout:g} s"))

    # -- the connection's side ----------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._wake()

    def _head_grew(self, size: int) -> None:
        """Bytes came and the head is still not complete: bound it in size, and in time from its first byte."""
        self._head_bytes += size
        limits = self._client.limits
        if self._head_bytes > limits.head_bytes:
            self._fail(HeadTooLarge(f"sent a status line and headers over the upstream.max_header_bytes of "
                                    f"{limits.head_bytes} bytes"))
            self._conn.close()
        elif self._head_timer is None and limits.head_seconds:
            self._head_timer = self._client.loop.call_later(limits.head_seconds, self._head_timed_out)

    def _head_timed_out(self) -> None:
        if not self._headers_done:
            self._fail(HeadTimedOut(f"took over the upstream.header_seconds of "
                                    f"{self._client.limits.head_seconds:g} s to send its headers"))
            self._conn.close()

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > PAUSE_ABOVE and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()


class Connection(asyncio.Protocol):
    """One keep-alive connection; at most one response at a time."""

    def __init__(self, origin: Origin, client: Client) -> None:
        self.origin = origin
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self.write_timer: asyncio.TimerHandle | None = None
        self.drained: asyncio.Future[None] | None = None  # set while the kernel's buffer is full (see drain)

    def send(self, head: bytes, body: bytes, timeout: float | None) -> Response:
        response = self.response = Response(self, self.client, timeout)
        assert self.transport is not None  # connection_made came before the dial returned this connection
        self.transport.write(head + body if body else head)
        return response

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def pause(self) -> None:
        if not self.closed:
            assert self.transport is not None  # bytes arrived, so the connection was made
            self.transport.pause_reading()

    def resume(self) -> None:
        if not self.closed:
            assert self.transport is not None  # bytes arrived, so the connection was made
            self.transport.resume_reading()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream protocol's transport (TCP, TLS) is an asyncio.Transport; the base class names the base type
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=0)  # told at once when a write cannot go out whole (write timeout)

    async def drain(self) -> None:
        """Wait until what was written went to the kernel (or the connection closed)."""
        while self.drained is not None and not self.closed:
            await asyncio.shield(self.drained)

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = self.client.loop.create_future()
        timeout = self.client.write_timeout
        if timeout and self.response is not None and self.write_timer is None:
            self.write_timer = self.client.loop.call_later(timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _write_timed_out(self) -> None:
        self.write_timer = None
        if self.response is not None:
            self.response._fail(WriteTimedOut(
                f"sending the request to {self.origin.host_header} timed out after {self.client.write_timeout:g} s"))
        self.close()

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing was asked: a confused server; do not reuse this connection
            self.client._forget(self)
            self.close()
            return
        response._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(Broken(f"the backend sent an invalid HTTP response: {exc}"))
            self.close()
            return
        if not response._headers_done:  # rare: a head split over reads (or one that never ends)
            response._head_grew(len(data))

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.resume_writing()
        response = self.response
        if response is None:
            self.client._forget(self)
            return
        if response._until_close and response._headers_done and not response.complete:
            response.complete, response.keep_alive = True, False  # a body delimited by the close
            response._wake()
        elif not response._got_bytes:
            response._fail(_Stale(f"{self.origin.host_header} closed the connection without answering"))
        else:
            response._fail(Broken(f"{self.origin.host_header} closed the connection mid-response"))

    # httptools callbacks
    # (the parser is fed only while a response is waiting: see data_received)
    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        assert response is not None
        response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            response.raw_headers.clear()
            return
        headers: dict[str, str] = {}
        for name, value in response.raw_headers:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        response.status, response.headers = status, headers
        if response._head_timer is not None:
            response._head_timer.cancel()
        response._until_close = "content-length" not in headers and "chunked" not in headers.get(
            "transfer-encoding", "")
        response._headers_done = True
        response._wake()

    def on_body(self, body: bytes) -> None:
        response = self.response
        assert response is not None
        response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        if not response._headers_done:
            return  # the end of an interim answer
        response.complete = True
        response.keep_alive = self.parser.should_keep_alive()
        response._wake()


class Client:
    """The shared pool. `request` sends prepared bytes; `get` is for health checks."""

    def __init__(self, connect_timeout: float | None, read_timeout: float | None, *, write_timeout: float | None = None,
                 dialer: Dialer | None = None, keepalive_expiry: float = 4.0, max_idle_per_origin: int = 512,
                 limits: Limits = Limits()) -> None:
        self.connect_timeout = connect_timeout
        self.limits = limits
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.dialer = dialer or SocketDialer()
        self.keepalive_expiry = keepalive_expiry
        self.max_idle = max_idle_per_origin
        self.idle: dict[Origin, list[Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    async def request(self, origin: Origin, head: bytes, body: bytes = b"", *, read_timeout: float | None = None,
                      connect_timeout: float | None = None) -> Response:
        """Send `head` (request line and headers, ending in a blank line) and `body`; return once the answer's
        status and headers are in. The caller must close the response."""
        timeout = read_timeout if read_timeout is not None else self.read_timeout
        while True:
            conn = self._reuse(origin)
            fresh = conn is None
            if conn is None:
                conn = await self._dial(origin, connect_timeout)
            response = conn.send(head, body, timeout)
            try:
                await response._wait_headers()
            except _Stale:
                response.close()
                if fresh:
                    raise Broken(f"{origin.host_header} closed the connection without answering") from None
                continue  # the keep-alive race: the server closed it just as it was reused
            except BaseException:
                response.close()
                raise
            return response

    async def request_streamed(self, origin: Origin, head: bytes, chunks: AsyncIterator[bytes], *,
                               read_timeout: float | None = None, connect_timeout: float | None = None) -> Response:
        """Send `head` (which must say `transfer-encoding: chunked`) and the body `chunks` as they come; return
        once the answer's status and headers are in. Always on a fresh connection: a body read as it streams
        cannot be sent again after the keep-alive race. An exception from `chunks` (the client's upload broke
        or went over its limit) closes the connection, so the backend drops the half-sent request, and is
        raised as it is. A backend that answers before the body is whole (an early 4xx) gets no more of it."""
        timeout = read_timeout if read_timeout is not None else self.read_timeout
        conn = await self._dial(origin, connect_timeout)
        response = conn.send(head, b"", timeout)
        transport = conn.transport
        assert transport is not None  # send wrote the head on it
        try:
            async for chunk in chunks:
                if response._headers_done or response._error is not None or conn.closed:
                    response._reusable = False
                    break
                transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                await conn.drain()
            else:
                if not conn.closed:
                    transport.write(b"0\r\n\r\n")
            await response._wait_headers()
        except BaseException:
            response.close()
            raise
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        return response

    async def get(self, url: str, timeout: float | None = None, max_bytes: int = GET_MAX_BYTES,
                  limit_name: str = "health check's limit") -> tuple[int, bytes]:
        """One GET read whole: within `timeout` in all (not only per read: a body dripped a byte at a time ends
        too) and `max_bytes` of body (`limit_name` names that bound in the error)."""
        origin = self._origins.get(url) or self._origins.setdefault(url, parse_origin(url))
        head = (f"GET {origin.path or '/'} HTTP/1.1\r\nhost: {origin.host_header}\r\n"
                "accept-encoding: identity\r\n\r\n").encode("latin-1")
        response = None
        try:
            async with asyncio.timeout(timeout):
                response = await self.request(origin, head, read_timeout=timeout, connect_timeout=timeout)
                return response.status, await response.read(max_bytes, limit_name)
        except TimeoutError:
            raise ReadTimedOut(f"GET {url} took over {timeout:g} s in all") from None
        finally:
            if response is not None:
                response.close()

    async def aclose(self) -> None:
        self.close_idle()

    def close_idle(self) -> None:
        """Close every pooled connection (those in use close when their response does)."""
        for stack in self.idle.values():
            for conn in stack:
                conn.close()
        self.idle.clear()

    def close_origin(self, url: str) -> None:
        """Close the pooled connections to one origin (a replica that was drained and removed)."""
        origin = parse_origin(url)
        for key in [o for o in self.idle if (o.host, o.port, o.tls) == (origin.host, origin.port, origin.tls)]:
            for conn in self.idle.pop(key):
                conn.close()

    # -- the pool -----------------------------------------------------------------------------------------

    async def _dial(self, origin: Origin, timeout: float | None) -> Connection:
        return await self.dialer.dial(
            origin.host, origin.port, tls=origin.tls, server_name=origin.host,
            timeout=timeout if timeout is not None else self.connect_timeout,
            factory=lambda: Connection(origin, self),
        )

    def _reuse(self, origin: Origin) -> Connection | None:
        stack = self.idle.get(origin)
        if not stack:
            return None
        oldest_ok = self.loop.time() - self.keepalive_expiry
        while stack:
            conn = stack.pop()
            if not conn.closed and conn.idle_since >= oldest_ok:
                return conn
            conn.close()
        return None

    def _release(self, conn: Connection) -> None:
        stack = self.idle.setdefault(conn.origin, [])
        now = self.loop.time()
        while stack and (stack[0].closed or stack[0].idle_since < now - self.keepalive_expiry):
            stack.pop(0).close()  # the oldest first: the stack's bottom
        if len(stack) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = now
        stack.append(conn)

    def _forget(self, conn: Connection) -> None:
        stack = self.idle.get(conn.origin)
        if stack and conn in stack:
            stack.remove(conn)
