"""The Batch API's state in Redis, beside the keys, so every gateway replica runs the same batches.

    {P f:<owner>}file:<id>       string  a file's record (JSON)
    {P f:<owner>}files           zset    id -> _created
    {P f:<owner>}usage           hash    files, bytes: what the owner's files count against its bounds
    P files:expiring             zset    "<id> <owner>" -> expires_at
    P file:<id>, P files:<owner>         a file as 9872d88 and before stored it, moved under its owner's hash
                                         tag when first read, listed or deleted (`adopt`)
    P batch:<id>                 string  a batch's record (JSON)
    P batches:<owner>            zset    id -> _created
    P batches:open               zset    id -> _created: batches not in a final state
    {P b:<id>}pending            list    line numbers not yet claimed
    {P b:<id>}claims             zset    line -> claim expiry (unix seconds)
    {P b:<id>}runner             hash    line -> the runner that holds its claim
    {P b:<id>}results            hash    line -> "1" + output line, or "0" + error line
    {P b:<id>}counts             hash    ok, failed, dropped

A batch's line keys share one hash tag, so each claim, renewal and result is one Lua script, atomic on one server
and in a Cluster alike: a claim first returns expired claims to pending (their runner died), a result is
written only by the runner that still holds the line, and the claim ends in the same step. A key's files share
one hash tag too, so a file's record and its owner's count change in one script (PUT_FILE, DELETE_FILE). The
expiry index is written before the record and cleared after it, so it never misses a stored file (an entry
whose record is gone is dropped by the sweep).
"""

from __future__ import annotations

from typing import Any, cast

import orjson

from policies.batches.store import OPEN, Progress, Usage
from policies.store.redis import RedisStore

CLAIM = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4])
for _, l in ipairs(expired) do
  redis.call('ZREM', KEYS[2], l)
  redis.call('HDEL', KEYS[3], l)
  redis.call('LPUSH', KEYS[1], l)
end
if tonumber(ARGV[2]) < 1 then return {} end
local lines = redis.call('LPOP', KEYS[1], ARGV[2])
if not lines then return {} end
for _, l in ipairs(lines) do
  redis.call('ZADD', KEYS[2], ARGV[3], l)
  redis.call('HSET', KEYS[3], l, ARGV[1])
