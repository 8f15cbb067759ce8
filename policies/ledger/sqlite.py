"""The ledger in the embedded SQLite file (the one that holds keys and usage), in a table of its own.

It has its own connection on its own worker thread (policies/store/sqlite_thread.py), so a report's read
never waits behind the request path's writes in one queue. A flush is one transaction of upserts, so a crash
leaves whole flushes or none.

Budgeted calls write their reservations beside it before they leave (policies/store/sqlite_holds.py): the flush
that writes a settled call's figures deletes its reservation in the same transaction, and `settle_orphans` turns
the reservations a dead process left into ledger rows at their reserved bound (marked estimated), so neither
the ledger nor the budgets that start from it lose a crash's last flush interval of budgeted spend.
"""

from __future__ import annotations

import sqlite3

from policies.ledger.sums import COMPLETION, COST, COUNTERS, ESTIMATED, PROMPT, REQUESTS, Batch, Row
from policies.store.sqlite_holds import FIELDS as HOLD_FIELDS
from policies.store.sqlite_holds import SQLiteHolds, prepare_holds
from policies.store.sqlite_thread import SQLiteThread

DIMENSIONS = ("bucket", "model", "backend", "key_id", "served")
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS ledger (
    bucket INTEGER NOT NULL, model TEXT NOT NULL, backend TEXT NOT NULL, key_id TEXT NOT NULL,
    served TEXT NOT NULL,
    {", ".join(f"{name} REAL NOT NULL DEFAULT 0" for name in COUNTERS)},
    PRIMARY KEY ({", ".join(DIMENSIONS)})
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ledger_by_key ON ledger (key_id, bucket);
"""
UPSERT = (
    f"INSERT INTO ledger ({', '.join(DIMENSIONS + COUNTERS)}) VALUES ({', '.join('?' * (5 + len(COUNTERS)))}) "
    f"ON CONFLICT ({', '.join(DIMENSIONS)}) DO UPDATE SET "
    + ", ".join(f"{n} = {n} + excluded.{n}" for n in COUNTERS)
)
SELECT = f"SELECT {', '.join(DIMENSIONS + COUNTERS)} FROM ledger WHERE bucket >= ? AND bucket < ?"


class SQLiteLedger(SQLiteThread):
    what = "sqlite ledger"

    def __init__(self, path: str, busy_timeout_ms: int = 5000) -> None:
        super().__init__(path, busy_timeout_ms)
        self.holds = SQLiteHolds(path, busy_timeout_ms)  # the budgets' reservations (policies/budget.py)

    def prepare(self, conn: sqlite3.Connection) -> None:
        conn.executescript(SCHEMA)
        prepare_holds(conn)
        have = {row[1] for row in conn.execute("PRAGMA table_info(ledger)")}
        for name in COUNTERS:  # a file written before a counter existed: add it (0 for the old rows)
            if name not in have:
                conn.execute(f"ALTER TABLE ledger ADD COLUMN {name} REAL NOT NULL DEFAULT 0")

    async def add(self, batch: Batch, retention_seconds: float, now: float) -> None:
        """One process writes this file, so the rows' busy time is already the union of its calls'."""
        params = [(*row, *values) for row, values in batch.rows.items()]
        cutoff = int(now - retention_seconds)
        released = self.holds.take_released()  # settled calls whose figures are in this batch (taken together)

        def write(conn: sqlite3.Connection) -> None:
            with conn:  # one transaction
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany(UPSERT, params)
                conn.execute("DELETE FROM ledger WHERE bucket < ?", (cutoff,))
                if released:
                    conn.executemany("DELETE FROM budget_holds WHERE id = ?", [(i,) for i in released])

        try:
            await self._run("add", write)
        except BaseException:
            self.holds.put_back(released)
            raise

    async def settle_orphans(self) -> int:
        """Write every reservation still held (a process that reserved it is gone: call this before this process
        reserves anything) into the ledger as one estimated call at its reserved bound, and delete it: one
        transaction. Returns how many there were."""
        def settle(conn: sqlite3.Connection) -> int:
            with conn:
                conn.execute("BEGIN IMMEDIATE")
                rows = conn.execute(f"SELECT {', '.join(HOLD_FIELDS)} FROM budget_holds").fetchall()
                params = []
                for bucket, model, backend, key_id, served, prompt, completion, cost in rows:
                    values = [0.0] * len(COUNTERS)
                    values[REQUESTS] = values[ESTIMATED] = 1
                    values[PROMPT], values[COMPLETION], values[COST] = prompt, completion, cost
                    params.append((bucket, model, backend, key_id, served, *values))
                conn.executemany(UPSERT, params)
                conn.execute("DELETE FROM budget_holds")
                return len(rows)

        return await self._run("settle_orphans", settle)

    async def close(self) -> None:
        try:
            await self.holds.close()
        finally:
            await super().close()

    async def read(self, since: float, until: float, key_id: str | None = None) -> list[tuple[Row, list[float]]]:
        sql: str = SELECT
        args: list[int | str] = [int(since), int(until)]
        if key_id is not None:
            sql, args = sql + " AND key_id = ?", [*args, key_id]
        rows = await self._run("read", lambda conn: conn.execute(sql, args).fetchall())
        return [(Row(*r[:5]), list(r[5:])) for r in rows]
