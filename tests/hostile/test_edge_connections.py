"""Hostile connections against the bounded edge (gateway/http/edge.py): trailers, bodies that starve the connection
room, and body bytes the app has not asked for.

Most cases run a real `llm-gateway serve` process over the simulator with the file limit lowered to 256 (the
connection bound is then 96), reusing tests/integration/test_hostile_clients.py's gateway, fixture and helpers.
The bound on unread body bytes over all connections is shown on an in-process uvicorn server whose app never
reads, with that bound set low, since a real gateway reaches it only with thousands of connections.
"""

from __future__ import annotations

import asyncio
import threading
import time

import orjson

from gateway.http.edge import BODY_GRACE, STARVING_FACTOR, Bounds, HeldBodies, bounded_protocol
from tests.integration.test_hostile_clients import (
    CONNECTION_BOUND,
    GOOD_BOUND,
    Gateway,
    GoodClient,
    body_of,
    gw,  # noqa: F401 - the module's gateway fixture
    memory_kib,
    read_answer,
    status_of,
)
from tests.support.servers import serve_app

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
MiB = 1 << 20
BOUND = 4 * MiB  # the in-process server's bound on unread body bytes


def chunked_head(path: str, auth: str = "", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json\r\n"
            f"transfer-encoding: chunked\r\n{extra}\r\n").encode()


def test_a_huge_trailer_is_a_fast_431_and_the_gateway_stays_responsive(gw):  # noqa: F811
    base_hwm = memory_kib(gw.proc.pid, "VmHWM")
    with GoodClient(gw):
        for _ in range(2):
            s = gw.connect()
            t0 = time.monotonic()
            # with a key, so that the app waits for the body's end (without one it may answer 401 before the trailer)
            s.sendall(chunked_head("/v1/chat/completions", auth=f"authorization: Bearer {gw.key}\r\n")
                      + b"%x\r\n%s\r\n0\r\nx-big: " % (len(CHAT), CHAT))
            try:
                for _ in range(16):  # 16 MiB of one trailer field that never ends
                    s.sendall(b"a" * MiB)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the gateway answered, dropped what followed for a moment, then closed: what it may do
            raw = read_answer(s, 10)
            took = time.monotonic() - t0
            s.close()
            assert status_of(raw) == 431, raw[:200]
            error = body_of(raw)["error"]
            assert error["code"] == "request_header_fields_too_large"
            assert "server.max_header_bytes" in error["message"]
            assert took < 8, f"the 431 came after {took:.1f} s"
    grown_mib = (memory_kib(gw.proc.pid, "VmHWM") - base_hwm) / 1024
    assert grown_mib < 16, f"peak memory grew {grown_mib:.0f} MiB for two 16 MiB trailers"


def test_a_trailer_field_never_joins_the_request_headers(gw):  # noqa: F811
    chunk = b"%x\r\n%s\r\n" % (len(CHAT), CHAT)
    # no key in the head, the key in a trailer: the request is unauthenticated
    s = gw.connect()
    s.sendall(chunked_head("/v1/chat/completions", extra="connection: close\r\n") + chunk
              + f"0\r\nauthorization: Bearer {gw.key}\r\n\r\n".encode())
    raw = read_answer(s, 15)
    s.close()
    assert status_of(raw) == 401, raw[:300]
    assert gw.key.encode() not in raw
    # a small trailer after a well-formed request is allowed, and ignored
    s = gw.connect()
    s.sendall(chunked_head("/v1/chat/completions", auth=f"authorization: Bearer {gw.key}\r\n",
                           extra="connection: close\r\n") + chunk + b"0\r\nx-checksum: 1234\r\n\r\n")
    raw = read_answer(s, 15)
    s.close()
    assert status_of(raw) == 200, raw[:300]