end
return lines
"""
RENEW = """
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1] then redis.call('ZADD', KEYS[1], 'XX', ARGV[2], ARGV[i]) end
end
return 0
"""
RELEASE = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('LPUSH', KEYS[1], ARGV[1])
return 1
"""
COMPLETE = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
return 1
"""
DROP = """
local n = redis.call('LLEN', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('HINCRBY', KEYS[2], 'dropped', n)
return n
"""
# KEYS: the batch's record. ARGV: the version read, the new record. (Its own key: no other key shares its slot.)
SWAP = """
local raw = redis.call('GET', KEYS[1])
if not raw or cjson.decode(raw)['_v'] ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""
# KEYS: the record, the owner's index, its usage. ARGV: id, record, _created, bytes, max files, max bytes (-1: none)
PUT_FILE = """
local old = redis.call('GET', KEYS[1])
local files, size = 1, tonumber(ARGV[4])
if old then files, size = 0, size - (cjson.decode(old)['bytes'] or 0) end
local now = redis.call('HMGET', KEYS[3], 'files', 'bytes')
files, size = (tonumber(now[1]) or 0) + files, (tonumber(now[2]) or 0) + size
if tonumber(ARGV[5]) >= 0 and files > tonumber(ARGV[5]) then return 'files' end
if tonumber(ARGV[6]) >= 0 and size > tonumber(ARGV[6]) then return 'bytes' end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[3], 'files', files, 'bytes', size)
return ''
"""
# KEYS: the record, the owner's index, its usage. ARGV: id
DELETE_FILE = """
local old = redis.call('GET', KEYS[1])
if not old then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'files', -1)
redis.call('HINCRBY', KEYS[3], 'bytes', -(cjson.decode(old)['bytes'] or 0))
return 1
"""
CHUNK = 10_000  # line numbers pushed per command when a batch is created


class RedisBatches:
    """The Batch API's store on Redis (see the module's docstring). The store's client decodes every answer
    (`decode_responses`): what redis-py types as `bytes | str` is a str here, and is cast to it."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store  # a RedisStore: its connection pool and its failure handling (`guard`)
        self.p = store.prefix
        client = store.client
        self._claim, self._renew = client.register_script(CLAIM), client.register_script(RENEW)
        self._release, self._complete = client.register_script(RELEASE), client.register_script(COMPLETE)
        self._drop, self._swap = client.register_script(DROP), client.register_script(SWAP)
        self._put_file, self._delete_file = client.register_script(PUT_FILE), client.register_script(DELETE_FILE)
        self.expiring = f"{self.p}files:expiring"

    def lines(self, batch_id: str, part: str) -> str:
        return f"{{{self.p}b:{batch_id}}}{part}"

    def owned(self, owner: str, part: str) -> str:
        return f"{{{self.p}f:{owner}}}{part}"

    def file_keys(self, owner: str, file_id: str) -> list[str]:
        return [self.owned(owner, f"file:{file_id}"), self.owned(owner, "files"), self.owned(owner, "usage")]

    async def put_file(self, record: dict[str, Any], max_files: int | None = None,
                       max_bytes: int | None = None) -> str | None:
        file_id, owner = record["id"], record["_owner"]
        member = f"{file_id} {owner}"
        await self.adopt_all(owner)  # what the key stored before counts against its bounds too
        async with self.store.guard("put_file"):
            if record.get("expires_at") is not None:
                await self.store.client.zadd(self.expiring, {member: record["expires_at"]})
            refused = await self._put_file(keys=self.file_keys(owner, file_id), args=[
                file_id, orjson.dumps(record).decode(), repr(record["_created"]), record["bytes"],
                -1 if max_files is None else max_files, -1 if max_bytes is None else max_bytes])
            if refused:
                await self.store.client.zrem(self.expiring, member)
        return refused or None

    async def usage(self, owner: str) -> Usage:
        async with self.store.guard("usage"):
            files, size = await self.store.client.hmget(self.owned(owner, "usage"), ["files", "bytes"])
        return Usage(int(files or 0), int(size or 0))

    async def expired_files(self, now: float, limit: int) -> list[tuple[str, str]]:
        async with self.store.guard("expired_files"):
            members = cast(list[str], await self.store.client.zrangebyscore(
                self.expiring, "-inf", f"({now!r}", start=0, num=limit))
        return [(owner, file_id) for file_id, _, owner in (m.partition(" ") for m in members)]

    async def get_file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        async with self.store.guard("get_file"):
            raw = await self.store.client.get(self.owned(owner, f"file:{file_id}"))
        return orjson.loads(raw) if raw else await self.adopt(owner, file_id)

    async def adopt(self, owner: str, file_id: str) -> dict[str, Any] | None:
        """A file stored before files lived under their owner's hash tag (one key per file, one index per owner,
        on other slots): written the new way (counted in the owner's usage, never refused: it was already
        stored), then the old keys dropped, so a crash between leaves a copy, never nothing; two replicas
        adopting at once write it twice, counted once. None if there is no such file of this owner. It has no
        expiry: it was made under none."""
        client = self.store.client
        async with self.store.guard("adopt_file"):
            raw = cast(str | None, await client.get(f"{self.p}file:{file_id}"))
            record = orjson.loads(raw) if raw else None
            if raw is None or not isinstance(record, dict) or record.get("_owner") != owner:
                return None
            await self._put_file(keys=self.file_keys(owner, file_id), args=[
                file_id, raw, repr(record.get("_created", 0)), int(record.get("bytes") or 0), -1, -1])
            await client.delete(f"{self.p}file:{file_id}")
            await client.zrem(f"{self.p}files:{owner}", file_id)
        return record

    async def adopt_all(self, owner: str) -> None:
        async with self.store.guard("adopt_file"):
            old = cast(list[str], await self.store.client.zrange(f"{self.p}files:{owner}", 0, -1))
        for file_id in old:
            if await self.adopt(owner, file_id) is None:  # its record was gone: only the index entry was left
                async with self.store.guard("adopt_file"):
                    await self.store.client.zrem(f"{self.p}files:{owner}", file_id)

    async def _records(self, op: str, index: str, prefix: str) -> list[dict[str, Any]]:
        async with self.store.guard(op):
            ids = cast(list[str], await self.store.client.zrevrange(index, 0, -1))
            raws = [await self.store.client.get(f"{prefix}{i}") for i in ids]
        return [orjson.loads(r) for r in raws if r]

    async def list_files(self, owner: str) -> list[dict[str, Any]]:
        await self.adopt_all(owner)
        return await self._records("list_files", self.owned(owner, "files"), self.owned(owner, "file:"))

    async def delete_file(self, owner: str, file_id: str) -> bool:
        async with self.store.guard("delete_file"):
            deleted = await self._delete_file(keys=self.file_keys(owner, file_id), args=[file_id])
            await self.store.client.zrem(self.expiring, f"{file_id} {owner}")
        if not deleted and await self.adopt(owner, file_id) is not None:
            async with self.store.guard("delete_file"):
                deleted = await self._delete_file(keys=self.file_keys(owner, file_id), args=[file_id])
        return bool(deleted)

    async def create_batch(self, record: dict[str, Any], lines: int) -> None:
        batch_id = record["id"]
        client = self.store.client
        for start in range(0, lines, CHUNK):  # the lines first: a batch is seen once all of them are there
            async with self.store.guard("create_batch"):
                await client.rpush(self.lines(batch_id, "pending"), *range(start, min(lines, start + CHUNK)))
        async with self.store.guard("create_batch"), client.pipeline(transaction=False) as pipe:
            pipe.set(f"{self.p}batch:{batch_id}", orjson.dumps(record).decode())
            pipe.zadd(f"{self.p}batches:{record['_owner']}", {batch_id: record["_created"]})
            pipe.zadd(f"{self.p}batches:open", {batch_id: record["_created"]})
            await pipe.execute()

    async def get_batch(self, owner: str | None, batch_id: str) -> dict[str, Any] | None:
        async with self.store.guard("get_batch"):
            raw = await self.store.client.get(f"{self.p}batch:{batch_id}")
        record = orjson.loads(raw) if raw else None
        return record if record is not None and (owner is None or record.get("_owner") == owner) else None

    async def list_batches(self, owner: str) -> list[dict[str, Any]]:
        return await self._records("list_batches", f"{self.p}batches:{owner}", f"{self.p}batch:")

    async def swap(self, record: dict[str, Any]) -> bool:
        stored = {**record, "_v": record["_v"] + 1}
        batch_id = record["id"]
        async with self.store.guard("swap"):
            swapped = await self._swap(keys=[f"{self.p}batch:{batch_id}"],
                                       args=[record["_v"], orjson.dumps(stored).decode()])
        if swapped and record["status"] not in OPEN:
            async with self.store.guard("swap"):
                await self.store.client.zrem(f"{self.p}batches:open", batch_id)
        return bool(swapped)

    async def open_batches(self) -> list[dict[str, Any]]:
        records = await self._records("open_batches", f"{self.p}batches:open", f"{self.p}batch:")
        return [r for r in reversed(records) if r["status"] in OPEN]

    async def claim(self, batch_id: str, runner: str, count: int, until: float, now: float) -> list[int]:
        keys = [self.lines(batch_id, part) for part in ("pending", "claims", "runner")]
        async with self.store.guard("claim"):
            lines = await self._claim(keys=keys, args=[runner, count, repr(until), repr(now)])
        return [int(n) for n in lines]

    async def renew(self, batch_id: str, runner: str, lines: list[int], until: float) -> None:
        if lines:
            async with self.store.guard("renew"):
                await self._renew(keys=[self.lines(batch_id, "claims"), self.lines(batch_id, "runner")],
                                  args=[runner, repr(until), *lines])

    async def release(self, batch_id: str, runner: str, line: int) -> None:
        keys = [self.lines(batch_id, part) for part in ("pending", "claims", "runner")]
        async with self.store.guard("release"):
            await self._release(keys=keys, args=[line, runner])

    async def complete(self, batch_id: str, runner: str, line: int, ok: bool, result: bytes) -> bool:
        keys = [self.lines(batch_id, part) for part in ("claims", "runner", "results", "counts")]
        value = ("1" if ok else "0") + result.decode()
        async with self.store.guard("complete"):
            return bool(await self._complete(keys=keys, args=[line, runner, value, "ok" if ok else "failed"]))

    async def drop_pending(self, batch_id: str) -> int:
        async with self.store.guard("drop_pending"):
            return int(await self._drop(keys=[self.lines(batch_id, "pending"), self.lines(batch_id, "counts")]))

    async def progress(self, batch_id: str) -> Progress:
        async with self.store.guard("progress"), self.store.client.pipeline(transaction=False) as pipe:
            pipe.llen(self.lines(batch_id, "pending"))
            pipe.zcard(self.lines(batch_id, "claims"))
            pipe.hgetall(self.lines(batch_id, "counts"))
            pending, claimed, counts = await pipe.execute()
        return Progress(int(pending), int(claimed), int(counts.get("ok", 0)), int(counts.get("failed", 0)))

    async def results(self, batch_id: str, first: int = 0, end: int | None = None) -> list[tuple[int, bool, bytes]]:
        key = self.lines(batch_id, "results")
        async with self.store.guard("results"):
            if end is None:
                found = cast(dict[str, str], await self.store.client.hgetall(key))
            else:
                numbers = range(first, end)
                values = cast(list[str | None], await self.store.client.hmget(key, [str(n) for n in numbers])
                              if numbers else [])
                found = {str(n): v for n, v in zip(numbers, values) if v is not None}
        return sorted((int(n), v[0] == "1", v[1:].encode()) for n, v in found.items() if int(n) >= first)

    async def close(self) -> None:
        pass  # the pool belongs to the store
