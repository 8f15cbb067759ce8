"""The client side of the bounded edge: uvicorn's httptools protocol with bounds on every connection.

uvicorn bounds the request head only with its h11 parser; with httptools (twice as fast here) nothing does: a
100 MiB header was parsed for ~30 s (httptools joins a header's pieces one by one) while the event loop starved,
and a connection that sends nothing, half a request line, or a body at one byte per half second stayed open
for ever. This subclass keeps httptools and adds, per connection:

- `max_header_bytes`: the request line and headers are fed to the parser only up to the bound; past it the
  client gets 431 and the rest is never parsed. The same bound holds for the trailer fields after a chunked
  body, and for any other run of bytes in a body that brings no progress (a chunk-size line, its extensions):
  httptools buffers a field's pieces until the field ends, so what is counted is the bytes fed to the parser
  since the body last moved (the head ended, a chunk began or ended, body bytes came out); past the bound,
  431. Trailer fields never join the request's headers: the app sees only the head's.
- `header_timeout`: from a new connection's accept, or a request's first byte, to the end of its headers
  (slowloris); then 408.
- `body_timeout` and `body_min_rate`: the longest wait for the next body bytes, and the least average rate
  once a body has taken `BODY_GRACE` seconds; then 408. Time the gateway itself stops reading (the app is
  behind) does not count against the client.
- `keepalive_seconds` is uvicorn's own idle keep-alive (set in gateway/cli/__init__.py).
- `max_connections`: at the bound, a new connection first takes the place of the longest-idle one (no request
  in progress: a keep-alive connection, or one still sending its head); else that of the slowest starving body:
  a body under way for at least `BODY_GRACE` whose average rate is under `STARVING_FACTOR` x `body_min_rate`
  (16 KiB/s by default: a 4 MiB body would take over four minutes), which gets 408. Such bodies pass the
  `body_min_rate` floor, yet thousands of them would hold every connection for as long as they like. A body
  the gateway itself stopped reading (the app is behind) is never starving. Only when every connection serves
  a request at a better rate does the new one get a fast 503 with `Retry-After`. The bound is also kept under
  the process's file limit, so that accept() never fails (asyncio then stops accepting for a second: a hang
  for every client).
- Body bytes the app has not asked for: uvicorn stops reading a connection once more than `HELD_MARK` bytes
  wait for the app, and the gateway counts what such connections hold across the process; past
  `max_held_bytes` (64 MiB) the connection that adds to it gets 503 (the gateway is behind on reading bodies) and its
  bytes are let go. What an app answered without reading (a 401, a 404) is let go when the answer ends, not
  when the connection does.

A refused request is answered in its route's own error shape (Anthropic's on /v1/messages, OpenAI's elsewhere),
then the connection is half-closed and what the client still sends is read and dropped for a moment, so that the
answer is not lost to a reset. Nothing here logs a header or a body.

Writes to the client go out once per turn of the event loop (gateway/http/corked.py): a response's head, body
and last chunk in one system call, not three.

Normal requests pay one length check per read: timers and the trailer count start only when a head or body is
still incomplete after a read, and bodies are counted process-wide only past `HELD_MARK`, which a client that
sends a small request in one piece never causes.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.http.corked import CorkedTransport
from gateway.http.error_shapes import anthropic_error
from policies.config import Server
from policies.errors import GatewayError

BODY_GRACE = 5.0  # seconds before `body_min_rate` applies: a short pause at the start of an upload is no attack
LINGER_SECONDS = 2.0  # after a refusal: how long what the client still sends is read and dropped
LINGER_BYTES = 16 << 20  # ...and at most this much of it
FILES_KEPT = 64  # file descriptors the process keeps for itself (logs, the store, the policy file)
STARVING_FACTOR = 16  # a body under this many times `body_min_rate` gives up its connection when room is needed
HELD_MARK = HIGH_WATER_LIMIT  # body bytes waiting for the app past which a connection is no longer read (64 KiB)


@dataclass(frozen=True)
class Bounds:
    max_header_bytes: int = 64 * 1024
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    body_min_rate: int = 1024
    max_connections: int = 4096
    max_held_bytes: int = 64 << 20  # body bytes waiting for the app, over the connections past HELD_MARK


def connection_bound(wanted: int) -> int:
    """At most `wanted` client connections, and never so many that the file limit runs out: each request in
    flight also holds one upstream connection, so clients get half of what the process may open."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - FILES_KEPT) // 2))


