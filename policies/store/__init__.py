"""Where the gateway keeps keys and usage: SQLite for one process, Redis for many (see base.Store).

Callers depend on `Store` and the errors below, and get an instance from `open_store`, so switching from the
embedded file to a shared server is a config change. Each implementation is imported only when chosen.
"""

from __future__ import annotations

from typing import Any

from policies.store.base import (
    USAGE_FIELDS,
    KeyExists,
    KeyNotFound,
    Store,
    StoreError,
    StoreUnavailable,
    TeamExists,
    TeamNotFound,
)

__all__ = [
    "USAGE_FIELDS",
    "KeyExists",
    "KeyNotFound",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "TeamExists",
    "TeamNotFound",
    "open_store",
]


def open_store(kind: str, *, path: str | None = None, url: str | None = None, **options: Any) -> Store:
    """A store of `kind` "sqlite" (needs `path`) or "redis" (needs `url`). It connects lazily: call `ping()`
    to find out at startup whether it is reachable. `options` go to the implementation (e.g. Redis `prefix`,
    `timeout`, `deadline`)."""
    if kind == "sqlite":
        if not path:
            raise ValueError("the sqlite store needs a path")
        from policies.store.sqlite import SQLiteStore

        return SQLiteStore(path, **options)
    if kind == "redis":
        if not url:
            raise ValueError("the redis store needs a url")
        from policies.store.redis import RedisStore

        return RedisStore(url, **options)
    raise ValueError(f"unknown store kind {kind!r}: expected 'sqlite' or 'redis'")
