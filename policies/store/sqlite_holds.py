"""Budget reservations written to the embedded SQLite file before a budgeted call leaves, so that a crash can only
over-count a budget, never under-count it.

The embedded store counts budgets in memory and starts them each period from the ledger, whose figures are
summed in memory and written every flush interval (policies/ledger/record.py): a process killed mid-interval would
forget that interval's spend. So a call that reserves budget (a key or team with a budget: nobody else pays this)
first writes one small row here, its reserved bound as the ledger would record it; the row lives until the
ledger's own write that holds the call's real figures, which deletes it in the same transaction
(policies/ledger/sqlite.py). Rows that outlive their process are settled at their reserved bound by the next
process before it counts any budget: written into the ledger as estimated calls, then deleted.

Its own connection and worker thread (policies/store/sqlite_thread.py): a reservation never waits behind a
report's read of the ledger; each write is one WAL append (synchronous=NORMAL).
"""

from __future__ import annotations

import sqlite3
from typing import NamedTuple

from policies.store.sqlite_thread import SQLiteThread

SCHEMA = """
CREATE TABLE IF NOT EXISTS budget_holds (
    id INTEGER PRIMARY KEY,
    bucket INTEGER NOT NULL, model TEXT NOT NULL, backend TEXT NOT NULL, key_id TEXT NOT NULL, served TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, rented_cost REAL NOT NULL
);
"""
FIELDS = ("bucket", "model", "backend", "key_id", "served", "prompt_tokens", "completion_tokens", "rented_cost")
INSERT = f"INSERT INTO budget_holds ({', '.join(FIELDS)}) VALUES ({', '.join('?' * len(FIELDS))})"
UPDATE = f"UPDATE budget_holds SET {', '.join(f'{name} = ?' for name in FIELDS)} WHERE id = ?"
MAX_RELEASED = 100_000  # ids waiting for the ledger's next write; past that the oldest stay (over-counted)


class HoldRow(NamedTuple):
    """One call's reservation, as the ledger would record the call (policies/ledger/sums.py's Row and counters)."""

    bucket: int
    model: str
    backend: str
    key_id: str
    served: str
    prompt_tokens: int
    completion_tokens: int
    rented_cost: float


def prepare_holds(conn: sqlite3.Connection) -> None:
    conn.executescript(SCHEMA)


class SQLiteHolds(SQLiteThread):
    what = "sqlite budget holds"

    def __init__(self, path: str, busy_timeout_ms: int = 5000) -> None:
        super().__init__(path, busy_timeout_ms)
        self.released: list[int] = []  # settled calls whose rows the ledger's next write deletes

    def prepare(self, conn: sqlite3.Connection) -> None:
        prepare_holds(conn)

    async def hold(self, row: HoldRow, hold_id: int | None = None) -> int:
        """Write a call's reservation (a new row, or its row `hold_id` raised); its id."""
        def write(conn: sqlite3.Connection) -> int:
            if hold_id is not None and conn.execute(UPDATE, (*row, hold_id)).rowcount:
                return hold_id
            new = conn.execute(INSERT, row).lastrowid
            assert new is not None
            return new

        return await self._run("hold", write)

    async def forget(self, hold_id: int) -> None:
        """Delete a row at once: its call ended with nothing the ledger will record."""
        await self._run("forget", lambda conn: conn.execute("DELETE FROM budget_holds WHERE id = ?", (hold_id,)))

    def release(self, hold_id: int) -> None:
        """The call is settled and its figures are in the ledger's sums: the ledger's next write deletes the row."""
        if len(self.released) >= MAX_RELEASED:
            del self.released[0]
        self.released.append(hold_id)

    def take_released(self) -> list[int]:
        taken, self.released = self.released, []
        return taken

    def put_back(self, ids: list[int]) -> None:
        """The ledger's write failed: its rows wait for the next one."""
        self.released[:0] = ids[-MAX_RELEASED:]
        del self.released[MAX_RELEASED:]

    async def count(self) -> int:
        """Rows held now (tests and diagnostics)."""
        return await self._run("count", lambda conn: conn.execute("SELECT count(*) FROM budget_holds").fetchone()[0])
