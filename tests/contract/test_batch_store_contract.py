"""The Batch API's store contract, on the embedded SQLite file and on real Redis (one server and a Cluster): two
stores on one backing store stand for two gateway replicas (or one before and after a restart). Files and batches
are their owner's alone; lines claimed at once by several runners never overlap and none is left out; a result
counts only under its claim; an expired claim goes to another runner; a batch's record changes only from the
version that was read; a key's files are counted against its bounds atomically, whoever writes them, and
expired files are found through their expiry."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from policies.batches.redis import RedisBatches
from policies.batches.sqlite import SQLiteBatches
from policies.store import open_store
from tests.support.redis_fixtures import redis_prefix, redis_server  # noqa: F401


@pytest.fixture(params=["sqlite", "redis", "redis-cluster"])
async def pair(request, tmp_path):
    if request.param == "sqlite":
        stores = [open_store("sqlite", path=str(tmp_path / "gateway.db")) for _ in range(2)]
        opened = [SQLiteBatches(store.path) for store in stores]
    else:
        server, prefix = request.getfixturevalue("redis_server"), request.getfixturevalue("redis_prefix")
        stores = [open_store("redis", url=server.url, prefix=prefix) for _ in range(2)]
        opened = [RedisBatches(store) for store in stores]
    yield opened
    for batches, store in zip(opened, stores):
        await batches.close()
        await store.close()


def a_file(file_id: str, owner: str, size: int = 10, expires_at: float | None = None) -> dict:
    return {"id": file_id, "object": "file", "purpose": "batch", "created_at": 1, "_created": time.time(),
            "_owner": owner, "bytes": size, "expires_at": expires_at}


def a_batch(batch_id: str, owner: str = "k1") -> dict:
    return {"id": batch_id, "object": "batch", "status": "validating", "created_at": 1, "_created": time.time(),
            "_owner": owner, "_v": 0}


async def test_files_are_their_owners_alone(pair):
    one, two = pair
    await one.put_file(a_file("file-a", "k1"))
    await one.put_file(a_file("file-b", "k1"))
    await one.put_file(a_file("file-c", "k2"))
    assert (await two.get_file("k1", "file-a"))["id"] == "file-a"
    assert await two.get_file("k2", "file-a") is None
    assert [f["id"] for f in await two.list_files("k1")] == ["file-b", "file-a"]
    assert not await two.delete_file("k2", "file-a")
    assert await two.delete_file("k1", "file-a")
    assert await one.get_file("k1", "file-a") is None
    assert [f["id"] for f in await one.list_files("k1")] == ["file-b"]


async def test_runners_claiming_at_once_share_every_line_exactly_once(pair):
    one, two = pair
    await one.create_batch(a_batch("batch_x"), 300)
    assert await two.get_batch("k2", "batch_x") is None and (await two.get_batch(None, "batch_x"))["id"] == "batch_x"
    now = time.time()
    claimed: dict[str, list[int]] = {"a": [], "b": [], "c": [], "d": []}

    async def runner(store, name: str) -> None:
        while lines := await store.claim("batch_x", name, 7, now + 60, now):
            claimed[name] += lines
            for n in lines:
                assert await store.complete("batch_x", name, n, n % 10 != 0, f'{{"line": {n}}}'.encode())

    await asyncio.gather(runner(one, "a"), runner(two, "b"), runner(one, "c"), runner(two, "d"))
    every = sorted(n for lines in claimed.values() for n in lines)
    assert every == list(range(300))
    assert sum(1 for lines in claimed.values() if lines) >= 2  # they did share
    assert tuple(await one.progress("batch_x")) == (0, 0, 270, 30)
    results = await two.results("batch_x")
    assert [n for n, _, _ in results] == list(range(300))
    assert results[10] == (10, False, b'{"line": 10}') and results[11] == (11, True, b'{"line": 11}')
    assert await one.results("batch_x", 10, 13) == results[10:13]  # a page, as the output files are written
    assert await two.results("batch_x", 298, 400) == results[298:] and await one.results("batch_x", 5, 5) == []


async def test_a_result_counts_only_under_its_claim_and_an_expired_claim_moves(pair):
    one, two = pair
    await one.create_batch(a_batch("batch_y"), 3)
    now = time.time()
    assert await one.claim("batch_y", "dead", 2, now + 5, now) == [0, 1]
    assert await two.claim("batch_y", "live", 5, now + 60, now) == [2]
    assert await two.claim("batch_y", "live", 5, now + 60, now) == []  # the dead runner's are not expired yet
    await one.renew("batch_y", "dead", [0], now + 100)
    later = now + 10  # the dead runner's claim on line 1 expired; line 0 was renewed
    assert await two.claim("batch_y", "live", 5, later + 60, later) == [1]
    assert not await one.complete("batch_y", "dead", 1, True, b"late")  # no longer its line
    assert await two.complete("batch_y", "live", 1, True, b"first")
    assert not await two.complete("batch_y", "live", 1, True, b"again")  # recorded once
    await two.release("batch_y", "live", 2)
    assert tuple(await one.progress("batch_y")) == (1, 1, 1, 0)
    assert await one.claim("batch_y", "other", 5, now + 60, now) == [2]
    assert await two.drop_pending("batch_y") == 0
    await one.release("batch_y", "other", 2)
    assert await two.drop_pending("batch_y") == 1
    assert tuple(await one.progress("batch_y")) == (0, 1, 1, 0)
    assert await one.results("batch_y") == [(1, True, b"first")]


async def test_a_batch_changes_only_from_the_version_read(pair):
    one, two = pair
    await one.create_batch(a_batch("batch_z"), 1)
    mine, theirs = await one.get_batch(None, "batch_z"), await two.get_batch(None, "batch_z")
    assert [b["id"] for b in await two.open_batches()] == ["batch_z"]
    assert await one.swap({**mine, "status": "in_progress"})
    assert not await two.swap({**theirs, "status": "cancelling"})
    now = await two.get_batch("k1", "batch_z")
    assert now["status"] == "in_progress" and now["_v"] == 1
    assert await two.swap({**now, "status": "completed"})
    assert await one.open_batches() == []
    assert [b["id"] for b in await one.list_batches("k1")] == ["batch_z"] and await one.list_batches("k2") == []


async def test_uploads_racing_on_two_replicas_never_pass_a_keys_bounds(pair):
    one, two = pair
    results = await asyncio.gather(*(store.put_file(a_file(f"file-{n}", "k1"), max_files=5, max_bytes=10**6)
                                     for n, store in enumerate([one, two] * 10)))
    assert sorted(r or "stored" for r in results) == ["files"] * 15 + ["stored"] * 5
    assert await one.usage("k1") == (5, 50) and len(await two.list_files("k1")) == 5
    assert await two.put_file(a_file("file-x", "k2"), max_files=5, max_bytes=10**6) is None  # another key's own
    assert await one.usage("k2") == (1, 10)
    assert await one.put_file(a_file("file-big", "k2", size=91), max_files=5, max_bytes=100) == "bytes"
    assert await two.get_file("k2", "file-big") is None and await one.usage("k2") == (1, 10)
    assert await one.put_file(a_file("file-out", "k1", size=500)) is None  # an output: past the bounds, still kept
    assert await two.usage("k1") == (6, 550)
    assert await two.put_file(a_file("file-out", "k1", size=300)) is None  # the same output written again
    assert await one.usage("k1") == (6, 350)
    assert await two.delete_file("k1", "file-out") and not await one.delete_file("k1", "file-out")
    assert await one.usage("k1") == (5, 50)
    assert await one.put_file(a_file("file-y", "k1"), max_files=5, max_bytes=10**6) == "files"
    assert await one.delete_file("k1", (await two.list_files("k1"))[-1]["id"])
    assert await two.put_file(a_file("file-y", "k1"), max_files=5, max_bytes=10**6) is None


async def test_expired_files_are_found_earliest_first(pair):
    one, two = pair
    now = time.time()
    await one.put_file(a_file("file-later", "k1", expires_at=now + 3600))
    await one.put_file(a_file("file-b", "k2", expires_at=now - 5))
    await two.put_file(a_file("file-a", "k1", expires_at=now - 10))
    await two.put_file(a_file("file-c", "k1", expires_at=now - 1))
    assert await one.expired_files(now, 10) == [("k1", "file-a"), ("k2", "file-b"), ("k1", "file-c")]
    assert await two.expired_files(now, 2) == [("k1", "file-a"), ("k2", "file-b")]
    assert await one.delete_file("k2", "file-b")
    assert await two.expired_files(now, 10) == [("k1", "file-a"), ("k1", "file-c")]
    assert await two.expired_files(now + 7200, 10) == [("k1", "file-a"), ("k1", "file-c"), ("k1", "file-later")]


@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])  # SQLite kept its files in one table: nothing moved
async def test_files_stored_the_old_way_are_found_counted_and_deleted_by_their_owner_alone(kind, request):
    """Files as 9872d88 and before kept them in Redis (`P file:<id>`, `P files:<owner>`, on slots of their own)
    are adopted under the owner's hash tag when first read, listed, counted or deleted: an upgrade loses none."""
    server, prefix = request.getfixturevalue("redis_server"), request.getfixturevalue("redis_prefix")
    stores = [open_store("redis", url=server.url, prefix=prefix) for _ in range(2)]
    one, two = (RedisBatches(store) for store in stores)
    try:
        await old_files_adopted(one, two)
    finally:
        for store in stores:
            await store.close()


