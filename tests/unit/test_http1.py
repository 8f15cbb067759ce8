"""The upstream HTTP/1.1 client against scripted loopback servers: framing, keep-alive, aborts, timeouts."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from backends.http1 import (
    BROKEN,
    CONNECT,
    TIMEOUT,
    Broken,
    TOO_LARGE,
    Client,
    ConnectFailed,
    HeadTimedOut,
    HeadTooLarge,
    Limits,
    ReadTimedOut,
    TooLarge,
    WriteTimedOut,
    header_block,
    parse_origin,
)
from tests.support.servers import free_port


class Script:
    """A loopback server: for each request read on a connection, `answer(n, request)` gives the bytes to send
    (None: close the connection). Records connections and requests (`per_connection`: how many requests each
    connection carried, in the order the connections came; `on_connection`: the count so far on the connection
    of the request being answered); `gone` counts connections the client closed."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.per_connection: list[int] = []
        self.on_connection = 0
        self.gone = asyncio.Event()
        self.server = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        mine = len(self.per_connection)
        self.per_connection.append(0)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + (await reader.readexactly(length) if length else b"")
                self.requests.append(request)
                self.per_connection[mine] += 1
                self.on_connection = self.per_connection[mine]
                answer = self.answer(len(self.requests), request)
                if answer is None:
                    writer.close()
                    return
                if callable(answer):
                    await answer(reader, writer)
                else:
                    writer.write(answer)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.gone.set()
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self):
        port = free_port()
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", port)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            self.server.close()


async def hang(reader, writer):
    """Never answer; notice when the client goes (read returns EOF)."""
    await asyncio.wait_for(reader.read(), 30)
    raise ConnectionResetError


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


def post(url: str, body: bytes = b"{}") -> tuple:
    origin = parse_origin(url)
    head = b"POST /v1/x HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n\r\n" % (origin.host_header.encode(), len(body))
    return origin, head, body


async def test_keep_alive_reuses_one_connection_and_sends_the_body():
    script = Script(lambda n, req: ok(b'{"n":%d}' % n))
    client = Client(1, 1)
    async with script.running() as url:
        for n in (1, 2, 3):
            response = await client.request(*post(url, b'{"a":1}'))
            assert (response.status, await response.read()) == (200, b'{"n":%d}' % n)
            assert response.headers["content-type"] == "application/json"
            response.close()
    assert script.connections == 1
    assert all(r.endswith(b'\r\n\r\n{"a":1}') for r in script.requests)
    await client.aclose()


