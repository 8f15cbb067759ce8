"""The audit log in Redis, beside the keys, shared by every gateway replica:

    {prefix}audit   sorted set   member: the event as JSON, score: its time (unix seconds)

One key, so the layout works unchanged on Redis Cluster. A write is one MULTI: the event, the events older
than retention (ZREMRANGEBYSCORE) and those beyond max_events, oldest first (ZREMRANGEBYRANK). A query walks
the set newest first in batches and filters; one query reads at most SCAN_LIMIT events, and when it stops
there it returns a `next` cursor, so a filter that matches rarely costs bounded work per page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies.audit.log import AuditEvent, AuditPage, AuditQuery
from policies.config.audit import AuditSettings

if TYPE_CHECKING:
    from policies.store.redis import RedisStore

BATCH = 200
SCAN_LIMIT = 10_000


class RedisAudit:
    def __init__(self, store: RedisStore) -> None:
        self.store = store  # a RedisStore: its connection pool and its failure handling (`guard`)
        self.name = f"{store.prefix}audit"

    async def add(self, event: AuditEvent, settings: AuditSettings) -> None:
        cutoff = event.at - settings.retention_days * 86400
        async with self.store.guard("audit add"), self.store.client.pipeline(transaction=True) as pipe:
            pipe.zadd(self.name, {event.model_dump_json(): event.at})
            pipe.zremrangebyscore(self.name, "-inf", f"({cutoff}")
            pipe.zremrangebyrank(self.name, 0, -(settings.max_events + 1))
            await pipe.execute()

    async def query(self, query: AuditQuery) -> AuditPage:
        # inclusive bounds here; query.matches then drops the events at `until` and those not before `before`
        tops = [query.until] if query.until is not None else []
        if query.before is not None:  # ids start with the event's microseconds
            tops.append(int(query.before[:17]) / 1_000_000)
        top = repr(min(tops)) if tops else "+inf"
        bottom = "-inf" if query.since is None else repr(query.since)
        events: list[AuditEvent] = []
        offset = scanned = 0
        last: AuditEvent | None = None
        while scanned < SCAN_LIMIT:
            async with self.store.guard("audit query"):
                batch = await self.store.client.zrevrangebyscore(self.name, top, bottom, start=offset, num=BATCH)
            offset += len(batch)
            for raw in batch:
                scanned += 1
                event = AuditEvent.model_validate_json(raw)  # type: ignore[arg-type]  # members are bytes
                last = event
                if query.matches(event):
                    if len(events) == query.limit:
                        return AuditPage(events=events, next=events[-1].id)
                    events.append(event)
            if len(batch) < BATCH:
                return AuditPage(events=events, next=None)
        # read as far as one query may: the caller continues after the last event looked at
        return AuditPage(events=events, next=last.id if last is not None else None)

    async def close(self) -> None:
        pass  # the pool belongs to the store
