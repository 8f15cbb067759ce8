"""A new SQLite file is put in WAL mode by whichever connection asks first, the others waiting while it is
being written (policies/store/sqlite_thread.py `use_wal`): SQLite answers a journal-mode change "database is
locked" at once, whatever the busy timeout, so a store and its ledger opening one new file together failed one."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from policies.store.sqlite_thread import use_wal


def writer_holding_the_file(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("CREATE TABLE t (x)")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO t VALUES (1)")
    return conn


def test_a_journal_mode_change_waits_for_a_writer_instead_of_failing(tmp_path):
    path = str(tmp_path / "gateway.db")
    writer = writer_holding_the_file(path)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("PRAGMA busy_timeout = 5000")
    with pytest.raises(sqlite3.OperationalError, match="locked"):  # what SQLite does on its own
        other.execute("PRAGMA journal_mode = WAL")
    began = time.monotonic()  # before the timer starts: however late this thread runs, the writer holds 0.3 s
    threading.Timer(0.3, lambda: writer.execute("COMMIT")).start()
    use_wal(other, 5.0)
    assert 0.2 < time.monotonic() - began < 4.0
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    use_wal(sqlite3.connect(path), 0.0)  # already WAL: nothing to change, nothing to wait for
    writer.close()
    other.close()


def test_it_gives_up_after_its_time(tmp_path):
    path = str(tmp_path / "gateway.db")
    writer = writer_holding_the_file(path)
    other = sqlite3.connect(path, isolation_level=None)
    began = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        use_wal(other, 0.2)
    assert time.monotonic() - began < 3.0
    writer.execute("COMMIT")
    writer.close()
    other.close()
