"""The shared store: Redis, so every gateway replica sees the same keys and usage.

Layout, with P = `prefix` (default "llmgw:"); the braces are literal, a Redis Cluster hash tag:

    {P}key:<id>             string   the KeyRecord as JSON
    {P}keys                 zset     id -> created_at: the index list_keys walks, already in order
    {P}last_used            zset     id -> latest touch_key time (ZADD GT), kept apart so a touch is one command
    {P}team:<name>          string   the TeamRecord as JSON
    {P}teams                zset     name -> 0: the index list_teams walks, in name order
    P secret:<name>         string   32 random bytes in hex, set once (SET NX): see shared_secret
    P usage:<id>            hash     "{model}:{field}" -> count, field one of USAGE_FIELDS (model names may
                                     hold ':'; the field is what follows the last one)

The same names on one server, behind Sentinel or in a Cluster (see redis_client for reaching each). Every key
record and both indexes share the hash tag `{P}`, so they sit in one Cluster slot and the writes that must
move together (record + index) still run as one Lua script; a usage hash is one key, moved by one MULTI.
A dead or hung server, or a failover in progress, must cost a request a bounded wait, not a stuck worker:
sockets have connect and read timeouts, a failed command is retried once on a fresh connection (which is how
the pool finds a restarted server or a promoted replica), and an overall deadline caps each call. Any of that
failing is StoreUnavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from typing import cast

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from policies.keys import KeyRecord
from policies.store.base import (
    SECRET_BYTES,
    KeyExists,
    KeyNotFound,
    StoreError,
    StoreUnavailable,
    TeamExists,
    TeamNotFound,
    empty_usage,
    usage_increments,
    with_last_used,
)
from policies.store.key_events import KeyEvents
from policies.store.pipelined import Pipelined, Script
from policies.store.redis_client import TLSFiles, connect
from policies.teams import TeamRecord

DEFAULT_PREFIX = "llmgw:"

# KEYS: record, index. ARGV: json, id, created_at, NX (create: 0 if the id is taken) or XX (replace: 0 if
# there is no record). 1 when written, and then the index has the id.
WRITE = """
if redis.call('SET', KEYS[1], ARGV[1], ARGV[4]) then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
  return 1
end
return 0
"""
# KEYS: record, index. ARGV: name. 1 when there was a record to delete.
DELETE = """
if redis.call('DEL', KEYS[1]) == 1 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 1
end
return 0
"""
# KEYS: record, last_used. ARGV: when, id. Touching a missing key leaves nothing behind.
TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('ZADD', KEYS[2], 'GT', ARGV[1], ARGV[2])
end
return 0
"""

UNREACHABLE = (
    redis_errors.ConnectionError,  # refused, reset, LOADING, pool exhausted
    redis_errors.TimeoutError,
    redis_errors.ReadOnlyError,  # a replica mid-failover
    redis_errors.ClusterDownError,  # a Cluster whose slots are not all served yet
    redis_errors.TryAgainError,  # a Cluster slot being moved
    redis_errors.MasterDownError,
    TimeoutError,  # our own deadline
    OSError,
)
# What the event loop raises for a write on a connection the server already closed (uvloop: RuntimeError
# "the handler is closed"; CPython 3.12+: TypeError or AttributeError), which redis-py's asyncio client lets
# through instead of a ConnectionError, past its retries (redis-py issue 4287).
LOOP_WRITE_ERRORS = (RuntimeError, TypeError, AttributeError)
SENDER = os.path.join("redis", "asyncio", "connection.py")


def broke_while_sending(exc: BaseException) -> bool:
    """The error came out of redis-py writing a command to its connection: a connection the server (or a
    failover, or anything in between) closed. Only that: the same types raised anywhere else are bugs."""
    frame = exc.__traceback__
    while frame is not None:
        code = frame.tb_frame.f_code
        if code.co_name == "_send_packed_command" and code.co_filename.endswith(SENDER):
            return True
        frame = frame.tb_next
    return False


