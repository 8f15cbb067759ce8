"""A client connection's writes gathered per turn of the event loop, so that a response goes out in one system call.

uvicorn writes a response in pieces: its head on `http.response.start`, each body message as it comes, and a
chunked response's last chunk on the final message. Each piece was one `write()` to the socket: three for a
stream that arrives in one read (as the benchmark's does), two for every plain JSON answer. A system call
costs more than all of the gateway's own work on a piece, so `CorkedTransport` keeps the pieces written in one
turn of the loop and hands them to the socket together (one `writev`) at the start of the next turn, before
the loop waits for anything. A streamed event is thus never held back: what the app writes before it next
waits (for the upstream, for the client) goes out then, in order. Closing, half-closing or aborting the
connection first sends (or, for an abort, drops) what is held. Flow control is the socket's own: what is held
is at most one turn's writes, and the socket's buffer pauses the app as before.

The cost is latency at low load: an answer leaves when its turn ends, after whatever else the turn runs. One
request at a time on the benchmark, that was 30-60 us at the median (within the 0.5 ms that the gateway may add);
at 64 concurrent the turn's answers leave together and the gateway spends 6-15% less CPU per request
(docs/benchmarks-history.md, 2026-12-07). Flushing as soon as a response is whole kept the latency and lost the
whole gain: the system calls saved were not what it was; answering a turn's requests together is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class CorkedTransport(asyncio.Transport):
    """A socket transport whose writes go out once per event-loop turn; everything else is the socket's."""

    __slots__ = ("_held", "_loop", "_socket")

    def __init__(self, socket: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._socket = socket
        self._loop = loop
        self._held: list[bytes | bytearray | memoryview] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Send what this turn wrote (nothing if the connection is already closing: the socket would drop it)."""
        held, self._held = self._held, []
        if held and not self._socket.is_closing():
            if len(held) == 1:
                self._socket.write(held[0])
            else:
                self._socket.writelines(held)

    def held_bytes(self) -> int:
        return sum(len(data) for data in self._held)

    def close(self) -> None:
        self.flush()
        self._socket.close()

    def write_eof(self) -> None:
        self.flush()
        self._socket.write_eof()

    def abort(self) -> None:
        self._held = []
        self._socket.abort()

    def can_write_eof(self) -> bool:
        return self._socket.can_write_eof()

    def is_closing(self) -> bool:
        return self._socket.is_closing()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._socket.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._socket.pause_reading()

    def resume_reading(self) -> None:
        self._socket.resume_reading()

    def is_reading(self) -> bool:
        return self._socket.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.flush()
        self._socket.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._socket.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self._socket.get_write_buffer_size() + self.held_bytes()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._socket.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._socket.set_write_buffer_limits(high, low)