class EdgeError(GatewayError):
    """An edge refusal, carrying its status (431, 408, 503)."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None) -> None:
        self.status = status
        self.type = "invalid_request_error" if status < 500 else "service_unavailable"
        self.retry_after = retry_after  # sent as Retry-After by GatewayError, as for every other 503
        super().__init__(message, code=code)


class HeldBodies:
    """Body bytes that wait for the app past `HELD_MARK`, over every connection of the process."""

    total = 0


class ReleasingFlow(FlowControl):
    """uvicorn's flow control, which resumes reading a connection when its app asks for the body: then the
    bytes the connection held are the app's, no longer held (`release`)."""

    def __init__(self, transport: asyncio.Transport, release: Callable[[], None]) -> None:
        super().__init__(transport)
        self.release = release

    def resume_reading(self) -> None:
        if self.read_paused:
            self.release()
            super().resume_reading()


def _nothing_held() -> None:
    pass


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    bounds = Bounds()  # replaced per server by `bounded_protocol`

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, object],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._in_head = True  # no complete request head since the last request ended
        self._head_seen = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_started = 0.0
        self._body_last = 0.0
        self._body_bytes = 0
        self._unparsed = 0  # bytes fed to the parser in a body since it last moved (trailers, chunk-size lines)
        self._held = 0  # this connection's part of HeldBodies.total
        self._lingering = -1  # bytes read and dropped since a refusal; -1: not refusing
        self._idle_since = time.monotonic()
        self.url = b""

    # -- connections ------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CorkedTransport(transport, self.loop))  # a response's pieces in one write
        self.flow = self.releasing = ReleasingFlow(transport, self._release)
        if len(self.connections) > self.bounds.max_connections and not self._evict_idle() \
                and not self._evict_starving():
            self._refuse(EdgeError(503, f"the gateway is at server.max_connections "
                                        f"({self.bounds.max_connections} connections, each serving a request)",
                                   "too_many_connections", retry_after=1))
            return
        self._head_timer = self.loop.call_later(self.bounds.header_timeout, self._head_expired)

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection (no request in progress) to make room; False if there is none."""
        idle = [c for c in self.connections
                if c is not self and isinstance(c, BoundedHttpToolsProtocol) and c._lingering < 0
                and (c.cycle is None or c.cycle.response_complete)]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._idle_since)
        oldest.connections.discard(oldest)
        oldest.transport.close()
        return True

    def _evict_starving(self) -> bool:
        """Refuse the slowest starving body (module docstring) to make room; False if there is none."""
        floor = STARVING_FACTOR * self.bounds.body_min_rate
        now = time.monotonic()
        slowest, slowest_rate = None, float(floor)
        for c in self.connections:
            if (c is self or not isinstance(c, BoundedHttpToolsProtocol) or c._body_timer is None
                    or c._lingering >= 0 or c.flow.read_paused or now - c._body_started < BODY_GRACE):
                continue
            rate = c._body_bytes / (now - c._body_started)
            if rate < slowest_rate:
                slowest, slowest_rate = c, rate
        if slowest is None:
            return False
        slowest.connections.discard(slowest)
        slowest._refuse_request(EdgeError(
            408, f"the body arrived at {slowest_rate:.0f} bytes/s, under {STARVING_FACTOR} x server.body_min_rate, "
                 f"while the gateway was at server.max_connections ({self.bounds.max_connections})",
            "request_timeout"))
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self._release()
        self.releasing.release = _nothing_held  # no cycle between the connection and its flow
        super().connection_lost(exc)

    def _cancel_timers(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    # -- reading ----------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._lingering >= 0:
            self._linger(len(data))
            return
        if self._in_head:
            room = self.bounds.max_header_bytes - self._head_seen
            if len(data) > room:  # feed what the head may still take; the rest only if the head ended in it
                if room > 0:
                    super().data_received(data[:room])
                if self._in_head and not self.transport.is_closing():
                    self._refuse(EdgeError(431, f"the request line and headers exceed server.max_header_bytes "
                                                f"({self.bounds.max_header_bytes} bytes)",
                                           "request_header_fields_too_large"))
                    return
                data = data[max(room, 0):]
                if not data or self.transport.is_closing():
                    self._after_read()
                    return
            else:
                self._head_seen += len(data)
        else:  # a body: count what the parser takes without the body moving (trailer fields, chunk-size lines)
            self._unparsed += len(data)
            super().data_received(data)
            if self._unparsed > self.bounds.max_header_bytes and self._lingering < 0 and self.cycle is not None \
                    and not self.transport.is_closing():
                self._refuse_request(EdgeError(431, f"the request's trailer fields (or a chunk-size line) exceed "
                                                    f"server.max_header_bytes ({self.bounds.max_header_bytes} bytes)",
                                               "request_header_fields_too_large"))
                return
            self._after_read(len(data))
            return
        super().data_received(data)
        self._after_read(len(data))

    def _after_read(self, n: int = 0) -> None:
        """Arm the head timer when a head is still incomplete after a read, the body check when a body is."""
        if self._in_head:
            if self._head_timer is None and self._head_seen and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(self.bounds.header_timeout, self._head_expired)
        elif self._body_timer is not None:
            self._body_bytes += n  # a body under way: count its progress (a pipelined next request too: close enough)
            self._body_last = time.monotonic()
        else:
            cycle = self.cycle
            if cycle is not None and cycle.more_body and not cycle.response_complete:
                self._body_started = self._body_last = time.monotonic()
                self._body_bytes = len(cycle.body)
                self._body_timer = self.loop.call_later(1.0, self._check_body)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:  # after the head, a field is a trailer: it never joins the headers the app sees
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_seen = 0
        self._unparsed = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        """uvicorn's, with the body's progress noted and the bytes that wait for the app counted past HELD_MARK."""
        self._unparsed = 0
        cycle = self.cycle
        if cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade()):
            return
        cycle.body += body
        if len(cycle.body) > HELD_MARK:
            self._hold(len(cycle.body))
        cycle.message_event.set()

    def on_chunk_header(self) -> None:
        self._unparsed = 0

    def on_chunk_complete(self) -> None:
        self._unparsed = 0

    def _hold(self, held: int) -> None:
        """Stop reading until the app asks for what this connection holds, and count it process-wide."""
        self.flow.pause_reading()
        HeldBodies.total += held - self._held
        self._held = held
        if HeldBodies.total > self.bounds.max_held_bytes and self._lingering < 0:
            self._refuse_request(EdgeError(503, "the gateway holds too many request bodies it has not read yet",
                                           "too_many_unread_bodies", retry_after=1))

    def _release(self) -> None:
        HeldBodies.total -= self._held
        self._held = 0

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._in_head = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        if self.cycle.body and not self.pipeline:  # a body answered unread (a 401, a 404): let it go now
            self.cycle.body = bytearray()
        super().on_response_complete()

    # -- timers -----------------------------------------------------------------------------------------------
    def _head_expired(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being answered: its next one (pipelined) waits for it
            self._refuse(EdgeError(408, f"the request head did not arrive within server.header_timeout "
                                        f"({self.bounds.header_timeout:g} s)", "request_timeout"))

    def _check_body(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete or self.transport.is_closing():
            return
        now = time.monotonic()
        if self.flow.read_paused:  # the gateway is behind, not the client
            self._body_last = now
        elif now - self._body_last > self.bounds.body_timeout:
            self._refuse_request(EdgeError(408, f"no body bytes for server.body_timeout "
                                                f"({self.bounds.body_timeout:g} s)", "request_timeout"))
            return
        elif (now - self._body_started > BODY_GRACE
              and self._body_bytes / (now - self._body_started) < self.bounds.body_min_rate):
            self._refuse_request(EdgeError(408, f"the body arrives slower than server.body_min_rate "
                                                f"({self.bounds.body_min_rate} bytes/s)", "request_timeout"))
            return
        self._body_timer = self.loop.call_later(1.0, self._check_body)

    def _refuse_request(self, error: EdgeError) -> None:
        """Refuse a request whose head the app already has: its bytes are let go, its app sees a disconnect."""
        cycle = self.cycle
        cycle.body = bytearray()
        self._release()
        if cycle.response_started:  # the app already answers: nothing can be said any more
            self._cancel_timers()
            self.transport.close()
            return
        cycle.response_complete = True  # whatever the app still sends is dropped (its receive sees a disconnect)
        cycle.disconnected = True
        cycle.message_event.set()
        if self.pipeline:  # an earlier request's answer is still on its way: a word now would break into it
            self._cancel_timers()
            self.transport.close()
            return
        self.flow.resume_reading()  # a connection held unread: what follows is read and dropped (_linger)
        self._refuse(error)

    # -- refusing ---------------------------------------------------------------------------------------------
    def _refuse(self, error: EdgeError) -> None:
        self._cancel_timers()
        body = anthropic_error(error) if self.url.startswith(b"/v1/messages") else error.body()
        head = [b"HTTP/1.1 %d %s\r\n" % (error.status, HTTPStatus(error.status).phrase.encode()),
                b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n"]
        head += [b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in error.headers.items()]
        self.transport.write(b"".join(head) + b"\r\n" + body)
        self._lingering = 0
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def _linger(self, n: int) -> None:
        self._lingering += n
        if self._lingering > LINGER_BYTES:
            self.transport.close()


def bounded_protocol(bounds: Bounds) -> type[BoundedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, with these bounds."""
    return type("BoundedHttp", (BoundedHttpToolsProtocol,), {"bounds": bounds})


def uvicorn_options(server: Server) -> dict[str, Any]:
    """uvicorn.Config's arguments for the policy's `server:` section (a policies.config.Server)."""
    bounds = Bounds(max_header_bytes=server.max_header_bytes, header_timeout=server.header_timeout,
                    body_timeout=server.body_timeout, body_min_rate=server.body_min_rate,
                    max_connections=connection_bound(server.max_connections))
    return {"http": bounded_protocol(bounds), "timeout_keep_alive": server.keepalive_seconds}
