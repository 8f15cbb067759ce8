"""A call to the shared store seen through to its end, even when the request that made it goes away.

A client that disconnects cancels its request's task; if that happens while a script is on its way to Redis,
the script may run anyway and take a slot nobody will give back until its lease ends (a minute, by default).
`see_through` lets the call finish in the background and hands what it got to `undo`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def see_through(work: Awaitable[T], undo: Callable[[T], object]) -> T:
    """`await work`; if the caller is cancelled first, `work` still runs to its end and, when it succeeds,
    `undo(result)` gives back what it took."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda done: done.cancelled() or done.exception() is not None
                               or undo(done.result()))
        raise
