"""gateway/http/corked.py: a turn's writes reach the socket together, in order, and nothing is lost or sent twice
at close, half-close or abort."""

from __future__ import annotations

import asyncio

from gateway.http.corked import CorkedTransport


class Socket(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[bytes]] = []
        self.closing = False
        self.events: list[str] = []

    def write(self, data) -> None:
        self.calls.append([bytes(data)])

    def writelines(self, list_of_data) -> None:
        self.calls.append([bytes(d) for d in list_of_data])

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def write_eof(self) -> None:
        self.events.append("eof")

    def abort(self) -> None:
        self.events.append("abort")
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 7


async def turn() -> None:
    await asyncio.sleep(0)


def test_the_writes_of_one_turn_go_out_in_one_call_in_order_and_the_next_turns_in_another():
    async def run() -> None:
        socket = Socket()
        corked = CorkedTransport(socket, asyncio.get_running_loop())
        corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
        corked.write(b"")  # nothing to send: not a piece
        corked.writelines([b"5\r\nhello\r\n", b"0\r\n\r\n"])
        assert socket.calls == [] and corked.get_write_buffer_size() == 7 + 19 + 10 + 5
        await turn()
        assert socket.calls == [[b"HTTP/1.1 200 OK\r\n\r\n", b"5\r\nhello\r\n", b"0\r\n\r\n"]]
        corked.write(b"next")
        await turn()
        assert socket.calls[1:] == [[b"next"]] and corked.get_write_buffer_size() == 7
    asyncio.run(run())


def test_close_and_half_close_send_what_is_held_first_and_abort_drops_it():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        closed, half, aborted = Socket(), Socket(), Socket()
        corked = CorkedTransport(closed, loop)
        corked.write(b"answer")
        corked.close()
        assert closed.calls == [[b"answer"]] and closed.events == ["close"]
        corked = CorkedTransport(half, loop)
        corked.write(b"refused")
        corked.write_eof()
        assert half.calls == [[b"refused"]] and half.events == ["eof"]
        corked = CorkedTransport(aborted, loop)
        corked.write(b"never")
        corked.abort()
        await turn()  # the flushes scheduled by the first writes run: nothing is held, nothing is sent again
        assert closed.calls == [[b"answer"]] and half.calls == [[b"refused"]]
        assert aborted.calls == [] and aborted.events == ["abort"]
    asyncio.run(run())


def test_what_a_turn_held_is_dropped_once_the_connection_is_closing():
    async def run() -> None:
        socket = Socket()
        corked = CorkedTransport(socket, asyncio.get_running_loop())
        corked.write(b"late")
        socket.closing = True  # the peer went away in the same turn
        await turn()
        assert socket.calls == []
    asyncio.run(run())
