"""The lifespan's shutdown in bounded steps (gateway/http/shutdown.py): a step or a loop that hangs is logged by
name with where it waits and left behind; the steps after it still run."""

from __future__ import annotations

import asyncio
import logging

from gateway.http.shutdown import cancel_all, step


async def waits_on_a_lock_forever(lock: asyncio.Lock) -> None:
    async with lock:
        pass


async def closes_a_store(lock: asyncio.Lock) -> None:
    await waits_on_a_lock_forever(lock)


async def stubborn_loop(hold: list[bool]) -> None:
    while True:  # swallows its cancel while `hold`: the kind of loop that would hold shutdown forever
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not hold:
                raise


async def polite_loop() -> None:
    await asyncio.sleep(3600)


def test_a_hung_step_is_left_behind_named_with_where_it_waits_and_the_next_still_runs(caplog):
    ran: list[str] = []

    async def main() -> list[bool]:
        lock = asyncio.Lock()
        await lock.acquire()  # never released: the close waits on it for ever

        async def flush() -> None:
            ran.append("flush")

        return [await step("the store's close", closes_a_store(lock), 0.2), await step("the flush", flush(), 0.2)]

    with caplog.at_level(logging.ERROR, logger="gateway.http.shutdown"):
        assert asyncio.run(asyncio.wait_for(main(), 10)) == [False, True]
    assert ran == ["flush"]
    [line] = [r.getMessage() for r in caplog.records]
    assert "the store's close did not end within 0.2 s" in line
    assert "closes_a_store (test_shutdown_steps.py:" in line and "waits_on_a_lock_forever" in line


def test_a_failed_step_is_logged_and_counted_as_ended(caplog):
    async def broken() -> None:
        raise RuntimeError("the socket was already closed")

    with caplog.at_level(logging.ERROR, logger="gateway.http.shutdown"):
        assert asyncio.run(step("the ledger's close", broken(), 1.0)) is True
    assert "the ledger's close failed: RuntimeError('the socket was already closed')" in caplog.text


def test_a_loop_that_ignores_its_cancel_is_named_and_the_others_end(caplog):
    async def main() -> tuple[list[str], bool]:
        polite = asyncio.create_task(polite_loop())
        hold = [True]
        stubborn = asyncio.create_task(stubborn_loop(hold))
        await asyncio.sleep(0)
        left = await cancel_all([polite, stubborn], 0.2)
        ended = polite.cancelled()
        hold.clear()  # the test's own clean-up: a loop left behind is still running
        stubborn.cancel()
        return left, ended

    with caplog.at_level(logging.ERROR, logger="gateway.http.shutdown"):
        left, polite_ended = asyncio.run(asyncio.wait_for(main(), 10))
    assert left == ["stubborn_loop"] and polite_ended
    assert "the loop stubborn_loop did not end within 0.2 s of its cancel" in caplog.text
    assert "stubborn_loop (test_shutdown_steps.py:" in caplog.text
