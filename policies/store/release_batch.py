"""Give-backs to the shared store, sent later and together: off the request path, most of them for free.

A give-back (a cap lease, a rate-limit slot) is queued under a key (the backend, the scopes it frees). The
next request that calls the store for that key takes what is queued there and carries it in its own call
(`take`); whatever is still queued `delay` seconds after the first give-back goes in one flush, every key at
once, through `send`. Under load that saves most release round trips, and the store's counts only ever run
high (never past a limit) for those few milliseconds. What a failed call means for its give-backs (retry,
let the lease expire) is the caller's business, in `send`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

RETURN_AFTER = 0.002  # seconds a give-back may wait to travel with a request's own call or other give-backs

K = TypeVar("K")
V = TypeVar("V")


class ReleaseBatch(Generic[K, V]):
    def __init__(self, send: Callable[[dict[K, list[V]]], Awaitable[object]], delay: float = RETURN_AFTER) -> None:
        self.delay = delay
        self.send = send  # given every key's queued items; runs in a task of its own
        self.queued: dict[K, list[V]] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.flushing: set[asyncio.Task[None]] = set()

    def add(self, key: K, item: V) -> None:
        self.queued.setdefault(key, []).append(item)
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.delay, self.flush_soon)

    def take(self, key: K) -> list[V]:
        """What is queued for `key`, for the caller's own call to carry; nothing is sent for it otherwise."""
        return self.queued.pop(key, [])

    def flush_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self.flush())
        self.flushing.add(task)
        task.add_done_callback(self.flushing.discard)

    async def flush(self) -> None:
        """Send everything queued now (what is queued meanwhile waits for the next timer)."""
        if self.timer is not None:
            self.timer.cancel()  # harmless when it is the timer that fired
            self.timer = None
        batch, self.queued = self.queued, {}
        await self.send(batch)

    async def close(self, timeout: float = 5.0) -> None:
        """At shutdown: send what is queued at once, and wait (bounded) for every flush still on its way."""
        await self.flush()
        if self.flushing:
            await asyncio.wait(list(self.flushing), timeout=timeout)
