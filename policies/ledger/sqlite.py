"""The ledger in the embedded SQLite file (the one that holds keys and usage), in a table of its own.

It has its own connection on its own worker thread (policies/store/sqlite_thread.py), so a report's read
never waits behind the request path's writes in one queue. A flush is one transaction of upserts, so a crash
leaves whole flushes or none.
"""

from __future__ import annotations

import sqlite3

from policies.ledger.sums import COUNTERS, Batch, Row
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

    def prepare(self, conn: sqlite3.Connection) -> None:
        conn.executescript(SCHEMA)
        have = {row[1] for row in conn.execute("PRAGMA table_info(ledger)")}
        for name in COUNTERS:  # a file written before a counter existed: add it (0 for the old rows)
            if name not in have:
                conn.execute(f"ALTER TABLE ledger ADD COLUMN {name} REAL NOT NULL DEFAULT 0")

    async def add(self, batch: Batch, retention_seconds: float, now: float) -> None:
        """One process writes this file, so the rows' busy time is already the union of its calls'."""
        params = [(*row, *values) for row, values in batch.rows.items()]
        cutoff = int(now - retention_seconds)

        def write(conn: sqlite3.Connection) -> None:
            with conn:  # one transaction
                conn.execute("BEGIN")
                conn.executemany(UPSERT, params)
                conn.execute("DELETE FROM ledger WHERE bucket < ?", (cutoff,))

        await self._run("add", write)

    async def read(self, since: float, until: float, key_id: str | None = None) -> list[tuple[Row, list[float]]]:
        sql: str = SELECT
        args: list[int | str] = [int(since), int(until)]
        if key_id is not None:
            sql, args = sql + " AND key_id = ?", [*args, key_id]
        rows = await self._run("read", lambda conn: conn.execute(sql, args).fetchall())
        return [(Row(*r[:5]), list(r[5:])) for r in rows]
