"""The OpenAI surface (/v1/... and vLLM's extras, as the endpoint registry lists them) as a lean ASGI app:
read the body, run the proxy, send the reply.

Plain ASGI rather than framework handlers because this is the hot path and because it must own two things
precisely: the body size limit while reading, and noticing a client that hangs up (http.disconnect), which
cancels the work in flight so the upstream request is aborted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Protocol, cast

from gateway.http.asgi import (
    App, Message, Receive, Scope, Send, body_of, client_host, more_body, query_of, raw_headers, text_of,
)
from gateway.endpoints import Registry
from gateway.needs import Answering
from gateway.endpoints.base import MULTIPART, NONE, Asked, Download, Route, openai_error_body
from gateway.proxy import Proxy, Reply, request_id_from
from policies.auth import Authenticate, bearer_key, check_key_source
from policies.errors import (
    AuthenticationFailed,
    BadRequest,
    GatewayError,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from policies.finished import answered
from policies.keys import KeyRecord
from policies.network import ClientNetwork
from policies.pipeline import KEY, TEAM, Call, Request
from policies.rate_limit import TICKET
from policies.snapshot import Snapshot
from policies.teams import effective_models

log = logging.getLogger("gateway.http")


WATCH_AFTER = 0.02  # seconds a call runs before its client's connection is watched (see Watch)


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class BodyStream:
    """A request body as it arrives, for the routes that stream theirs through (multipart uploads): at most
    `limit` bytes (413 past it, at once when Content-Length says so), `on_end` called once it is all in."""

    def __init__(self, receive: Receive, headers: dict[str, str], limit: int, on_end: Callable[[], None]) -> None:
        check_length(headers, limit)
        self.receive, self.limit, self.on_end = receive, limit, on_end
        self.size = 0
        self.ended = False
        self.gone = False  # the client hung up before its body was in

    def __aiter__(self) -> BodyStream:
        return self

    async def __anext__(self) -> bytes:
        while not self.ended:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                raise asyncio.CancelledError  # as when the watch sees the client go: the call is dropped
            chunk = body_of(message)
            self.size += len(chunk)
            if self.size > self.limit:
                raise too_large(self.limit)
            if not more_body(message):
                self.ended = True
                self.on_end()
            if chunk:
                return chunk
        raise StopAsyncIteration


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than the {limit} bytes this gateway accepts")


def check_length(headers: dict[str, str], limit: int) -> None:
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("invalid Content-Length header")
        if int(declared) > limit:
            raise too_large(limit)


CREDENTIALS = ("authorization", "x-api-key")  # the headers a key may come in: each at most once


class DuplicateCredential(AuthenticationFailed):
    """A credential header sent twice: which one would be the caller? Neither is trusted."""

    code = "duplicate_credential"


def header_pairs(scope: Scope) -> Iterator[tuple[str, str]]:
    """(lower-case name, value) of each request header, as text."""
    return ((key.decode("latin-1").lower(), value.decode("latin-1")) for key, value in raw_headers(scope))


def header_map(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name; a repeated header keeps its first value, but for
    X-Forwarded-For (one list, in order) and the credential headers: a second Authorization or X-Api-Key is a
    DuplicateCredential (401 naming it), whatever the two say, so no front proxy and no gateway replica can
    disagree with this one on who is calling."""
    headers: dict[str, str] = {}
    for name, text in header_pairs(scope):
        if name not in headers:
            headers[name] = text
        elif name == "x-forwarded-for":  # a list header: repeated lines are one list, in order
            headers[name] += ", " + text
        elif name in CREDENTIALS:
            raise DuplicateCredential(f"the {name} header was sent more than once; send one API key, once")
    return headers


