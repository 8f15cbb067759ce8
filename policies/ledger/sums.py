"""Finished calls summed in memory per time bucket, until the next flush writes them to the ledger.

A row is (bucket start, model, backend, key id, served) -> counters. Calls add requests, tokens, queue wait and
rented cost to their key's row. The backend's time goes to a row of its own (key "" and served ""):
`held_seconds`, the sum of every call's time in flight (divided by the bucket's length it is the average in
flight, to set against the backend's cap), and `busy_seconds`, the time with at least one call in flight.

The parts of busy time each call added are also kept as intervals per bucket (`busy`), so a store shared by
several gateway replicas can take the union of theirs (policies/ledger/redis.py): each replica's sum alone
would count twice the time two replicas' calls overlapped on one backend.

Busy time is the union of the calls' intervals, computed exactly as they finish: a call ends at "now", so it
ends after every interval seen so far and can only overlap the newest of them; only the part of it that no
earlier call covered is added. The merged spans that stay apart are kept (the newest 64 per backend), so a
call that outlives 64 idle gaps is the only approximation. Nothing is ever subtracted, so a bucket already
written stays right.

This runs for every finished call: rows are plain tuples until `take` (off the request path) names them.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

# estimated_requests: calls whose tokens (and so cost) are the gateway's estimate, not the upstream's usage (a
# rented stream that ended without usage is charged its estimate, never zero)
COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "queue_seconds", "rented_cost", "busy_seconds",
            "held_seconds", "estimated_requests")
REQUESTS, PROMPT, COMPLETION, QUEUE, COST, BUSY, HELD, ESTIMATED = range(len(COUNTERS))
KEEP_SPANS = 64


class Row(NamedTuple):
    bucket: int  # unix seconds at which the bucket starts
    model: str
    backend: str
    key_id: str  # "" on a backend's time row
    served: str  # "owned", "rented" or "batch" (a batch's line on an owned backend); "" on a backend's time row


RowKey = tuple[int, str, str, str, str]  # a Row as a plain tuple: cheaper to make on every call


class Sums:
    """Counters per row since the last `take`; bounded by the rows a flush interval can touch."""

    def __init__(self, bucket_seconds: int) -> None:
        self.bucket_seconds = bucket_seconds
        self.rows: dict[RowKey, list[float]] = {}  # (bucket, model, backend, key id, served) -> COUNTERS
        self.spans: dict[tuple[str, str], list[list[float]]] = {}  # (model, backend) -> disjoint [start, end]
        self.busy: dict[tuple[int, str, str], list[tuple[float, float]]] = {}  # (bucket, model, backend) -> added

    def counters(self, row: RowKey) -> list[float]:
        values = self.rows.get(row)
        if values is None:
            values = self.rows[row] = [0.0] * len(COUNTERS)
        return values

    def bucket(self, when: float) -> int:
        return int(when // self.bucket_seconds) * self.bucket_seconds

    def call(self, when: float, model: str, backend: str, key_id: str, rented: bool, prompt: int, completion: int,
             queue_seconds: float, cost: float, estimated: bool = False, batch: bool = False) -> None:
        served = "rented" if rented else "batch" if batch else "owned"
        values = self.counters((self.bucket(when), model, backend, key_id, served))
        values[REQUESTS] += 1
        if estimated:
            values[ESTIMATED] += 1
        values[PROMPT] += prompt
        values[COMPLETION] += completion
        values[QUEUE] += queue_seconds
        values[COST] += cost

    def in_flight(self, model: str, backend: str, start: float, end: float) -> None:
        """A call held the backend from `start` to `end` (wall seconds; `end` no earlier than any before)."""
        if end <= start:
            return
        self.spread(model, backend, HELD, start, end)
        spans = self.spans.get((model, backend))
        if spans is None:
            spans = self.spans[(model, backend)] = []
        cursor, merged = end, start
        while spans and spans[-1][1] >= start:  # newest first: add the gaps between them, then before them
            old_start, old_end = spans.pop()
            if old_end < cursor:
                self.spread(model, backend, BUSY, old_end, cursor)
            if old_start < cursor:
                cursor = old_start
            if old_start < merged:
                merged = old_start
        if cursor > start:
            self.spread(model, backend, BUSY, start, cursor)
        spans.append([merged, end])
        if len(spans) > KEEP_SPANS:
            del spans[0]

    def spread(self, model: str, backend: str, index: int, start: float, end: float) -> None:
        """Add the part of [start, end] in each bucket to the backend's time row of that bucket."""
        size = self.bucket_seconds
        first = int(start // size) * size
        if end <= first + size:  # the usual case: one bucket (inlined: this runs for every call)
            row = (first, model, backend, "", "")
            values = self.rows.get(row)
            if values is None:
                values = self.rows[row] = [0.0] * len(COUNTERS)
            values[index] += end - start
            if index == BUSY:
                self.busy.setdefault((first, model, backend), []).append((start, end))
            return
        for bucket in range(first, int(math.ceil(end / size)) * size, size):
            overlap = min(end, bucket + size) - max(start, bucket)
            if overlap > 0:
                self.counters((bucket, model, backend, "", ""))[index] += overlap
                if index == BUSY:
                    self.busy.setdefault((bucket, model, backend), []).append(
                        (max(start, bucket), min(end, bucket + size)))

    def take(self) -> Batch:
        rows, self.rows = self.rows, {}
        busy, self.busy = self.busy, {}
        return Batch({Row(*row): values for row, values in rows.items()}, busy)

    def put_back(self, batch: Batch, limit: int) -> bool:
        """Merge a batch the store refused back in, unless that would pass `limit` rows and busy intervals (then
        it is lost)."""
        if len(self.rows) + len(batch.rows) + sum(map(len, (*self.busy.values(), *batch.busy.values()))) > limit:
            return False
        for row, values in batch.rows.items():
            mine = self.counters(row)
            for i, value in enumerate(values):
                mine[i] += value
        for where, pieces in batch.busy.items():
            self.busy.setdefault(where, []).extend(pieces)
        return True


class Batch(NamedTuple):
    """What one flush writes: the rows' counters, and the busy intervals each backend's rows added."""

    rows: dict[Row, list[float]]
    busy: dict[tuple[int, str, str], list[tuple[float, float]]]


class Ledger(Protocol):
    """Where flushed sums go and the report reads them: the SQLite file's table, or Redis hashes."""

    async def add(self, batch: Batch, retention_seconds: float, now: float) -> None: ...

    async def read(self, since: float, until: float, key_id: str | None = None) -> list[tuple[Row, list[float]]]: ...

    async def close(self) -> None: ...
