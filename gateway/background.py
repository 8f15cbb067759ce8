"""Fire-and-forget work off the request path (usage and last-used writes), kept referenced and bounded.

A failing write is logged once per kind of failure, not per request; pending writes get a bounded drain at
shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("gateway.background")

MAX_PENDING = 10_000


class Background:
    def __init__(self, on_lost: Callable[[str], None] | None = None) -> None:
        self.tasks: set[asyncio.Task[object]] = set()
        self.reported: set[str] = set()
        self.dropped = 0
        self.on_lost = on_lost  # told "dropped" or "failed" for each write that did not happen (counted)

    def run(self, coro: Coroutine[Any, Any, object]) -> None:
        if len(self.tasks) >= MAX_PENDING:
            coro.close()
            self.dropped += 1
            if self.on_lost is not None:
                self.on_lost("dropped")
            self._report("backlog", f"background backlog over {MAX_PENDING}: dropping writes")
            return
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[object]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if self.on_lost is not None:
                self.on_lost("failed")
            self._report(type(exc).__name__, f"background write failed: {type(exc).__name__}")
        elif self.reported:
            self.reported.clear()  # recovered: report the next failure again

    def _report(self, kind: str, message: str) -> None:
        if kind not in self.reported:
            self.reported.add(kind)
            log.warning(message)

    async def drain(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
