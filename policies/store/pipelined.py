"""The hot scripts' fast path to Redis: one connection per server, every command of a loop turn in one write.

Why not redis-py for these: `make bench` (docs/benchmarks.md, "The Redis store") showed its per-call cost in
the gateway's process as the whole gap between the embedded and the Redis store. Measured on the bench
machine, 64 concurrent callers: one rate-limit admission script cost 85 us of CPU through redis-py's asyncio
client (hiredis parser, pooled connections) and 20 us here, where the commands the request path issues in one
event-loop turn travel as one write on one connection and replies come back in order (hiredis parses them).
Only non-blocking script calls take this path (EVALSHA, and SCRIPT LOAD on a NOSCRIPT reply); everything else,
and every call this path cannot place, stays on redis-py: TLS, a Cluster, and any call that meets a redirect
(MOVED/ASK) or a broken connection, where redis-py's own client re-reads the topology and retries.

Failover: a connection that breaks fails its pending calls with ConnectionError (the store's guard maps that to
StoreUnavailable) and the next call connects afresh, asking Sentinel for the primary again; a READONLY reply
(a demoted primary) drops the connection the same way. A server that stops answering is dropped once a call
has waited `timeout` for a reply.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import cast

import hiredis
from redis import exceptions as redis_errors
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool


Arg = str | bytes | int | float  # what a command's arguments may be: each goes on the wire as its text


# a script's reply is Lua numbers, strings (decoded as UTF-8), arrays of them or nil: `object` until `row`,
# `integers` or `integer` checked its shape (an error reply arrives as an exception, which evalsha raises)
def row(reply: object, size: int | None = None) -> list[int | str]:
    """A script's reply of numbers and strings (`size` of them when given); a malformed one is redis-py's
    InvalidResponse, a RedisError as any other the store maps."""
    if not isinstance(reply, list) or (size is not None and len(reply) != size) \
            or not all(isinstance(v, (int, str)) for v in reply):
        raise redis_errors.InvalidResponse(f"a script answered a {type(reply).__name__} of the wrong shape")
    return reply


def integer(reply: object) -> int:
    """A script's integer reply (a number, or a string of one)."""
    if isinstance(reply, (int, str)) and not isinstance(reply, bool):
        try:
            return int(reply)
        except ValueError:
            pass
    raise redis_errors.InvalidResponse(f"a script answered a {type(reply).__name__}, not an integer")


def integers(reply: object, size: int) -> list[int]:
    """A script's reply of `size` integers."""
    return [integer(v) for v in row(reply, size)]


