"""Two processes settling orphaned reservations on one file while a third writes new ones: each settle reads the
rows then deletes them in one transaction, which must take the write lock before its read (BEGIN IMMEDIATE). A
deferred transaction that read first and found another connection's commit before its own write fails at once
with "database is locked", whatever the busy timeout (SQLite cannot upgrade a stale snapshot)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

from policies.ledger.sqlite import SQLiteLedger
from policies.store.sqlite_holds import INSERT


async def test_settling_beside_a_writer_waits_for_the_lock_instead_of_failing(tmp_path):
    path = str(tmp_path / "gateway.db")
    ledgers = [SQLiteLedger(path), SQLiteLedger(path)]
    await ledgers[0].settle_orphans()  # creates the tables
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 5000")
        deadline = time.monotonic() + 30  # bounded whatever happens to the loop below
        while not stop.is_set() and time.monotonic() < deadline:
            conn.execute(INSERT, (0, "m", "b", "k", "s", 1, 1, 0.01))
            written[0] += 1
            time.sleep(0.001)  # a busy file, not a starved one: a waiting transaction gets its turn
        conn.close()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        settled = 0
        for _ in range(100):
            counts = await asyncio.gather(*(ledger.settle_orphans() for ledger in ledgers))
            settled += sum(counts)
    finally:
        stop.set()
        thread.join(10)
        for ledger in ledgers:
            await ledger.close()
    assert written[0] > 0 and settled > 0
