"""A TCP proxy on 127.0.0.1 that can freeze its connections or go down, for tests of what a client does when
the network fails it.

`freeze()`: every connection open now stops forwarding bytes both ways without closing (a dropped NAT entry, a
dead node: the client's socket just reads nothing); connections opened later work. `down()`: the listener and
every connection close (the server is gone: connections are refused); `up()` listens again on the same port.
`refuse_new(keep)`: the listener closes, and every connection but those whose request starts with `keep`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class Link:
    writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]
    head: bytearray = field(default_factory=bytearray)  # the client's first bytes (its request line)
    frozen: bool = False


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, port: int) -> None:
        self.target = (target_host, target_port)
        self.port = port
        self.links: list[Link] = []
        self.requests: list[str] = []  # the request targets clients sent, in order
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def down(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
        self.close_links()

    def refuse_new(self, keep: bytes) -> None:
        """Stop listening (new connections are refused) and close every open connection but those whose first
        request line starts with `keep`: an exchange under way goes on, an idle pooled one cannot be reused."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for link in [link for link in self.links if not link.head.startswith(keep)]:
            for writer in link.writers:
                writer.close()
            self.links.remove(link)

    def freeze(self) -> int:
        """Freeze every open connection; how many."""
        live = [link for link in self.links if not link.writers[0].is_closing()]
        for link in live:
            link.frozen = True
        return len(live)

    def open_watches(self) -> int:
        """Open, unfrozen connections whose request is a watch."""
        return sum(1 for link in self.links if not link.frozen and not link.writers[0].is_closing()
                   and b"watch=true" in link.head)

    def close_links(self) -> None:
        for link in self.links:
            for writer in link.writers:
                writer.close()
        self.links.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        link = Link((writer, up_writer))
        self.links.append(link)
        for task in (self._pump(reader, up_writer, link, self.requests), self._pump(up_reader, writer, link, None)):
            t = asyncio.create_task(task)
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link,
                    requests: list[str] | None):
        """Forward bytes one way; `requests` (from the client only) collects the request targets."""
        try:
            while data := await reader.read(65536):
                if requests is not None:
                    if len(link.head) < 4096:
                        link.head += data[: 4096 - len(link.head)]
                    requests += [m.decode() for m in re.findall(rb"^[A-Z]+ (\S+) HTTP/1\.1\r$", data, re.M)]
                while link.frozen:  # hold the bytes: nothing passes, nothing closes
                    await asyncio.sleep(0.05)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            if not link.frozen:
                writer.close()


@contextlib.asynccontextmanager
async def tcp_proxy(target_host: str, target_port: int, port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port, port)
    await proxy.up()
    try:
        yield proxy
    finally:
        await proxy.down()
        for task in list(proxy.tasks):
            task.cancel()
