"""A SQLite connection of its own on a worker thread of its own, for state kept beside the keys in the embedded
file (the cost ledger, the Batch API): a read there never waits behind the request path's writes in one queue,
and WAL lets the connections share the file. Failures are store errors that name the operation, never a value."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from policies.store.base import StoreError, StoreUnavailable

T = TypeVar("T")


class SQLiteThread:
    what = "sqlite"  # named in errors and in the thread's name

    def __init__(self, path: str, busy_timeout_ms: int = 5000) -> None:
        self.path = path
        self.busy_timeout_ms = busy_timeout_ms
        self.conn: sqlite3.Connection | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.what.replace(" ", "-"))

    def prepare(self, conn: sqlite3.Connection) -> None:
        """Create (or bring up to date) the tables, once per connection."""

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
            raise StoreUnavailable(f"{self.what} {op} failed: {type(exc).__name__}") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"{self.what} {op} failed: {type(exc).__name__}") from exc

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
