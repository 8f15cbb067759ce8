"""Run ASGI apps on real loopback sockets inside a test's event loop.

Tests talk to real servers over TCP (never through in-process transports) so that streaming, disconnects
and timeouts behave as they do in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
from collections.abc import AsyncIterator, Iterable

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serve_app(app, port: int | None = None, host: str = "127.0.0.1", **uvicorn_kwargs) -> AsyncIterator[str]:
    """Serve `app` with uvicorn on `host` (a loopback address) and yield its base URL; stop it on exit."""
    port = port or free_port()
    # a request stuck in the app (a test that found a bug) must not hold the shutdown, and the test, forever
    uvicorn_kwargs.setdefault("timeout_graceful_shutdown", 10)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", **uvicorn_kwargs)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    else:
        raise TimeoutError("server did not start")
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def serve_raw(handle) -> AsyncIterator[int]:
    """An asyncio server on a loopback port for `handle(reader, writer)`, a hand-written HTTP peer that answers
    one exchange per connection; yields the port. The connection is closed after `handle` (what it wrote
    drained), and a client that goes away mid-exchange is no error."""
    async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handle(reader, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(exchange, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


async def read_request(reader: asyncio.StreamReader, timeout: float = 30) -> tuple[bytes, dict[bytes, bytes], dict]:
    """One request as a hand-written peer reads it: (path, headers by lower-case name, JSON body or {})."""
    import orjson

    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    path = head.split(b" ", 2)[1]
    pairs = (line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    headers = {k.strip().lower(): v.strip() for k, v in pairs}
    length = int(headers.get(b"content-length", b"0"))
    return path, headers, orjson.loads(await reader.readexactly(length)) if length else {}


def stop_processes(procs: Iterable[subprocess.Popen], grace: float = 10) -> None:
    """Terminate every process, then wait for each (killing one that outlives `grace` seconds)."""
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
