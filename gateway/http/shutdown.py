"""The lifespan's shutdown in bounded steps: a step that hangs (a loop that will not end, a store that does not
answer its close) is logged by name, with where it waits, and left behind, so that the process still exits and
every later step (the access log, usage, the ledger, the store) still runs. A pod that hangs on SIGTERM is
killed by Kubernetes after its grace period anyway, with nothing flushed and nothing said."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

log = logging.getLogger("gateway.http.shutdown")

STEP_SECONDS = 10.0  # one step's bound, past any store's or exporter's own timeout


def waits_at(task: asyncio.Future[Any]) -> str:
    """Where a task is suspended: its chain of awaits, outermost first (what a hung step was waiting on)."""
    get_coro = getattr(task, "get_coro", None)
    coro = get_coro() if get_coro is not None else None
    parts: list[str] = []
    while coro is not None and len(parts) < 12:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            parts.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(parts) or "unknown"


async def step(what: str, awaitable: Awaitable[Any], seconds: float = STEP_SECONDS) -> bool:
    """Await `awaitable` for at most `seconds`; True if it ended. An error is logged, not raised: the next step
    runs either way."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        log.error("shutdown: %s did not end within %g s; left behind (waiting at %s)", what, seconds, waits_at(task))
        task.cancel()
        return False
    if not task.cancelled() and task.exception() is not None:
        log.error("shutdown: %s failed: %r", what, task.exception())
    return True


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], seconds: float = STEP_SECONDS) -> list[str]:
    """Cancel background loops and wait up to `seconds` for them to end; the names of those that did not."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if not tasks:
        return []
    _, pending = await asyncio.wait(tasks, timeout=seconds)
    for task in pending:
        log.error("shutdown: the loop %s did not end within %g s of its cancel; left behind (waiting at %s)",
                  name_of(task), seconds, waits_at(task))
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.error("shutdown: the loop %s had failed: %r", name_of(task), task.exception())
    return [name_of(task) for task in pending]


def name_of(task: asyncio.Task[Any]) -> str:
    return getattr(task.get_coro(), "__qualname__", None) or task.get_name()