class RedisStore:
    """Store on Redis: one server, a Sentinel-watched primary or a Cluster (every key under one prefix)."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = 1.0,
        deadline: float = 2.5,
        max_connections: int = 64,
        password: str | None = None,
        sentinel_password: str | None = None,
        tls_files: TLSFiles | None = None,
    ) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError("the redis prefix must not hold braces: the store adds its own hash tags")
        self.prefix = prefix
        self._deadline = deadline
        self._closed = False
        self._redis = connect(url, password=password, sentinel_password=sentinel_password, tls_files=tls_files,
                              timeout=timeout, deadline=deadline, max_connections=max_connections)
        # A Cluster client's pools refuse a connection past the bound rather than wait for one: callers queue
        # here instead, as they do in the standalone and Sentinel pools, and the wait counts against the deadline.
        self._turns = asyncio.Semaphore(max_connections) if self.cluster else contextlib.nullcontext()
        self._fast = Pipelined.for_client(self._redis, timeout)
        self._write = self._redis.register_script(WRITE)
        self._touch = self._redis.register_script(TOUCH)
        self._delete = self._redis.register_script(DELETE)
        # key changes reach the other replicas' auth caches at once (a Cluster client has no pub/sub here:
        # its replicas follow within auth.cache_seconds)
        self.key_events = None if self.cluster else KeyEvents(self._redis, prefix)

    @property
    def client(self) -> Redis | RedisCluster:
        """The client (one server, Sentinel's primary or a Cluster), for other shared state kept beside the
        keys (rate limits). A script run through it must keep its keys in one hash slot (see `tag`)."""
        return self._redis

    def script(self, source: str) -> Script:
        """A script for the request path: its calls share one pipelined connection per server (see
        policies/store/pipelined.py); `await script(keys=[...], args=[...])` as with redis-py's."""
        return Script(self._redis, self._fast, source)

    @property
    def cluster(self) -> bool:
        """Keys in different hash slots may live on different servers: no script may span them."""
        return isinstance(self._redis, RedisCluster)

    def _key(self, key_id: str) -> str:
        return f"{{{self.prefix}}}key:{key_id}"

    @property
    def _index(self) -> str:
        return f"{{{self.prefix}}}keys"

    @property
    def _last_used(self) -> str:
        return f"{{{self.prefix}}}last_used"

    def _team(self, name: str) -> str:
        return f"{{{self.prefix}}}team:{name}"

    @property
    def _teams(self) -> str:
        return f"{{{self.prefix}}}teams"

    def _secret(self, name: str) -> str:
        return f"{self.prefix}secret:{name}"

    def _usage(self, key_id: str) -> str:
        return f"{self.prefix}usage:{key_id}"

    @contextlib.asynccontextmanager
    async def guard(self, op: str) -> AsyncIterator[None]:
        """Bound the call by the deadline and turn every redis failure into a store error that echoes nothing."""
        if self._closed:
            raise StoreError(f"redis {op}: the store is closed")
        try:
            async with asyncio.timeout(self._deadline), self._turns:
                yield
        except UNREACHABLE as exc:
            raise StoreUnavailable(f"redis {op}: server unreachable ({type(exc).__name__})") from exc
        except redis_errors.RedisError as exc:
            raise StoreError(f"redis {op} failed ({type(exc).__name__})") from exc
        except LOOP_WRITE_ERRORS as exc:
            if not broke_while_sending(exc):
                raise
            # redis-py has already dropped that connection: the next call opens a fresh one
            raise StoreUnavailable(f"redis {op}: server unreachable (connection closed)") from exc

    async def create_key(self, record: KeyRecord) -> None:
        if not await self.write(record, "NX", "create_key"):
            raise KeyExists(f"key {record.id} already exists")

    async def write(self, record: KeyRecord, mode: str, op: str) -> bool:
        """The record and its index entry in one step; `mode` NX creates only, XX replaces only."""
        async with self.guard(op):
            return bool(await self._write(keys=[self._key(record.id), self._index],
                                          args=[record.model_dump_json(), record.id, repr(record.created_at), mode]))

    async def get_key(self, key_id: str) -> KeyRecord | None:
        async with self.guard("get_key"), self._redis.pipeline(transaction=False) as pipe:
            pipe.get(self._key(key_id))
            pipe.zscore(self._last_used, key_id)
            raw, touched = await pipe.execute()
        return None if raw is None else with_last_used(KeyRecord.model_validate_json(raw), touched)

    async def list_keys(self) -> list[KeyRecord]:
        async with self.guard("list_keys"):
            ids = cast(list[str], await self._redis.zrange(self._index, 0, -1))  # replies decoded: text
            if not ids:
                return []
            # two calls, not a pipeline: a Cluster client refuses MGET in one (the keys share a slot, so it works)
            raws = await self._redis.mget([self._key(i) for i in ids])
            touched = await self._redis.zmscore(self._last_used, ids)
        return [
            with_last_used(KeyRecord.model_validate_json(raw), when)
            for raw, when in zip(raws, touched)
            if raw is not None  # deleted by hand between the two reads
        ]

    async def put_key(self, record: KeyRecord) -> None:
        if not await self.write(record, "XX", "put_key"):
            raise KeyNotFound(f"key {record.id} not found")

    async def write_team(self, team: TeamRecord, mode: str, op: str) -> bool:
        async with self.guard(op):
            return bool(await self._write(keys=[self._team(team.name), self._teams],
                                          args=[team.model_dump_json(), team.name, "0", mode]))

    async def create_team(self, team: TeamRecord) -> None:
        if not await self.write_team(team, "NX", "create_team"):
            raise TeamExists(f"team {team.name} already exists")

    async def get_team(self, name: str) -> TeamRecord | None:
        async with self.guard("get_team"):
            raw = await self._redis.get(self._team(name))
        return None if raw is None else TeamRecord.model_validate_json(raw)

    async def list_teams(self) -> list[TeamRecord]:
        async with self.guard("list_teams"):
            names = await self._redis.zrange(self._teams, 0, -1)  # equal scores: in name order
            raws = await self._redis.mget([self._team(str(n)) for n in names]) if names else []
        return [TeamRecord.model_validate_json(raw) for raw in raws if raw is not None]

    async def put_team(self, team: TeamRecord) -> None:
        if not await self.write_team(team, "XX", "put_team"):
            raise TeamNotFound(f"team {team.name} not found")

    async def delete_team(self, name: str) -> None:
        async with self.guard("delete_team"):
            deleted = await self._delete(keys=[self._team(name), self._teams], args=[name])
        if not deleted:
            raise TeamNotFound(f"team {name} not found")

    async def touch_key(self, key_id: str, when: float) -> None:
        async with self.guard("touch_key"):
            await self._touch(keys=[self._key(key_id), self._last_used], args=[repr(when), key_id])

    async def add_usage(
        self,
        key_id: str,
        model: str,
        *,
        requests: int,
        prompt_tokens: int,
        completion_tokens: int,
        rented: bool = False,
    ) -> None:
        deltas = usage_increments(requests, prompt_tokens, completion_tokens, rented)
        name = self._usage(key_id)
        async with self.guard("add_usage"), self._redis.pipeline(transaction=True) as pipe:
            for field, value in deltas.items():
                pipe.hincrby(name, f"{model}:{field}", value)
            await pipe.execute()

    async def usage(self, key_id: str) -> dict[str, dict[str, int]]:
        async with self.guard("usage"):
            counters = cast(dict[str, str], await self._redis.hgetall(self._usage(key_id)))
        totals: dict[str, dict[str, int]] = {}
        for name, value in counters.items():
            model, _, field = name.rpartition(":")
            totals.setdefault(model, empty_usage())[field] = int(value)
        return dict(sorted(totals.items()))

    async def shared_secret(self, name: str) -> bytes:
        fresh = secrets.token_hex(SECRET_BYTES)  # as text: the client decodes every answer as UTF-8
        async with self.guard("shared_secret"):
            await self._redis.set(self._secret(name), fresh, nx=True)
            return bytes.fromhex(cast(str, await self._redis.get(self._secret(name))))

    async def ping(self) -> None:
        async with self.guard("ping"):
            await self._redis.ping()

    async def close(self) -> None:
        self._closed = True
        if self._fast is not None:
            await self._fast.close()
        with contextlib.suppress(Exception):
            await self._redis.aclose()
