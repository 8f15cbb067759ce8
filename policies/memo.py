"""Values computed once per key, for the request path: metric children and parsed client addresses.

prometheus_client's `labels()` takes a lock and builds its key on every call, and parsing an address is not free
either; both answer the same for the same arguments, so they are looked up here first. With `limit`, a table
fed by the outside world (client addresses) is cleared when full instead of growing without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Memo(Generic[V]):
    __slots__ = ("factory", "limit", "table")

    def __init__(self, factory: Callable[..., V], limit: int | None = None) -> None:
        self.factory = factory
        self.limit = limit
        self.table: dict[tuple[Hashable, ...], V] = {}

    def __call__(self, *key: Hashable) -> V:
        try:
            return self.table[key]
        except KeyError:
            value = self.factory(*key)
            if self.limit is not None and len(self.table) >= self.limit:
                self.table.clear()
            self.table[key] = value
        return value
