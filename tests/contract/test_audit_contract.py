"""The audit log's contract, on the embedded SQLite file and on real Redis (one server, Cluster): events from
several writers (gateway replicas) read back newest first, filtered and paged; retention by age and by count;
no secret kept."""

from __future__ import annotations

import pytest

from policies.audit import Actor, Audit, AuditQuery
from policies.audit.redis import RedisAudit
from policies.audit.sqlite import SQLiteAudit
from policies.config.audit import AuditSettings
from tests.support.redis_fixtures import redis_prefix, redis_server, shared_stores  # noqa: F401

DAY = 86400
T0 = 1_800_000_000.0
ALICE = Actor("alice", "https://idp.example", "admin", address="10.0.0.7")
BOB = Actor("bob", "llm-gateway", "operator", address="10.0.0.8")


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "redis", "redis-cluster"])
async def logs(request, tmp_path):
    """Two audit logs on one store, as two gateway replicas hold, each with its own clock."""
    stores = shared_stores(request, tmp_path)
    opened = [SQLiteAudit(store.path) if request.param == "sqlite" else RedisAudit(store) for store in stores]
    yield opened
    for log, store in zip(opened, stores):
        await log.close()
        await store.close()


async def test_events_read_back_filtered_and_paged(logs):
    clock = Clock()
    one, two = (Audit(log, AuditSettings(), clock=clock) for log in logs)
    for i in range(12):
        clock.now = T0 + i
        writer, actor = (one, ALICE) if i % 2 == 0 else (two, BOB)
        await writer.record(actor, "key.create" if i < 6 else "key.revoke", f"key{i % 3}",
                            {"name": f"k{i}", "key": "sk-gw-SECRET", "hash": "h", "limits": {"secret": "x"}})
    page = await one.query(AuditQuery(limit=5))
    assert [e.at for e in page.events] == [T0 + i for i in (11, 10, 9, 8, 7)] and page.next == page.events[-1].id
    seen = [e.id for e in page.events]
    while page.next:
        page = await two.query(AuditQuery(limit=5, before=page.next))
        seen += [e.id for e in page.events]
    assert len(seen) == len(set(seen)) == 12 and seen == sorted(seen, reverse=True)

    alice = (await one.query(AuditQuery(actor="alice"))).events
    assert len(alice) == 6 and {(e.issuer, e.role, e.address) for e in alice} == {("https://idp.example", "admin",
                                                                                  "10.0.0.7")}
    assert [e.at for e in (await one.query(AuditQuery(action="key.revoke", target="key0"))).events] == \
        [T0 + 9, T0 + 6]
    assert [e.at for e in (await two.query(AuditQuery(since=T0 + 3, until=T0 + 5))).events] == [T0 + 4, T0 + 3]
    assert (await one.query(AuditQuery(actor="carol"))).events == []
    event = (await one.query(AuditQuery(limit=1))).events[0]
    assert event.changes == {"name": "k11", "limits": {}}  # key, hash and secret fields are never kept
    assert "SECRET" not in event.model_dump_json()


async def test_retention_by_age_and_by_count(logs):
    clock = Clock()
    audit = Audit(logs[0], AuditSettings(retention_days=30, max_events=100), clock=clock)
    for i in range(5):
        clock.now = T0 - 40 * DAY + i  # older than the retention once time moves on
        await audit.record(ALICE, "key.create", f"old{i}")
    clock.now = T0
    await audit.record(ALICE, "key.create", "new")
    assert [e.target for e in (await audit.query(AuditQuery())).events] == ["new"]
    for i in range(130):
        clock.now = T0 + 1 + i
        await audit.record(BOB, "key.update", f"k{i}")
    kept = []
    page = await audit.query(AuditQuery(limit=500))
    kept += page.events
    assert len(kept) == 100 and kept[0].target == "k129" and kept[-1].target == "k30" and page.next is None


async def test_a_store_that_fails_costs_the_event_not_the_act(tmp_path, caplog):
    """The act is done when it is recorded: a store that cannot take the event is counted and logged, the log
    line of the event is written anyway, and nothing is raised to the admin route."""
    import json
    import logging

    caplog.set_level(logging.INFO, "llm_gateway.audit")
    failures: list[str] = []
    broken = SQLiteAudit(str(tmp_path / "missing-dir" / "gateway.db"))
    await Audit(broken, AuditSettings(), failures.append).record(ALICE, "key.revoke", "k1", {"revoked": True})
    await broken.close()
    assert failures == ["audit"]
    lines = [json.loads(r.getMessage())["audit"] for r in caplog.records if r.levelno == logging.INFO]
    assert [(e["action"], e["actor"], e["changes"]) for e in lines] == [("key.revoke", "alice", {"revoked": True})]
    assert any("not stored" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