async def read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    check_length(headers, limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = body_of(message)
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not more_body(message):
            return b"".join(chunks)


async def send_bytes(send: Send, status: int, headers: dict[str, str], body: bytes) -> None:
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_download(send: Send, headers: dict[str, str], download: Download) -> None:
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    raw.append((b"content-length", str(download.size).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": raw})
    async with contextlib.aclosing(download.pieces) as pieces:
        async for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_error(send: Send, error: GatewayError, request_id: str | None = None,
                     extra: dict[str, str] | None = None,
                     render: Callable[[GatewayError], bytes] = openai_error_body) -> None:
    headers = {"content-type": "application/json", **(extra or {}), **error.headers}
    if request_id:
        headers["x-request-id"] = request_id
    await send_bytes(send, error.status, headers, render(error))


async def send_stream(send: Send, reply: Reply) -> None:
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    raw += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
    await send({"type": "http.response.start", "status": reply.status, "headers": raw})
    async for chunk in relayed(reply):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class Serving(Answering, Protocol):
    """What the OpenAI routes ask of the gateway: the client networks and the keys (checked before a body is
    read), the live snapshot's rate limits (for what the gateway answers itself), and the proxy that runs a call
    (None until the app's lifespan has started); and what each route the gateway answers itself asks."""

    authenticate: Authenticate
    snapshot: Snapshot
    proxy: Proxy | None

    @property
    def client_network(self) -> ClientNetwork: ...


class OpenAIRoutes:
    """Serves the routes of the endpoint registry and the rest of /v1/ (404s in OpenAI's shape); hands every
    other request (and lifespan) to `fallback`, the ops/admin app."""

    def __init__(self, gateway: Serving, fallback: App, registry: Registry | None = None) -> None:
        self.gateway = gateway
        self.fallback = fallback
        self.registry = registry or Registry()
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = text_of(scope, "path")
        found = self.registry.match(path) if scope["type"] == "http" else None
        if found is None:
            if scope["type"] == "http" and path.startswith("/v1/"):
                await send_error(send, NotFound(f"unknown path {path[:200]}", code="unknown_url"),
                                 request_id_from(dict(header_pairs(scope))))
            else:
                await self.fallback(scope, receive, send)
            return
        methods, params = found
        method = text_of(scope, "method")
        try:
            headers = header_map(scope)
        except DuplicateCredential as exc:
            any_route = next(iter(methods.values()))
            await send_error(send, exc, request_id_from({}), render=any_route.errors)
            return
        route = methods.get(method)
        if route is None:
            any_route = next(iter(methods.values()))  # RFC 9110: a 405 names the methods that work
            error = MethodNotAllowed(f"{method} is not allowed on {path[:200]}", headers={"allow": ", ".join(methods)})
            await send_error(send, error, request_id_from(headers), render=any_route.errors)
            return
        if route.key_header and route.key_header in headers:
            if "authorization" not in headers:
                headers["authorization"] = "Bearer " + headers[route.key_header]
            elif bearer_key(headers["authorization"]) != headers[route.key_header].strip():
                headers["authorization"] = ""  # two different keys: trust neither (the 401 of a missing key)
        if route.answer is not None:
            await self.answer(route, params, headers, scope, receive, send)
        else:
            await self.serve(route, params, headers, scope, receive, send)

    async def answer(self, route: Route, params: dict[str, str], headers: dict[str, str], scope: Scope,
                     receive: Receive, send: Send) -> None:
        """A route the gateway answers itself (the model list, files, batches): the key and its network are
        checked, its body read whole within the route's limit, no more. Metered and logged as every route is,
        with no model or backend (it names no model it routes to)."""
        request_id = request_id_from(headers)
        arrived = time.perf_counter()
        status = 200
        stream: BodyStream | None = None
        limits: Call | None = None  # what the key's limits took, to give back
        try:
            network = self.gateway.client_network
            host = network.client_address(client_host(scope), headers.get("x-forwarded-for"))
            network.admit(host)
            key = await self.gateway.authenticate.verify(headers.get("authorization"))
            check_key_source(key, host)
            team = await self.gateway.authenticate.team_of(key)
            if route.limited:
                limits = Call(Request(request_id, route.name, headers, host, arrived))
                KEY.put(limits, key)
                if team is not None:
                    TEAM.put(limits, team)
                await self.count_against_limits(limits)
            if team is not None:  # the models it lists are the key's inside its team's
                key = key.model_copy(update={"models": effective_models(key, team)})
            raw = b""
            if route.body != NONE:
                policy = self.gateway.policy
                limit = route.max_body(policy) if route.max_body is not None else policy.server.max_body_bytes
                if route.body == MULTIPART:  # an upload: taken as it arrives, never held whole
                    stream = BodyStream(receive, headers, limit, lambda: None)
                else:
                    raw = await read_body(receive, headers, limit)
            asked = Asked(params, query_of(scope), raw, headers, host, stream)
            assert route.answer is not None  # __call__ sends here only the routes that have one
            body = await route.answer(self.gateway, key, asked)
        except ClientGone:
            return
        except asyncio.CancelledError:
            if stream is not None and stream.gone:
                return  # the client hung up mid-upload: nothing to answer, nothing kept
            raise
        except GatewayError as exc:
            status = exc.status
            await send_error(send, exc, request_id, limits.response_headers if limits else None, render=route.errors)
        else:
            headers = {"content-type": route.answer_type, "x-request-id": request_id,
                       **(limits.response_headers if limits else {})}
            if isinstance(body, Download):
                await send_download(send, headers, body)
            else:
                await send_bytes(send, 200, headers, body)
        finally:
            if limits is not None and TICKET.get(limits) is not None:
                rate_limit = self.gateway.snapshot.rate_limit
                assert rate_limit is not None  # the ticket was taken from it (count_against_limits)
                await rate_limit.leave(limits)  # the concurrency slot back
        assert self.gateway.proxy is not None  # the lifespan builds it before the first request
        self.gateway.proxy.observers.finished(answered(request_id, route.name, status, arrived))

    async def count_against_limits(self, call: Call) -> None:
        """A route the gateway answers itself (files, batches, the model list) counts against its key's (and
        team's) requests per minute and concurrency like any other request: an upload or a listing is not free."""
        rate_limit = self.gateway.snapshot.rate_limit
        if rate_limit is not None:
            await rate_limit.enter(call)

    async def serve(self, route: Route, params: dict[str, str], headers: dict[str, str], scope: Scope,
                    receive: Receive, send: Send) -> None:
        proxy = self.gateway.proxy
        assert proxy is not None  # the lifespan builds it before the first request
        call = route.call(request_id_from(headers), headers, client_host(scope), time.perf_counter(), params)
        policy = self.gateway.policy
        limit = route.max_body(policy) if route.max_body is not None else policy.server.max_body_bytes
        loop = self.loop or self._bind_loop()
        task = asyncio.current_task(loop)
        assert task is not None  # this coroutine runs in a task
        raw: bytes | BodyStream
        try:
            KEY.put(call, await self.caller(call))  # from the head: no body byte is read for a caller without a key
            if route.body == MULTIPART:  # streamed through: the client's connection is watched once it is in
                watch = Watch(loop, task, receive, armed=False)
                raw = BodyStream(receive, headers, limit, watch.arm)
            else:
                raw = await read_body(receive, headers, limit)
                watch = Watch(loop, task, receive)
        except ClientGone:
            return
        except GatewayError as exc:
            await send_error(send, exc, call.request.id, render=route.errors)
            return

        reply: Reply | None = None
        error: BaseException | None = None
        try:
            reply = await proxy.handle(call, raw, query_of(scope) if route.query is not None else b"")
            if reply.stream is None:
                await send_bytes(send, reply.status, reply.headers, reply.body)
            else:
                await send_stream(send, reply)
        except GatewayError as exc:
            await send_error(send, exc, call.request.id, call.response_headers, render=route.errors)
        except asyncio.CancelledError as exc:
            error = exc
            if isinstance(raw, BodyStream) and raw.gone:
                pass  # the client hung up mid-upload
            elif not watch.gone:
                raise  # not the client: the server is shutting down
            else:
                task.uncancel()
        except Exception as exc:
            error = exc
            log.exception("request %s failed inside the gateway", call.request.id)
            await send_error(send, InternalError("the gateway failed to handle the request"), call.request.id,
                             render=route.errors)
        except BaseException as exc:
            error = exc
            raise
        finally:
            watch.close()
            if reply is not None and reply.stream is not None:
                await relayed(reply).aclose()  # its end-of-stream bookkeeping runs now, before the accounting
            if reply is not None and reply.close is not None:
                await reply.close(error)

    async def caller(self, call: Call) -> KeyRecord:
        """The call's key, verified from its request head before its body is read: an unauthenticated client
        gets its 401 (or a refused network its 403) at once, and never has a body buffered for it. The pipeline's
        network and key steps run again on the call as they always do (the key step keeps this record)."""
        network = self.gateway.client_network
        network.admit(network.client_address(call.client_host, call.request.headers.get("x-forwarded-for")))
        return await self.gateway.authenticate.verify(call.request.headers.get("authorization"))

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        self.loop = asyncio.get_running_loop()
        return self.loop


def relayed(reply: Reply) -> AsyncGenerator[bytes, None]:
    """A streamed reply's stream: the proxy's relay, an async generator (closing it runs its end-of-stream
    bookkeeping), though Reply declares only what it iterates."""
    return cast("AsyncGenerator[bytes, None]", reply.stream)


class Watch:
    """Watches for the client hanging up while its call runs, and then cancels the call's task, which closes the
    upstream connection (vLLM aborts the request).

    The watch is one task waiting on `receive()`, started only once the call has run `WATCH_AFTER` seconds:
    most plain requests are answered before that, and a task per request was a measurable share of the
    gateway's CPU. A client gone before then is noticed when the watch starts. Once the call is closing the
    watch no longer cancels anything, so the accounting that runs while closing always completes.
    """

    __slots__ = ("closing", "gone", "loop", "receive", "task", "timer", "watcher")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[object], receive: Receive,
                 armed: bool = True) -> None:
        self.loop, self.task, self.receive = loop, task, receive
        self.gone = False
        self.closing = False
        self.watcher: asyncio.Task[Message] | None = None
        self.timer: asyncio.TimerHandle | None = None
        if armed:
            self.arm()

    def arm(self) -> None:
        """Start watching soon (a body streamed through is read by the call until its end: armed then)."""
        if not self.closing and self.timer is None and self.watcher is None:
            self.timer = self.loop.call_later(WATCH_AFTER, self.start)

    def start(self) -> None:
        self.timer = None
        if not self.closing:
            self.watcher = self.loop.create_task(self.receive())
            self.watcher.add_done_callback(self.on_message)

    def on_message(self, watcher: asyncio.Future[Message]) -> None:
        if self.closing or watcher.cancelled() or watcher.exception() is not None:
            return
        if watcher.result()["type"] == "http.disconnect":
            self.gone = True
            self.task.cancel()

    def close(self) -> None:
        self.closing = True
        if self.timer is not None:
            self.timer.cancel()
        if self.watcher is not None:
            self.watcher.cancel()
