"""A SQLite connection of its own on a worker thread of its own, for state kept beside the keys in the embedded
file (the cost ledger, the Batch API): a read there never waits behind the request path's writes in one queue,
and WAL lets the connections share the file. Failures are store errors that name the operation, never a value."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from policies.store.base import StoreError, StoreUnavailable

T = TypeVar("T")


def use_wal(conn: sqlite3.Connection, seconds: float) -> None:
    """Put the file in WAL mode (a property of the file: the first connection to ask sets it for all), waiting up
    to `seconds` while another connection writes or does the same. SQLite answers a change of journal mode with
    "database is locked" at once, whatever the busy timeout: two processes (or a store and its ledger) opening a
    new file together would otherwise fail one of them."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


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
            use_wal(conn, self.busy_timeout_ms / 1000)
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
