"""The embedded store: one SQLite file in WAL mode, so a single gateway process needs no server.

sqlite3 blocks, so every call runs on one dedicated worker thread that owns the only connection: the event
loop never waits on disk, and calls are serialized without locks (SQLite allows one writer anyway). WAL with
synchronous=NORMAL makes each write a cheap append; a power cut may lose the last few commits, never the file.
Other processes (the CLI) may open the same file; busy_timeout makes them wait their turn instead of failing.

Tables: `keys` (the record as JSON, plus created_at for ordering and the touched last_used_at kept apart so a
touch never rewrites the record), `teams` (name -> the team as JSON), `usage` (one row per key and model, one
column per USAGE_FIELDS) and `secrets` (see shared_secret).
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from policies.keys import KeyRecord
from policies.teams import TeamRecord
from policies.store.base import (
    SECRET_BYTES,
    USAGE_FIELDS,
    KeyExists,
    KeyNotFound,
    StoreError,
    StoreUnavailable,
    TeamExists,
    TeamNotFound,
    empty_usage,
    usage_increments,
    with_last_used,
)
from policies.store.sqlite_thread import use_wal

T = TypeVar("T")

SCHEMA_VERSION = 1
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    last_used_at REAL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS keys_by_created ON keys (created_at, id);
CREATE TABLE IF NOT EXISTS usage (
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    {", ".join(f"{name} INTEGER NOT NULL DEFAULT 0" for name in USAGE_FIELDS)},
    PRIMARY KEY (key_id, model)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS teams (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS secrets (
    name TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
PRAGMA user_version = {SCHEMA_VERSION};
"""