def test_slow_bodies_filling_every_connection_give_way_to_a_new_client(gw):  # noqa: F811
    """Bodies above server.body_min_rate (1 KiB/s) but under the starving rate hold every connection the gateway
    allows; a new client still gets in, taking the place of the slowest, which gets 408."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {gw.key}\r\n"
            f"content-type: application/json\r\ncontent-length: {MiB}\r\n\r\n").encode()
    slow = []
    stop = threading.Event()

    def drip() -> None:  # 768 bytes every 0.25 s to each: ~3 KB/s, over body_min_rate, under the starving rate
        assert 3 * 1024 < STARVING_FACTOR * 1024
        for _ in range(1200):  # bounded: the case stops it much sooner
            for s in list(slow):
                try:
                    s.send(b" " * 768)
                except OSError:
                    slow.remove(s)
            if stop.wait(0.25):
                return

    dripper = threading.Thread(target=drip, daemon=True)
    try:
        for _ in range(CONNECTION_BOUND):
            s = gw.connect()
            s.sendall(head + b'{"model": "m", "messages": [')
            slow.append(s)
        dripper.start()
        full = gw.connect()  # the room is full of bodies under way: a new connection waits on nobody's idle one
        full.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert status_of(read_answer(full, 10)) == 503
        full.close()
        time.sleep(BODY_GRACE + 1)  # a body is judged starving only after the same grace as body_min_rate's
        times = [gw.good_call() for _ in range(5)]
        assert max(times) < GOOD_BOUND, f"a good call took {max(times):.1f} s"
    finally:
        stop.set()
        if dripper.is_alive():
            dripper.join(10)
    answers = []
    for s in list(slow):
        s.setblocking(False)
        try:
            answers.append(s.recv(65536))
        except (BlockingIOError, ConnectionResetError):
            pass
        s.close()
    refused = [a for a in answers if status_of(a) == 408]
    assert refused, "no slow body was refused to make room"
    message = body_of(refused[0])["error"]["message"]
    assert "server.body_min_rate" in message and "server.max_connections" in message


def test_a_body_answered_unread_is_let_go_with_its_answer(tmp_path):
    """350 connections each send 2 MiB of a body to a route that answers without reading it (401, no key) and
    stay open: the gateway's memory grows by a small part of the 700 MiB sent."""
    g = Gateway(tmp_path, {"header_timeout": 60, "body_timeout": 60, "keepalive_seconds": 60}, nofile=False)
    socks: list[list] = []
    try:
        base = memory_kib(g.proc.pid, "VmRSS")
        head = f"GET /v1/models HTTP/1.1\r\nhost: x\r\ncontent-length: {3 * MiB}\r\n\r\n".encode()
        piece = b"x" * (256 << 10)
        for _ in range(350):
            s = g.connect()
            s.sendall(head + piece)  # the head and a first piece of the body arrive together
            s.setblocking(False)
            socks.append([s, len(piece)])
        stalled_since = time.monotonic()
        for _ in range(10_000):  # the rest, as fast as each connection takes it, up to 2 MiB each
            moved = False
            for entry in socks:
                if entry[1] >= 2 * MiB:
                    continue
                try:
                    entry[1] += entry[0].send(piece[: 2 * MiB - entry[1]])
                    moved = True
                except BlockingIOError:
                    pass
                except OSError:
                    entry[1] = 2 * MiB
            if moved:
                stalled_since = time.monotonic()
            elif time.monotonic() - stalled_since > 3:
                break
        sent_mib = sum(e[1] for e in socks) / MiB
        grown_mib = (memory_kib(g.proc.pid, "VmRSS") - base) / 1024
        assert sent_mib > 300, f"only {sent_mib:.0f} MiB went out"
        assert grown_mib < 12, f"memory grew {grown_mib:.0f} MiB for {len(socks)} connections' unread bodies"
    finally:
        for entry in socks:
            entry[0].close()
        g.stop()


def never_reads(release: asyncio.Event):
    """An app that holds every request without asking for its body until `release` is set, then reads it until
    the client is gone."""

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            for _ in range(2):
                message = await receive()
                await send({"type": message["type"] + ".complete"})
            return
        await release.wait()
        for _ in range(1000):
            if (await receive())["type"] == "http.disconnect":
                return

    return app


async def test_unread_bodies_are_bounded_over_all_connections():
    bound = BOUND
    protocol = bounded_protocol(Bounds(max_held_bytes=bound))
    release = asyncio.Event()
    writers: list = []
    async with serve_app(never_reads(release), http=protocol) as url:
        try:
            answers = await unread_bodies(int(url.rsplit(":", 1)[1]), 40, writers)
        finally:
            for writer in writers:
                writer.close()
            release.set()  # the apps read at last: what their connections held is theirs now
        refused = [a for a in answers if status_of(a) == 503]
        assert refused, "no connection was refused past the bound"
        assert body_of(refused[0])["error"]["code"] == "too_many_unread_bodies"
        assert all(a == b"" for a in answers[: bound // (256 << 10) - 1]), "refused before the bound"
        assert all(status_of(a) == 503 for a in answers[-4:]), "held past the bound"
        for _ in range(500):
            if HeldBodies.total == 0:
                break
            await asyncio.sleep(0.01)
        assert HeldBodies.total == 0


async def unread_bodies(port: int, count: int, writers: list) -> list[bytes]:
    """`count` connections, each sending a head and 256 KiB of its body; returns what each was answered."""
    readers = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        readers.append(reader)
        writers.append(writer)
        held = HeldBodies.total
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
                     % (4 * MiB) + b"x" * (256 << 10))
        await writer.drain()
        for _ in range(500):  # until this connection holds its bytes, or was refused
            if HeldBodies.total != held or reader.at_eof() or reader._buffer:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.01)
        assert HeldBodies.total <= BOUND + (512 << 10), HeldBodies.total

    async def answer(reader: asyncio.StreamReader) -> bytes:
        try:
            return await asyncio.wait_for(reader.read(65536), 1)
        except (TimeoutError, ConnectionResetError):
            return b""

    return list(await asyncio.gather(*(answer(r) for r in readers)))
