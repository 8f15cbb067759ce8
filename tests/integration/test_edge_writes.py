"""The edge's gathered writes (gateway/http/corked.py) through uvicorn with the gateway's protocol: an answer
reaches the client once the turn that wrote it ends, whole and in order, and a stream's events are not held back
while its call waits for the next one."""

from __future__ import annotations

import asyncio
import socket
import time

from gateway.http.edge import Bounds, bounded_protocol
from tests.support.servers import serve_app

BOOKKEEPING = 0.3  # seconds the app blocks the event loop after answering (a call's accounting, exaggerated)


async def lifespan(receive, send) -> None:
    for _ in range(2):
        message = await receive()
        await send({"type": message["type"] + ".complete"})


def read_answer(port: int, path: str, until: bytes) -> tuple[bytes, float]:
    """A blocking client (its own thread: the server's loop may be blocked): the bytes up to `until`, and when
    they had all come."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        got = b""
        while until not in got:
            piece = client.recv(65536)
            assert piece, got
            got += piece
        return got, time.monotonic()


async def test_an_answer_goes_out_once_its_turn_ends_and_a_streams_events_as_the_call_waits():
    marks: dict[str, float] = {}
    next_event = asyncio.Event()

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["path"] == "/plain":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"6")]})
            await send({"type": "http.response.body", "body": b"answer"})
            time.sleep(BOOKKEEPING)  # blocks the loop: the turn that wrote the answer ends after this
            marks["turn ended"] = time.monotonic()
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
        await next_event.wait()  # the call waits for its upstream: what it wrote goes out meanwhile
        await send({"type": "http.response.body", "body": b"data: second\n\n", "more_body": False})

    async with serve_app(app, http=bounded_protocol(Bounds())) as url:
        port = int(url.rsplit(":", 1)[1])
        got, at = await asyncio.to_thread(read_answer, port, "/plain", b"answer")
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"\r\n\r\nanswer")
        assert at >= marks["turn ended"]  # held for the turn: its writes go out in one call

        stream = asyncio.create_task(asyncio.to_thread(read_answer, port, "/stream", b"data: first\n\n"))
        got, _ = await asyncio.wait_for(stream, 10)  # came while the call waited, before the second event
        assert b"data: second" not in got
        next_event.set()
