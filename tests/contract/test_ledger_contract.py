"""The cost ledger's contract, on the embedded SQLite file and on real Redis (one server, Sentinel, Cluster):
flushes from several writers add into the same rows, a read returns a window (all keys or one), and buckets
older than the retention are gone."""

from __future__ import annotations

import time

import pytest

from policies.ledger.redis import RedisLedger
from policies.ledger.sqlite import SQLiteLedger
from policies.ledger.sums import BUSY, COST, COUNTERS, PROMPT, REQUESTS, Batch, Row, Sums
from tests.support.redis_fixtures import redis_prefix, redis_server, shared_stores  # noqa: F401

BUCKET = 60
HOUR = 3600


@pytest.fixture(params=["sqlite", "redis", "redis-sentinel", "redis-cluster"])
async def ledgers(request, tmp_path):
    """Two ledgers on one store, as two gateway replicas (or one gateway before and after a restart) hold."""
    stores = shared_stores(request, tmp_path)
    opened = [SQLiteLedger(store.path) if request.param == "sqlite" else RedisLedger(store, BUCKET)
              for store in stores]
    yield opened
    for ledger, store in zip(opened, stores):
        await ledger.close()
        await store.close()


def batch(rows: dict) -> Batch:
    return Batch(rows, {})


def values(requests=0, prompt=0, cost=0.0) -> list[float]:
    out = [0.0] * len(COUNTERS)
    out[REQUESTS], out[PROMPT], out[COST] = requests, prompt, cost
    return out


async def test_flushes_add_up_and_a_window_reads_them(ledgers):
    one, two = ledgers
    now = time.time()
    b = int(now // BUCKET) * BUCKET - 5 * BUCKET
    mine, theirs = Row(b, "m", "gpu-0", "k1", "owned"), Row(b, "m", "rented:p", "k2", "rented")
    await one.add(batch({mine: values(2, 100), theirs: values(1, 7, 0.0042)}), HOUR, now)
    await two.add(batch({mine: values(3, 50)}), HOUR, now)  # another replica, the same row
    await one.add(batch({Row(b + BUCKET, "m", "gpu-0", "k1", "owned"): values(1, 1)}), HOUR, now)

    rows = dict(await two.read(b, b + BUCKET))  # the window holds one bucket
    assert set(rows) == {mine, theirs}
    assert rows[mine][REQUESTS] == 5 and rows[mine][PROMPT] == 150
    assert rows[theirs][COST] == pytest.approx(0.0042)
    assert {r for r, _ in await one.read(b, b + 2 * BUCKET, key_id="k1")} == \
        {mine, Row(b + BUCKET, "m", "gpu-0", "k1", "owned")}


async def test_buckets_past_the_retention_are_gone(ledgers):
    one, _ = ledgers
    now = time.time()
    recent = int(now // BUCKET) * BUCKET
    old = recent - 3 * HOUR
    await one.add(batch({Row(old, "m", "gpu-0", "k", "owned"): values(1, 10)}), 4 * HOUR, now)
    assert [r.bucket for r, _ in await one.read(old, now)] == [old]  # inside a retention of 4 hours: kept
    await one.add(batch({Row(old, "m", "gpu-0", "k", "owned"): values(1, 10),
                   Row(recent, "m", "gpu-0", "k", "owned"): values(1, 10)}), 2 * HOUR, now)
    assert [r.bucket for r, _ in await one.read(old, now + BUCKET)] == [recent]  # 2 hours: the old one went


@pytest.mark.parametrize("ledgers", ["redis", "redis-sentinel", "redis-cluster"], indirect=True)
async def test_busy_time_is_the_union_of_every_replicas_calls(ledgers):
    """Three replicas' calls to one backend, overlapping each other: the report's busy time is their union,
    not the sum of each replica's own union (which counts the overlaps twice or three times)."""
    start = int(time.time() // BUCKET) * BUCKET - 3 * BUCKET
    calls = {0: [(1.0, 9.0), (30.0, 31.5)], 1: [(5.0, 12.0), (50.0, 70.5)], 2: [(2.0, 4.0), (29.0, 30.5)]}
    union = 11.0 + 2.5 + 20.5  # [1, 12], [29, 31.5], [50, 70.5] (the last crosses into the next bucket)
    for replica, spans in calls.items():
        sums = Sums(BUCKET)
        for a, b in spans:
            sums.in_flight("m", "gpu-0", start + a, start + b)
        await ledgers[replica % 2].add(sums.take(), HOUR, time.time())
    rows = await ledgers[0].read(start, start + 2 * BUCKET)
    busy = {row.bucket - start: values[BUSY] for row, values in rows if not row.served}
    assert busy == {0: pytest.approx(60 - 50 + 11 + 2.5, abs=0.02), BUCKET: pytest.approx(10.5, abs=0.02)}
    assert sum(busy.values()) == pytest.approx(union, abs=0.04)