async def test_chunked_stream_arrives_in_pieces_as_sent():
    async def stream(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    script = Script(lambda n, req: stream)
    client = Client(1, 1)
    async with script.running() as url:
        response = await client.request(*post(url))
        pieces = []
        while chunk := await response.next_chunk():
            pieces.append(chunk)
        response.close()
        assert pieces == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
        again = await client.request(*post(url))  # the finished stream's connection went back to the pool
        await again.read()
        again.close()
    assert script.connections == 1


async def test_closing_a_response_early_closes_the_connection():
    async def endless(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    script = Script(lambda n, req: endless)
    client = Client(1, 1)
    async with script.running() as url:
        response = await client.request(*post(url))
        assert await response.next_chunk()
        response.close()
        await asyncio.wait_for(script.gone.wait(), 5)  # the server saw the client go
    assert client.idle == {} or not any(client.idle.values())


async def test_cancelled_wait_closes_the_connection():
    script = Script(lambda n, req: hang)
    client = Client(1, None)
    async with script.running() as url:
        task = asyncio.create_task(client.request(*post(url)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(script.gone.wait(), 5)


async def test_read_timeout_is_a_timeout():
    script = Script(lambda n, req: hang)
    client = Client(1, 0.2)
    async with script.running() as url:
        with pytest.raises(ReadTimedOut) as info:
            await client.request(*post(url))
    assert info.value.kind == TIMEOUT


async def test_write_timeout_when_the_backend_does_not_read():
    stalled = asyncio.Event()

    async def never_read(reader, writer):
        stalled.set()
        await asyncio.sleep(30)

    port = free_port()
    server = await asyncio.start_server(never_read, "127.0.0.1", port)
    try:
        body = b"x" * (64 << 20)  # far more than the kernel's socket buffers take
        origin, head, _ = post(f"http://127.0.0.1:{port}", body)
        with pytest.raises(WriteTimedOut) as info:
            await asyncio.wait_for(Client(1, 30, write_timeout=0.3).request(origin, head, body), 10)
        assert info.value.kind == TIMEOUT and stalled.is_set()
    finally:
        server.close()


async def test_refused_connection_is_a_connect_failure():
    with pytest.raises(ConnectFailed) as info:
        await Client(1, 1).request(*post(f"http://127.0.0.1:{free_port()}"))
    assert info.value.kind == CONNECT


async def test_idle_connection_closed_by_the_server_is_replaced_without_an_error():
    # the server's keep-alive runs out after one request: it answers the first request on each connection and
    # closes the connection, unanswered, when a second one arrives on it (the keep-alive race)
    script = Script(lambda n, req: ok(b"{}") if script.on_connection == 1 else None)
    client = Client(1, 1)
    async with script.running() as url:
        for _ in range(3):
            response = await asyncio.wait_for(client.request(*post(url)), 10)
            assert await response.read() == b"{}"
            response.close()
    # the first request on a fresh connection; each later one on the reused connection (closed unanswered),
    # then exactly once more on a fresh connection: 5 requests over 3 connections, never a third send
    assert script.per_connection == [2, 2, 1]
    assert len(script.requests) == 5


async def test_a_fresh_connection_closed_without_answer_is_broken():
    script = Script(lambda n, req: None)
    async with script.running() as url:
        with pytest.raises(Broken) as info:
            await asyncio.wait_for(Client(1, 1).request(*post(url)), 10)
    assert info.value.kind == BROKEN
    assert script.per_connection == [1]  # not sent again: a fresh connection's close is no keep-alive race


async def test_body_until_close_and_interim_answers():
    async def until_close(reader, writer):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    script = Script(lambda n, req: until_close)
    client = Client(1, 1)
    async with script.running() as url:
        response = await client.request(*post(url))
        assert (response.status, await response.read()) == (200, b"all of it")
        response.close()
    assert not any(client.idle.values())


async def test_garbage_is_broken_and_mid_body_close_is_broken():
    script = Script(lambda n, req: b"NOT HTTP AT ALL\r\n\r\n")
    async with script.running() as url:
        with pytest.raises(Broken, match="invalid HTTP"):
            await Client(1, 1).request(*post(url))

    async def half(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part")
        await writer.drain()
        writer.close()

    script = Script(lambda n, req: half)
    async with script.running() as url:
        response = await Client(1, 1).request(*post(url))
        with pytest.raises(Broken, match="mid-response"):
            await response.read()
        response.close()


async def test_health_get_and_header_rules():
    script = Script(lambda n, req: ok(b"") if req.startswith(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1:") else None)
    async with script.running() as url:
        assert await Client(1, 1).get(f"{url}/health") == (200, b"")
    with pytest.raises(ValueError):
        header_block({"authorization": "Bearer x\r\nx-injected: 1"})
    assert parse_origin("https://API.Example.com/v1/").host_header == "api.example.com"
    assert parse_origin("http://[fd00::1]:8000/v1").host_header == "[fd00::1]:8000"
    with pytest.raises(ValueError):
        parse_origin("ftp://example.com")


@contextlib.asynccontextmanager
async def raw_server(handle):
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield parse_origin(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    finally:
        server.close()


STREAMED_HEAD = b"POST /up HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_a_streamed_body_goes_chunked_as_it_comes():
    got = asyncio.get_running_loop().create_future()

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        got.set_result(await reader.readuntil(b"0\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async def body():
        for piece in (b"abc", b"\r\n--x\r\n", b"z" * 30000):
            yield piece

    client = Client(2, 5, write_timeout=5)
    async with raw_server(handle) as origin:
        response = await client.request_streamed(origin, STREAMED_HEAD, body())
        assert response.status == 200 and await response.read() == b"ok"
        response.close()
    assert got.result() == b"3\r\nabc\r\n7\r\n\r\n--x\r\n\r\n" + b"7530\r\n" + b"z" * 30000 + b"\r\n0\r\n\r\n"


async def test_a_backend_answering_before_the_body_is_whole_gets_no_more_of_it():
    pulled = []

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 3\r\n\r\nno!")
        await writer.drain()
        await reader.read()  # keeps the connection until the client closes it

    async def body():
        for i in range(200):  # bounded: ~10 s at most
            pulled.append(i)
            yield b"x" * 1024
            await asyncio.sleep(0.05)

    client = Client(2, 5, write_timeout=5)
    async with raw_server(handle) as origin:
        response = await client.request_streamed(origin, STREAMED_HEAD, body())
        assert response.status == 400 and await response.read() == b"no!"
        response.close()
        assert len(pulled) < 200 and not client.idle.get(origin)  # a half-sent request's connection is not reused


async def test_a_failing_body_closes_the_connection_and_is_raised_as_it_is():
    closed = asyncio.get_running_loop().create_future()

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        closed.set_result(await reader.read())  # read to EOF: the client closed its side

    async def body():
        yield b"first"
        raise LookupError("the upload went over its limit")

    client = Client(2, 5, write_timeout=5)
    async with raw_server(handle) as origin:
        with pytest.raises(LookupError):
            await client.request_streamed(origin, STREAMED_HEAD, body())
        assert (await asyncio.wait_for(closed, 10)).startswith(b"5\r\nfirst\r\n")
        assert not (await closed).endswith(b"0\r\n\r\n")


def dripping(start: bytes):
    """An answer that sends `start`, then a byte each 50 ms (for 5 s at most)."""
    async def answer(reader, writer):
        writer.write(start)
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(0.05)
    return answer


SMALL = Limits(head_bytes=4096, head_seconds=0.5, body_bytes=64 * 1024)


async def test_a_head_past_its_bound_is_cut_there_and_a_dripped_head_in_time():
    async def endless(reader, writer):  # a head that never ends: the client must close it
        writer.write(b"HTTP/1.1 200 OK\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(10_000):
                writer.write(b"x-more: and-more\r\n" * 100)
                await writer.drain()

    client = Client(1, 5, limits=SMALL)
    for answer, error, words in ((endless, HeadTooLarge, "upstream.max_header_bytes of 4096"),
                                 (dripping(b"HTTP/1.1 200 OK\r\nx-drip: "), HeadTimedOut, "upstream.header_seconds of 0.5 s")):
        script = Script(lambda n, req, answer=answer: answer)
        async with script.running() as url:
            started = asyncio.get_running_loop().time()
            with pytest.raises(error, match=words) as raised:
                await client.request(*post(url))
            assert raised.value.bound and asyncio.get_running_loop().time() - started < 3
            await asyncio.wait_for(script.gone.wait(), 5)  # the connection was closed


async def test_a_body_read_whole_is_bounded_and_get_in_total_time():
    big = b"a" * (SMALL.body_bytes + 1)
    client = Client(1, 1, limits=SMALL)
    script = Script(lambda n, req: ok(big) if n == 1 else b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    + b"%x\r\n%b\r\n" % (len(big), big) + b"0\r\n\r\n")
    async with script.running() as url:
        for _ in range(2):  # told by content-length, then counted as a chunked body arrives
            response = await client.request(*post(url))
            with pytest.raises(TooLarge, match="upstream.max_body_bytes of 65536") as raised:
                await response.read(SMALL.body_bytes)
            assert raised.value.kind == TOO_LARGE

    async with Script(lambda n, req: dripping(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")).running() as url:
        with pytest.raises(ReadTimedOut, match="in all"):  # each byte comes within the read timeout
            await client.get(f"{url}/metrics", timeout=0.5)
    async with Script(lambda n, req: ok(big)).running() as url:
        with pytest.raises(TooLarge, match="routing.scrape.max_bytes"):
            await client.get(f"{url}/metrics", timeout=1, max_bytes=1024, limit_name="routing.scrape.max_bytes")
