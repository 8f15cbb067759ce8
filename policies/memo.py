"""Values computed once per key, for the request path: metric children and parsed client addresses.

prometheus_client's `labels()` takes a lock and builds its key on every call, and parsing an address is not free
either; both answer the same for the same arguments, so they are looked up here first. With `limit`, a table
fed by the outside world (client addresses) is cleared when full instead of growing without bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


class Memo:
    __slots__ = ("factory", "limit", "table")

    def __init__(self, factory: Callable[..., Any], limit: int | None = None) -> None:
        self.factory = factory
        self.limit = limit
        self.table: dict[tuple[Any, ...], Any] = {}

    def __call__(self, *key: Any) -> Any:
        value = self.table.get(key, _MISSING)
        if value is _MISSING:
            value = self.factory(*key)
            if self.limit is not None and len(self.table) >= self.limit:
                self.table.clear()
            self.table[key] = value
        return value