class Wire(asyncio.Protocol):
    """One connection: commands queued in a loop turn are written together; replies resolve futures in order."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(encoding="utf-8", errors="replace",
                                     replyError=redis_errors.ResponseError,
                                     protocolError=redis_errors.InvalidResponse)
        self.waiting: collections.deque[asyncio.Future[object]] = collections.deque()
        self.out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.quiet_since = 0.0  # loop time of the last reply, or of the first call sent while none was pending

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        self.quiet_since = asyncio.get_running_loop().time()
        while self.waiting:
            reply = self.reader.gets()
            if reply is False:
                return
            future = self.waiting.popleft()
            if not future.done():  # a caller that gave up (its deadline) leaves its reply unread
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for future in self.waiting:
            if not future.done():
                future.set_exception(redis_errors.ConnectionError("redis connection lost"))
        self.waiting.clear()

    def send(self, *args: Arg) -> asyncio.Future[object]:
        loop = asyncio.get_running_loop()
        if self.closed:
            raise redis_errors.ConnectionError("redis connection closed")
        if not self.out:
            loop.call_soon(self.flush)
        if not self.waiting:
            self.quiet_since = loop.time()
        self.out.append(pack(args))
        future: asyncio.Future[object] = loop.create_future()
        self.waiting.append(future)
        return future

    def flush(self) -> None:
        if self.out and not self.closed and self.transport is not None:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # connection_lost fails what is pending
        self.closed = True


def pack(args: tuple[Arg, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif not isinstance(arg, bytes):
            arg = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


class Pipelined:
    """Script calls over one `Wire` per server; `None` from `for_client` when the client's set-up is one this
    path does not serve (TLS, unknown pool), so the caller keeps redis-py."""

    def __init__(self, client: Redis | RedisCluster, timeout: float) -> None:
        self.client = client
        self.timeout = timeout
        self.cluster = isinstance(client, RedisCluster)
        # by a Cluster node's address; else one wire under None: the server's, or Sentinel's primary's, found
        # without asking Sentinel where the primary is while its connection lasts
        self.wires: dict[tuple[str, int] | None, Wire] = {}
        self.connecting: dict[tuple[str, int] | None, asyncio.Future[Wire]] = {}
        self.auth: dict[str, str | int] = {}  # username, password and db, where the client has them

    @classmethod
    def for_client(cls, client: Redis | RedisCluster, timeout: float) -> Pipelined | None:
        if isinstance(client, RedisCluster):
            kwargs = client.connection_kwargs
        else:
            kwargs = client.connection_pool.connection_kwargs
        if kwargs.get("ssl") or "ssl_context" in kwargs or kwargs.get("unix_socket_path") or "path" in kwargs:
            return None
        if not isinstance(client, RedisCluster) and "connection_class" in kwargs:
            return None
        fast = cls(client, timeout)
        fast.auth = {k: v for k in ("username", "password", "db") if isinstance(v := kwargs.get(k), (str, int))}
        return fast

    async def address(self, keys: list[str]) -> tuple[str, int]:
        if isinstance(self.client, RedisCluster):
            if not self.client.nodes_manager.slots_cache:
                await self.client.initialize()
            node = self.client.get_node_from_key(keys[0])
            assert node is not None  # every slot has a node once the slots are known
            return node.host, int(node.port)
        pool = self.client.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            return cast(tuple[str, int], tuple(await pool.get_master_address()))
        kwargs = pool.connection_kwargs
        return kwargs.get("host", "localhost"), int(kwargs.get("port", 6379))

    async def wire(self, keys: list[str]) -> Wire:
        where = await self.address(keys) if self.cluster else None
        wire = self.wires.get(where)
        if wire is not None and not wire.closed:
            return wire
        pending = self.connecting.get(where)
        if pending is None:
            pending = asyncio.ensure_future(self.connect(where, keys))
            self.connecting[where] = pending
            pending.add_done_callback(lambda _: self.connecting.pop(where, None))
        return await asyncio.shield(pending)

    async def connect(self, where: tuple[str, int] | None, keys: list[str]) -> Wire:
        address = where or await self.address(keys)  # the primary now, by Sentinel's word
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                _, wire = await loop.create_connection(Wire, *address)
                hello = []
                if self.auth.get("password"):
                    user = self.auth.get("username")
                    hello.append(wire.send("AUTH", *((user,) if user else ()), self.auth["password"]))
                if self.auth.get("db") and not self.cluster:
                    hello.append(wire.send("SELECT", self.auth["db"]))
                for reply in await asyncio.gather(*hello):
                    if isinstance(reply, Exception):
                        wire.abort()
                        raise redis_errors.AuthenticationError("redis refused the connection's set-up")
        except (OSError, TimeoutError) as exc:
            raise redis_errors.ConnectionError(f"redis connect failed ({type(exc).__name__})") from None
        self.wires[where] = wire
        return wire

    async def evalsha(self, sha: str, source: str, keys: list[str], args: list[Arg]) -> object:
        """The script's reply; redis-py's exception types for errors, so callers map them as before.
        Raises Redirected when the key's slot moved (the caller retries through redis-py)."""
        wire = await self.wire(keys)
        reply = await self.reply(wire, wire.send("EVALSHA", sha, len(keys), *keys, *args))
        if isinstance(reply, redis_errors.ResponseError) and str(reply).startswith("NOSCRIPT"):
            await self.reply(wire, wire.send("SCRIPT", "LOAD", source))
            reply = await self.reply(wire, wire.send("EVALSHA", sha, len(keys), *keys, *args))
        if isinstance(reply, redis_errors.ResponseError):
            raise self.error(wire, str(reply))
        return reply

    async def reply(self, wire: Wire, future: asyncio.Future[object]) -> object:
        try:
            return await future
        except asyncio.CancelledError:
            # the caller's deadline: if the server has been silent that long, it is gone for every caller
            if wire.waiting and asyncio.get_running_loop().time() - wire.quiet_since >= self.timeout:
                wire.abort()
            raise

    @staticmethod
    def error(wire: Wire, message: str) -> Exception:
        code = message.split(" ", 1)[0]
        if code in ("MOVED", "ASK"):
            return Redirected(message)
        if code in ("READONLY", "MASTERDOWN", "LOADING"):
            wire.abort()  # a demoted primary or a server not ready: the next call looks for the primary again
        return cast(Exception, BaseParser.parse_error(message))

    async def close(self) -> None:
        for wire in self.wires.values():
            wire.abort()
        self.wires.clear()
        for pending in list(self.connecting.values()):
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


class Redirected(Exception):
    """The key's slot lives elsewhere now: redis-py's cluster client re-reads the map and retries."""


class Script:
    """A registered script: `await script(keys=..., args=...)`, through `Pipelined` where it can go, else (and
    after a redirect or a broken connection) through redis-py's own Script object."""

    def __init__(self, client: Redis | RedisCluster, fast: Pipelined | None, source: str) -> None:
        self.slow = client.register_script(source)
        self.fast = fast
        self.source = source
        self.sha = self.slow.sha
        self.script = source  # as redis-py's Script names it

    async def __call__(self, keys: list[str], args: list[Arg]) -> object:
        """The script's reply, unchecked: read it with `row`, `integers` or `integer`."""
        if self.fast is None:
            return await self.slow(keys=keys, args=args)
        try:
            return await self.fast.evalsha(self.sha, self.source, keys, args)
        except (Redirected, redis_errors.ConnectionError):
            return await self.slow(keys=keys, args=args)  # redis-py's retry finds the new node or primary
