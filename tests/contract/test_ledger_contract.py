"""The cost ledger's contract, on the embedded SQLite file and on real Redis (one server, Sentinel, Cluster):
flushes from several writers add into the same rows, a read returns a window (all keys or one), and buckets
older than the retention are gone."""

from __future__ import annotations

import time

import pytest

from policies.ledger.record import open_ledger
from policies.ledger.sums import COST, COUNTERS, PROMPT, REQUESTS, Row
from policies.store import open_store
from tests.support.redis_fixtures import redis_prefix, redis_server  # noqa: F401

BUCKET = 60
HOUR = 3600


@pytest.fixture(params=["sqlite", "redis", "redis-sentinel", "redis-cluster"])
async def ledgers(request, tmp_path):
    """Two ledgers on one store, as two gateway replicas (or one gateway before and after a restart) hold."""
    if request.param == "sqlite":
        stores = [open_store("sqlite", path=str(tmp_path / "gateway.db")) for _ in range(2)]
    else:
        server, prefix = request.getfixturevalue("redis_server"), request.getfixturevalue("redis_prefix")
        stores = [open_store("redis", url=server.url, prefix=prefix) for _ in range(2)]
    opened = [open_ledger(store, BUCKET) for store in stores]
    yield opened
    for ledger, store in zip(opened, stores):
        await ledger.close()
        await store.close()


def values(requests=0, prompt=0, cost=0.0) -> list[float]:
    out = [0.0] * len(COUNTERS)
    out[REQUESTS], out[PROMPT], out[COST] = requests, prompt, cost
    return out


async def test_flushes_add_up_and_a_window_reads_them(ledgers):
    one, two = ledgers
    now = time.time()
    b = int(now // BUCKET) * BUCKET - 5 * BUCKET
    mine, theirs = Row(b, "m", "gpu-0", "k1", "owned"), Row(b, "m", "rented:p", "k2", "rented")
    await one.add({mine: values(2, 100), theirs: values(1, 7, 0.0042)}, HOUR, now)
    await two.add({mine: values(3, 50)}, HOUR, now)  # another replica, the same row
    await one.add({Row(b + BUCKET, "m", "gpu-0", "k1", "owned"): values(1, 1)}, HOUR, now)

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
    await one.add({Row(old, "m", "gpu-0", "k", "owned"): values(1, 10)}, 4 * HOUR, now)
    assert [r.bucket for r, _ in await one.read(old, now)] == [old]  # inside a retention of 4 hours: kept
    await one.add({Row(old, "m", "gpu-0", "k", "owned"): values(1, 10),
                   Row(recent, "m", "gpu-0", "k", "owned"): values(1, 10)}, 2 * HOUR, now)
    assert [r.bucket for r, _ in await one.read(old, now + BUCKET)] == [recent]  # 2 hours: the old one went