class SQLiteStore:
    """Store on a SQLite file (or ":memory:", which lives as long as the store)."""

    def __init__(self, path: str, *, busy_timeout_ms: int = 5000) -> None:
        self.path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        # Open on the worker so the constructor never waits on disk; a call that finds no connection (the
        # file could not be opened yet) tries again, so a store recovers once the file becomes reachable.
        self._executor.submit(self._open)

    def _open(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None)  # autocommit: each statement is its transaction
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            use_wal(conn, self._busy_timeout_ms / 1000)
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript(SCHEMA)
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    async def _run(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(connection)` on the worker thread and translate sqlite's errors into the store's."""
        if self._closed:
            raise StoreError(f"sqlite {op}: the store is closed")

        def job() -> T:
            if self._conn is None:
                self._open()
            assert self._conn is not None
            return fn(self._conn)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, job)
        except sqlite3.OperationalError as exc:  # locked, disk full, I/O error, unreadable file
            raise StoreUnavailable(f"sqlite {op} failed: {type(exc).__name__}") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite {op} failed: {type(exc).__name__}") from exc

    async def create_key(self, record: KeyRecord) -> None:
        row = (record.id, record.created_at, record.model_dump_json())

        def insert(conn: sqlite3.Connection) -> None:
            try:
                conn.execute("INSERT INTO keys (id, created_at, record) VALUES (?, ?, ?)", row)
            except sqlite3.IntegrityError:
                raise KeyExists(f"key {record.id} already exists") from None

        await self._run("create_key", insert)

    async def get_key(self, key_id: str) -> KeyRecord | None:
        def select(conn: sqlite3.Connection) -> tuple[str, float | None] | None:
            row: tuple[str, float | None] | None = conn.execute(
                "SELECT record, last_used_at FROM keys WHERE id = ?", (key_id,)).fetchone()
            return row

        row = await self._run("get_key", select)
        return None if row is None else with_last_used(KeyRecord.model_validate_json(row[0]), row[1])

    async def list_keys(self) -> list[KeyRecord]:
        def select(conn: sqlite3.Connection) -> list[tuple[str, float | None]]:
            return conn.execute("SELECT record, last_used_at FROM keys ORDER BY created_at, id").fetchall()

        rows = await self._run("list_keys", select)
        return [with_last_used(KeyRecord.model_validate_json(record), touched) for record, touched in rows]

    async def put_key(self, record: KeyRecord) -> None:
        row = (record.created_at, record.model_dump_json(), record.id)

        def update(conn: sqlite3.Connection) -> int:
            return conn.execute("UPDATE keys SET created_at = ?, record = ? WHERE id = ?", row).rowcount

        if await self._run("put_key", update) == 0:
            raise KeyNotFound(f"key {record.id} not found")

    async def create_team(self, team: TeamRecord) -> None:
        def insert(conn: sqlite3.Connection) -> None:
            try:
                conn.execute("INSERT INTO teams (name, record) VALUES (?, ?)", (team.name, team.model_dump_json()))
            except sqlite3.IntegrityError:
                raise TeamExists(f"team {team.name} already exists") from None

        await self._run("create_team", insert)

    async def get_team(self, name: str) -> TeamRecord | None:
        row = await self._run("get_team", lambda conn: conn.execute(
            "SELECT record FROM teams WHERE name = ?", (name,)).fetchone())
        return None if row is None else TeamRecord.model_validate_json(row[0])

    async def list_teams(self) -> list[TeamRecord]:
        rows = await self._run("list_teams", lambda conn: conn.execute(
            "SELECT record FROM teams ORDER BY name").fetchall())
        return [TeamRecord.model_validate_json(row[0]) for row in rows]

    async def put_team(self, team: TeamRecord) -> None:
        changed = await self._run("put_team", lambda conn: conn.execute(
            "UPDATE teams SET record = ? WHERE name = ?", (team.model_dump_json(), team.name)).rowcount)
        if changed == 0:
            raise TeamNotFound(f"team {team.name} not found")

    async def delete_team(self, name: str) -> None:
        deleted = await self._run("delete_team", lambda conn: conn.execute(
            "DELETE FROM teams WHERE name = ?", (name,)).rowcount)
        if deleted == 0:
            raise TeamNotFound(f"team {name} not found")

    async def touch_key(self, key_id: str, when: float) -> None:
        def update(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE keys SET last_used_at = ? WHERE id = ? AND (last_used_at IS NULL OR last_used_at < ?)",
                (when, key_id, when),
            )

        await self._run("touch_key", update)

    async def add_usage(
        self,
        key_id: str,
        model: str,
        *,
        requests: int,
        prompt_tokens: int,
        completion_tokens: int,
        rented: bool = False,
    ) -> None:
        deltas = usage_increments(requests, prompt_tokens, completion_tokens, rented)
        names = list(deltas)
        sql = (
            f"INSERT INTO usage (key_id, model, {', '.join(names)}) VALUES (?, ?{', ?' * len(names)}) "
            f"ON CONFLICT (key_id, model) DO UPDATE SET {', '.join(f'{n} = {n} + excluded.{n}' for n in names)}"
        )
        params = (key_id, model, *deltas.values())
        await self._run("add_usage", lambda conn: conn.execute(sql, params))

    async def usage(self, key_id: str) -> dict[str, dict[str, int]]:
        sql = f"SELECT model, {', '.join(USAGE_FIELDS)} FROM usage WHERE key_id = ? ORDER BY model"
        rows = await self._run("usage", lambda conn: conn.execute(sql, (key_id,)).fetchall())
        return {row[0]: empty_usage() | dict(zip(USAGE_FIELDS, row[1:])) for row in rows}

    async def shared_secret(self, name: str) -> bytes:
        fresh = secrets.token_bytes(SECRET_BYTES)

        def get_or_make(conn: sqlite3.Connection) -> bytes:
            conn.execute("INSERT OR IGNORE INTO secrets (name, value) VALUES (?, ?)", (name, fresh))
            value: bytes = conn.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()[0]
            return value

        return await self._run("shared_secret", get_or_make)

    async def ping(self) -> None:
        await self._run("ping", lambda conn: conn.execute("SELECT 1").fetchone())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, shut)
        finally:
            self._executor.shutdown(wait=False)
