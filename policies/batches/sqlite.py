"""The Batch API's state in the embedded SQLite file (beside keys and usage), on its own connection and worker
thread (policies/store/sqlite_thread.py). Each claim and each result is one transaction, so a crash
leaves every line pending, claimed (its claim expires and it is claimed again) or done."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from policies.batches.store import OPEN, Progress, Usage
from policies.store.sqlite_thread import SQLiteThread

T = TypeVar("T")
PENDING, CLAIMED, OK, FAILED, DROPPED = range(5)
SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at REAL NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS batch_files_by_owner ON batch_files (owner, created_at);
CREATE INDEX IF NOT EXISTS batch_files_by_expiry ON batch_files (json_extract(record, '$.expires_at'));
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at REAL NOT NULL, open INTEGER NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, created_at);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, state INTEGER NOT NULL, runner TEXT, until REAL, result BLOB,
    PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS batch_lines_by_state ON batch_lines (batch_id, state, line);
"""


class SQLiteBatches(SQLiteThread):
    what = "sqlite batches"

    def prepare(self, conn: sqlite3.Connection) -> None:
        conn.executescript(SCHEMA)

    async def _transaction(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        def atomic(conn: sqlite3.Connection) -> T:
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = fn(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return out

        return await self._run(op, atomic)

    async def put_file(self, record: dict[str, Any], max_files: int | None = None,
                       max_bytes: int | None = None) -> str | None:
        def put(conn: sqlite3.Connection) -> str | None:
            files, size = usage_of(conn, record["_owner"], record["id"])  # the others: this one may be rewritten
            if max_files is not None and files + 1 > max_files:
                return "files"
            if max_bytes is not None and size + record["bytes"] > max_bytes:
                return "bytes"
            conn.execute("INSERT OR REPLACE INTO batch_files VALUES (?, ?, ?, ?)",
                         (record["id"], record["_owner"], record["_created"], orjson.dumps(record).decode()))
            return None

        return await self._transaction("put_file", put)

    async def usage(self, owner: str) -> Usage:
        return Usage(*await self._run("usage", lambda c: usage_of(c, owner, "")))

    async def expired_files(self, now: float, limit: int) -> list[tuple[str, str]]:
        rows = await self._run("expired_files", lambda c: c.execute(
            "SELECT owner, id FROM batch_files WHERE json_extract(record, '$.expires_at') < ? "
            "ORDER BY json_extract(record, '$.expires_at') LIMIT ?", (now, limit)).fetchall())
        return [(owner, file_id) for owner, file_id in rows]

    async def get_file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        row = await self._run("get_file", lambda c: c.execute(
            "SELECT record FROM batch_files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone())
        return orjson.loads(row[0]) if row else None

    async def list_files(self, owner: str) -> list[dict[str, Any]]:
        rows = await self._run("list_files", lambda c: c.execute(
            "SELECT record FROM batch_files WHERE owner = ? ORDER BY created_at DESC, id DESC", (owner,)).fetchall())
        return [orjson.loads(r[0]) for r in rows]

    async def delete_file(self, owner: str, file_id: str) -> bool:
        cursor = await self._run("delete_file", lambda c: c.execute(
            "DELETE FROM batch_files WHERE id = ? AND owner = ?", (file_id, owner)))
        return cursor.rowcount > 0

    async def create_batch(self, record: dict[str, Any], lines: int) -> None:
        def create(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO batches VALUES (?, ?, ?, 1, ?)", (
                record["id"], record["_owner"], record["_created"], orjson.dumps(record).decode()))
            conn.executemany("INSERT INTO batch_lines (batch_id, line, state) VALUES (?, ?, 0)",
                             ((record["id"], n) for n in range(lines)))

        await self._transaction("create_batch", create)

    async def get_batch(self, owner: str | None, batch_id: str) -> dict[str, Any] | None:
        sql, args = "SELECT record FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            sql, args = sql + " AND owner = ?", [batch_id, owner]
        row = await self._run("get_batch", lambda c: c.execute(sql, args).fetchone())
        return orjson.loads(row[0]) if row else None

    async def list_batches(self, owner: str) -> list[dict[str, Any]]:
        rows = await self._run("list_batches", lambda c: c.execute(
            "SELECT record FROM batches WHERE owner = ? ORDER BY created_at DESC, id DESC", (owner,)).fetchall())
        return [orjson.loads(r[0]) for r in rows]

    async def swap(self, record: dict[str, Any]) -> bool:
        seen = record["_v"]
        stored = {**record, "_v": seen + 1}
        cursor = await self._run("swap", lambda c: c.execute(
            "UPDATE batches SET record = ?, open = ? WHERE id = ? AND json_extract(record, '$._v') = ?",
            (orjson.dumps(stored).decode(), int(record["status"] in OPEN), record["id"], seen)))
        return cursor.rowcount == 1

    async def open_batches(self) -> list[dict[str, Any]]:
        rows = await self._run("open_batches", lambda c: c.execute(
            "SELECT record FROM batches WHERE open = 1 ORDER BY created_at, id").fetchall())
        return [orjson.loads(r[0]) for r in rows]

    async def claim(self, batch_id: str, runner: str, count: int, until: float, now: float) -> list[int]:
        def take(conn: sqlite3.Connection) -> list[int]:
            conn.execute("UPDATE batch_lines SET state = 0, runner = NULL WHERE batch_id = ? AND state = 1 "
                         "AND until < ?", (batch_id, now))
            lines = [r[0] for r in conn.execute(
                "SELECT line FROM batch_lines WHERE batch_id = ? AND state = 0 ORDER BY line LIMIT ?",
                (batch_id, count))]
            conn.executemany("UPDATE batch_lines SET state = 1, runner = ?, until = ? WHERE batch_id = ? AND line = ?",
                             ((runner, until, batch_id, n) for n in lines))
            return lines

        return await self._transaction("claim", take)

    async def renew(self, batch_id: str, runner: str, lines: list[int], until: float) -> None:
        await self._run("renew", lambda c: c.executemany(
            "UPDATE batch_lines SET until = ? WHERE batch_id = ? AND line = ? AND state = 1 AND runner = ?",
            ((until, batch_id, n, runner) for n in lines)))

    async def release(self, batch_id: str, runner: str, line: int) -> None:
        await self._run("release", lambda c: c.execute(
            "UPDATE batch_lines SET state = 0, runner = NULL WHERE batch_id = ? AND line = ? AND state = 1 "
            "AND runner = ?", (batch_id, line, runner)))

    async def complete(self, batch_id: str, runner: str, line: int, ok: bool, result: bytes) -> bool:
        cursor = await self._run("complete", lambda c: c.execute(
            "UPDATE batch_lines SET state = ?, runner = NULL, result = ? WHERE batch_id = ? AND line = ? "
            "AND state = 1 AND runner = ?", (OK if ok else FAILED, result, batch_id, line, runner)))
        return cursor.rowcount == 1

    async def drop_pending(self, batch_id: str) -> int:
        cursor = await self._run("drop_pending", lambda c: c.execute(
            "UPDATE batch_lines SET state = 4 WHERE batch_id = ? AND state = 0", (batch_id,)))
        return cursor.rowcount

    async def progress(self, batch_id: str) -> Progress:
        rows = await self._run("progress", lambda c: c.execute(
            "SELECT state, count(*) FROM batch_lines WHERE batch_id = ? GROUP BY state", (batch_id,)).fetchall())
        counts = dict(rows)
        return Progress(counts.get(PENDING, 0), counts.get(CLAIMED, 0), counts.get(OK, 0), counts.get(FAILED, 0))

    async def results(self, batch_id: str, first: int = 0, end: int | None = None) -> list[tuple[int, bool, bytes]]:
        rows = await self._run("results", lambda c: c.execute(
            "SELECT line, state, result FROM batch_lines WHERE batch_id = ? AND state IN (2, 3) AND line >= ? "
            "AND line < ? ORDER BY line", (batch_id, first, 2**62 if end is None else end)).fetchall())
        return [(line, state == OK, bytes(result)) for line, state, result in rows]


def usage_of(conn: sqlite3.Connection, owner: str, but: str) -> tuple[int, int]:
    """The owner's files but the one of id `but`: how many, their bytes."""
    files, size = conn.execute("SELECT count(*), coalesce(sum(json_extract(record, '$.bytes')), 0) FROM batch_files "
                               "WHERE owner = ? AND id != ?", (owner, but)).fetchone()
    return int(files), int(size)
