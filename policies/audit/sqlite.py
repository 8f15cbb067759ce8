"""The audit log in the embedded SQLite file (the one that holds keys), in a table of its own.

Its own connection on its own worker thread (policies/store/sqlite_thread.py), as the ledger has. Each write
is one transaction: the event, then the rows retention drops.
"""

from __future__ import annotations

import sqlite3

from policies.audit.log import AuditEvent, AuditPage, AuditQuery
from policies.config.audit import AuditSettings
from policies.store.sqlite_thread import SQLiteThread

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    id TEXT PRIMARY KEY, at REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL, target TEXT NOT NULL,
    event TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS audit_by_at ON audit (at);
"""
FILTERS = (("actor", "actor = ?"), ("action", "action = ?"), ("target", "target = ?"), ("since", "at >= ?"),
           ("until", "at < ?"), ("before", "id < ?"))


class SQLiteAudit(SQLiteThread):
    what = "sqlite audit"

    def prepare(self, conn: sqlite3.Connection) -> None:
        conn.executescript(SCHEMA)

    async def add(self, event: AuditEvent, settings: AuditSettings) -> None:
        row = (event.id, event.at, event.actor, event.action, event.target, event.model_dump_json())
        cutoff = event.at - settings.retention_days * 86400

        def write(conn: sqlite3.Connection) -> None:
            with conn:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO audit (id, at, actor, action, target, event) VALUES (?, ?, ?, ?, ?, ?)",
                             row)
                conn.execute("DELETE FROM audit WHERE at < ?", (cutoff,))
                conn.execute("DELETE FROM audit WHERE id IN (SELECT id FROM audit ORDER BY id DESC LIMIT -1 OFFSET ?)",
                             (settings.max_events,))

        await self._run("add", write)

    async def query(self, query: AuditQuery) -> AuditPage:
        where, args = [], []
        for field, clause in FILTERS:
            value = getattr(query, field)
            if value is not None:
                where.append(clause)
                args.append(value)
        sql = "SELECT event FROM audit" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY id DESC LIMIT ?"
        rows = await self._run("query", lambda conn: conn.execute(sql, [*args, query.limit + 1]).fetchall())
        events = [AuditEvent.model_validate_json(r[0]) for r in rows[:query.limit]]
        return AuditPage(events=events, next=events[-1].id if len(rows) > query.limit else None)
