"""A table of its own in the embedded SQLite file, on its own connection and worker thread.

The ledger and the audit log each keep one, as policies/store/sqlite.py does for keys, so a long read of one
never waits behind the others' writes in one queue; WAL lets the connections share the file. Every sqlite
failure becomes a store error naming the operation, never a stored value.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from policies.store.base import StoreError, StoreUnavailable

T = TypeVar("T")


class SQLiteTable:
    kind = "sqlite"  # names the thread and the errors: "sqlite ledger add failed"

    def __init__(self, path: str, busy_timeout_ms: int = 5000) -> None:
        self.path = path
        self.busy_timeout_ms = busy_timeout_ms
        self.conn: sqlite3.Connection | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.kind.replace(" ", "-"))

    def prepare(self, conn: sqlite3.Connection) -> None:
        """Create (or bring up to date) the table on a new connection."""

    def _connect(self) -> sqlite3.Connection:
        if self.conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            self.prepare(conn)
            self.conn = conn
        return self.conn

    async def _run(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        def job() -> T:
            return fn(self._connect())

        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, job)
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(f"{self.kind} {op} failed: {type(exc).__name__}") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"{self.kind} {op} failed: {type(exc).__name__}") from exc

    async def close(self) -> None:
        def shut(_conn: sqlite3.Connection) -> None:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

        try:
            if self.conn is not None:
                await self._run("close", shut)
        finally:
            self.executor.shutdown(wait=False)
