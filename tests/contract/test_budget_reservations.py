"""The budgets' reservations against a crash, on the embedded SQLite file and on a real Redis: what one process
reserved and never settled still counts in the next process on the same store (a crash over-counts, never
under-counts), and what it settled counts once, at its real figure.

A "process" here is a Budgets opened on its own store (and, for SQLite, its own ledger) over the shared file or
server, as `llm-gateway serve` opens them; dropping one without settling is what a SIGKILL leaves behind.
"""

from __future__ import annotations

import time

import pytest

from policies.budget import Budgets, MemoryBudgets, RedisBudgets, period_bounds
from policies.budget_holds import Hold, Pledge
from policies.ledger.sqlite import SQLiteLedger
from policies.ledger.sums import COST, ESTIMATED, REQUESTS, Sums
from tests.support.redis_fixtures import redis_prefix, redis_server, shared_stores  # noqa: F401

KEY = "k1"


@pytest.fixture(params=["sqlite", "redis"])
async def lives(request, tmp_path):
    """Two budgets on one store: a process and the one started after it."""
    stores = shared_stores(request, tmp_path)
    ledgers = [SQLiteLedger(store.path) if request.param == "sqlite" else None for store in stores]
    budgets = [MemoryBudgets(ledger) if ledger is not None else RedisBudgets(store)
               for ledger, store in zip(ledgers, stores)]
    yield budgets, ledgers
    for ledger, store in zip(ledgers, stores):
        if ledger is not None:
            await ledger.close()
        await store.close()


async def reserve(budgets: Budgets, cost: float, tokens: int, max_spend: float | None = 1.0,
                  max_tokens: int | None = None) -> tuple[bool, Hold]:
    """Reserve as the budget step does, then write the call's reservation before it would leave."""
    start, end = period_bounds("month", time.time())
    verdict = await budgets.reserve(KEY, start, end, max_spend, cost, max_tokens, tokens)
    hold = Hold(KEY, start, end, cost if verdict.rent_ok else 0.0, tokens if verdict.tokens_ok else 0)
    if verdict.rent_ok or (verdict.tokens_ok and tokens):
        hold.pledge = Pledge(int(time.time()) // 60 * 60, "m", KEY, tokens, 0, "rented:p", "rented", hold.cost)
        await budgets.pledge(hold.pledge)
    return verdict.rent_ok and verdict.tokens_ok, hold


async def test_what_a_dead_process_reserved_still_counts_in_the_next(lives):
    (first, second), (ledger, _) = lives
    assert (await reserve(first, 1.0, 100, max_tokens=150))[0]
    # `first` dies here: nothing settled, nothing flushed
    rents, _ = await reserve(second, 0.1, 0)
    assert not rents  # spent + reserved is still the whole budget
    fits, _ = await reserve(second, 0.0, 100, max_spend=None, max_tokens=150)
    assert not fits  # and the tokens are still taken
    if ledger is not None:  # the embedded store settled it at its reserved bound, marked estimated, in the ledger
        start, end = period_bounds("month", time.time())
        assert await second.status(KEY, start, end) == (1.0, 100.0)
        (row, values), = await ledger.read(start, end, key_id=KEY)
        assert row.served == "rented" and values[REQUESTS] == values[ESTIMATED] == 1 and values[COST] == 1.0
        assert await ledger.holds.count() == 0


async def test_a_settled_reservation_counts_once_at_its_real_cost(lives):
    (first, second), (ledger, _) = lives
    ok, hold = await reserve(first, 0.5, 0)
    assert ok
    await first.settle(hold, 0.2, 10)
    assert hold.pledge is not None
    first.release(hold.pledge)
    if ledger is not None:  # the ledger's observer writes the call's figures, and with them drops the reservation
        sums = Sums(60)
        sums.call(time.time(), "m", "rented:p", KEY, True, 8, 2, 0.0, 0.2)
        await ledger.add(sums.take(), 86400, time.time())
        assert await ledger.holds.count() == 0
    start, end = period_bounds("month", time.time())
    spent, used = await second.status(KEY, start, end)
    assert spent == pytest.approx(0.2)
    assert (await reserve(second, 0.5, 0))[0]  # 0.2 spent, nothing held: there is room


async def test_a_reservation_given_back_with_nothing_spent_is_gone(lives):
    (first, second), (ledger, _) = lives
    ok, hold = await reserve(first, 1.0, 0)
    assert ok and hold.pledge is not None
    await first.settle(hold, 0.0, 0)
    await first.forget(hold.pledge)
    if ledger is not None:
        assert await ledger.holds.count() == 0
    start, end = period_bounds("month", time.time())
    assert (await second.status(KEY, start, end))[0] == 0.0
    assert (await reserve(second, 1.0, 0))[0]
