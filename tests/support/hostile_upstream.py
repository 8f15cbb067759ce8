"""An upstream that misbehaves on purpose, one way per path prefix, on a raw asyncio socket server on loopback.

A backend at `http://127.0.0.1:<port>/<mode>` answers its health check (`/<mode>/health`) well and its API
requests (`/<mode>/v1/...`) in the way `mode` names; `/<mode>/metrics` is 404, except for `metrics_flood`
whose /metrics is 100 MB. Every answer closes its connection when done, so `open` (connections not closed yet)
falls back to 0 once the gateway lets go of them all: one that stays up was leaked by the gateway.
Raw bytes, not an HTTP framework: most of these answers are ones no framework would send.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

MB = 1024 * 1024
MODES = ("header_20mb", "header_endless", "header_drip", "body_50mb", "sse_line_50mb", "invalid_http",
         "close_mid_body", "not_json", "metrics_flood")
BLOCK = 64 * 1024
SENT_AT_MOST = 300 * MB  # an endless answer ends here, so a gateway that never lets go fails its test, not the host


class HostileUpstream:
    def __init__(self) -> None:
        self.open = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            path = line.split(" ")[1]
            length = 0
            for header in head.split(b"\r\n")[1:]:
                name, _, value = header.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            mode, _, rest = path.lstrip("/").partition("/")
            await self.answer(mode, "/" + rest, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()
            self.open -= 1

    async def answer(self, mode: str, path: str, w: asyncio.StreamWriter) -> None:
        if path == "/health":
            return await whole(w, b"200 OK", b"application/json", b"{}")
        if path == "/metrics":
            if mode != "metrics_flood":
                return await whole(w, b"404 Not Found", b"text/plain", b"no metrics")
            return await chunked(w, b"text/plain", b"# HELP vllm:x padding\n", b"vllm:x 1\n" * (BLOCK // 9), 100 * MB)
        if mode == "header_20mb":
            w.write(b"HTTP/1.1 200 OK\r\nx-big: ")
            await repeat(w, b"a" * BLOCK, 20 * MB)
            w.write(b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        elif mode == "header_endless":
            w.write(b"HTTP/1.1 200 OK\r\n")
            await repeat(w, b"x-more: and-more-and-more\r\n" * 2000, SENT_AT_MOST)
        elif mode == "header_drip":
            w.write(b"HTTP/1.1 200 OK\r\nx-drip: ")
            for _ in range(600):  # a byte each 0.1 s for a minute at most
                w.write(b"a")
                await w.drain()
                await asyncio.sleep(0.1)
        elif mode == "body_50mb":  # valid JSON, chunked, so only counting can stop it
            await chunked(w, b"application/json", b'{"id":"x","object":"chat.completion","pad":"',
                          b"a" * BLOCK, 50 * MB, b'"}')
        elif mode == "sse_line_50mb":
            await chunked(w, b"text/event-stream", b'data: {"pad":"', b"a" * BLOCK, 50 * MB, b'"}\n\n')
        elif mode == "invalid_http":
            w.write(b"HTTP/1.1 2x0 WHAT\r\n\x00\x01\x02 not a header\r\n\r\n")
        elif mode == "close_mid_body":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                    b'{"id":"x","choices":[')
        elif mode == "not_json":
            await whole(w, b"200 OK", b"application/json", b"<html><body>Bad gateway, of a kind</body></html>")
        else:  # metrics_flood's API, and any other: a small valid answer
            await whole(w, b"200 OK", b"application/json", b'{"id":"ok","object":"chat.completion","choices":[{'
                        b'"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
                        b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')
        await w.drain()


async def whole(w: asyncio.StreamWriter, status: bytes, content_type: bytes, body: bytes) -> None:
    w.write(b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, content_type, len(body), body))
    await w.drain()


async def repeat(w: asyncio.StreamWriter, block: bytes, total: int) -> None:
    """Write `block` until `total` bytes went (or the peer left: ConnectionError ends the answer)."""
    sent = 0
    while sent < total:
        w.write(block)
        await w.drain()
        sent += len(block)


async def chunked(w: asyncio.StreamWriter, content_type: bytes, first: bytes, block: bytes, total: int,
                  last: bytes = b"") -> None:
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            % content_type)
    framed = b"%x\r\n%b\r\n" % (len(block), block)
    w.write(b"%x\r\n%b\r\n" % (len(first), first))
    sent = 0
    while sent < total:
        w.write(framed)
        await w.drain()
        sent += len(block)
    if last:
        w.write(b"%x\r\n%b\r\n" % (len(last), last))
    w.write(b"0\r\n\r\n")
    await w.drain()


@contextlib.asynccontextmanager
async def hostile_upstream() -> AsyncIterator[HostileUpstream]:
    upstream = HostileUpstream()
    upstream.server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    upstream.port = upstream.server.sockets[0].getsockname()[1]
    try:
        yield upstream
    finally:
        upstream.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(upstream.server.wait_closed(), 5)
