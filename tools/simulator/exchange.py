"""One HTTP exchange of the simulator over raw ASGI (`Http`), and the ASGI shapes it speaks: the app and its
route groups (extras, audio, LoRA) take it, so it lives below them all."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from .engine import GenRequest
from .protocol import ApiError

JSON = b"application/json"
Scope = dict[str, Any]  # ASGI: a connection's scope
Message = dict[str, Any]  # ASGI: one event received or sent
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class Http:
    """One HTTP exchange over raw ASGI: read the JSON body, answer, watch for the client leaving."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.receive, self.send = receive, send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: bytes = scope.get("query_string", b"")
        self.headers: dict[bytes, bytes] = dict(scope.get("headers") or [])
        request_id = self.headers.get(b"x-request-id")
        self.echo_headers: list[tuple[bytes, bytes]] = [(b"x-request-id", request_id)] if request_id else []

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            yield message.get("body", b"")
            if not message.get("more_body"):
                return

    async def read_json(self) -> Any:
        body = bytearray()
        async for chunk in self.chunks():
            body += chunk
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"Invalid JSON in request body: {exc}") from None

    async def start(self, status: int, content_type: bytes | None, length: int | None = None) -> None:
        headers: list[tuple[bytes, bytes]] = [(b"content-type", content_type)] if content_type else []
        headers += self.echo_headers
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes, more: bool = True) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def reply(self, status: int, body: bytes, content_type: bytes | None = JSON) -> None:
        await self.start(status, content_type, len(body))
        await self.write(body, more=False)

    async def json(self, status: int, obj: Any) -> None:
        await self.reply(status, orjson.dumps(obj))

    @contextlib.asynccontextmanager
    async def abort_on_disconnect(self, gen: GenRequest) -> AsyncIterator[None]:
        """Abort `gen` as soon as the client disconnects, and whenever the handler exits early."""

        async def watch() -> None:
            while (await self.receive())["type"] != "http.disconnect":
                pass
            gen.abort()

        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()
            gen.abort()  # no-op once finished