async def old_files_adopted(one: RedisBatches, two: RedisBatches) -> None:
    client, p = one.store.client, one.p
    for file_id, owner, size in (("file-old1", "k1", 10), ("file-old2", "k1", 20), ("file-old3", "k2", 40)):
        record = {**a_file(file_id, owner, size), "expires_at": None}
        del record["expires_at"]  # the old records had none
        await client.set(f"{p}file:{file_id}", orjson.dumps(record).decode())
        await client.zadd(f"{p}files:{owner}", {file_id: record["_created"]})
    await client.zadd(f"{p}files:k1", {"file-gone": 1.0})  # an index entry whose record was already deleted
    assert await two.get_file("k2", "file-old1") is None  # another key's file stays out of reach
    assert (await two.get_file("k1", "file-old1"))["bytes"] == 10  # read: adopted
    assert await client.get(f"{p}file:file-old1") is None
    assert sorted(f["id"] for f in await one.list_files("k1")) == ["file-old1", "file-old2"]
    assert await client.exists(f"{p}files:k1") == 0
    assert await one.usage("k1") == (2, 30)
    assert await one.put_file(a_file("file-new", "k2"), max_files=1, max_bytes=10**6) == "files"  # old3 counts
    assert await two.delete_file("k2", "file-old3") and await one.get_file("k2", "file-old3") is None
    assert await one.usage("k2") == (0, 0)
    assert await client.get(f"{p}file:file-old3") is None
