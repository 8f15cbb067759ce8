"""The ledger in the embedded SQLite file (the one that holds keys and usage), in a table of its own.

It has its own connection on its own worker thread, as policies/store/sqlite.py does for keys, so a report's
read never waits behind the request path's writes in one queue; WAL lets the two connections share the
file. A flush is one transaction of upserts, so a crash leaves whole flushes or none.
"""

from __future__ import annotations

import asyncio
import sqlite3
from concurrent.futures import ThreadPoolExecutor

from policies.ledger.sums import COUNTERS, Batch, Row
from policies.store import StoreError, StoreUnavailable

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


class SQLiteLedger:
    def __init__(self, path: str, busy_timeout_ms: int = 5000) -> None:
        self.path = path
        self.busy_timeout_ms = busy_timeout_ms
        self.conn: sqlite3.Connection | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-ledger")

    def _connect(self) -> sqlite3.Connection:
        if self.conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript(SCHEMA)
            have = {row[1] for row in conn.execute("PRAGMA table_info(ledger)")}
            for name in COUNTERS:  # a file written before a counter existed: add it (0 for the old rows)
                if name not in have:
                    conn.execute(f"ALTER TABLE ledger ADD COLUMN {name} REAL NOT NULL DEFAULT 0")
            self.conn = conn
        return self.conn

    async def _run(self, op: str, fn):
        def job():
            return fn(self._connect())

        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, job)
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(f"sqlite ledger {op} failed: {type(exc).__name__}") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite ledger {op} failed: {type(exc).__name__}") from exc

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

    async def close(self) -> None:
        def shut(_conn) -> None:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

        try:
            if self.conn is not None:
                await self._run("close", shut)
        finally:
            self.executor.shutdown(wait=False)
