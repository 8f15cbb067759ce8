"""Pipeline step: budgets per period, a key's and its team's: rented spend (`max_rented_spend`) and tokens
(`max_tokens_per_period`).

Rented spend is reserved at the moment a call is about to spill (the proxy asks BEFORE_RENT): its rented
price at the estimated prompt and max_tokens. Token budgets reserve the token estimate at admission. Each
reservation is one atomic step (one Lua call on one Redis hash when the store is shared, so N replicas enforce
one budget); the call's end settles it against the real cost and tokens, as its finished-call record counted them
(policies/finished.py: the budget step observes the records), off the request path. Keys without a
budget cost nothing here; a budget on rented spend alone costs nothing until a call spills. A key in a team
(policies/teams.py) counts against both budgets: its call is admitted only while both have room, and rents only
while both do (what one reserved is given back when the other refuses); the team's budget is kept under
`team:<name>`.

Rented spend: a call may rent while spent + reserved is below the budget, so the spend ends within one
request's cost of it: the reservation is an upper bound on the call's cost, not an estimate (the prompt at a
token per UTF-8 byte, policies/tokens.py's `prompt_bound`, so a prompt crafted to make many tokens of few
characters cannot rent at a fraction of its price; max_tokens bounds the completion); a call that may not rent
waits for an owned replica. Past that the key's requests stay on owned backends (`when_spent: owned_only`, the
default) or get 429 with the time of the reset (`reject`). Tokens: a request is admitted while spent +
reserved + its estimate fits (exact, as the tokens-per-minute limit), else 429 with the reset time.

Embedded store: the counters live in this process and start each period from the ledger, so a restart keeps
what was spent. The ledger is written every flush interval, so a budgeted call also writes its reservation to
the file before it leaves (one small WAL write: policies/store/sqlite_holds.py; keys without a budget never pay
it); the ledger's write of the call's real figures deletes it. A process killed mid-interval leaves its calls'
reservations there, and the next one settles them at their reserved bound (ledger rows marked estimated)
before it counts any budget: a crash can only over-count a budget, never under-count it. While Redis is unreachable nothing is rented for budgeted keys (money fails closed) and token
budgets admit (logged once). A replica that dies with reservations outstanding leaves them held until the
period ends (they are at most its requests in flight): each reservation is one atomic Lua call on the
period's hash, which Redis keeps whatever becomes of the replica, so there too a crash only over-counts.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from policies.background import Background
from policies.budget_holds import Hold, Pledge
from policies.config import Policy
from policies.errors import RateLimited
from policies.finished import RENTED, Finished
from policies.keys import KeyBudget
from policies.teams import OWNER_PREFIX
from policies.ledger.sqlite import SQLiteLedger
from policies.ledger.sums import COMPLETION, COST, PROMPT
from policies.pipeline import Call, Slot
from policies.store import StoreError, StoreUnavailable
from policies.store.redis import RedisStore
from policies.store.sqlite_holds import SQLiteHolds

log = logging.getLogger("gateway.budget")

UTC = datetime.timezone.utc


def estimate(call: Call, default_max_tokens: int) -> tuple[int, int, int]:
    """(prompt, output, total) tokens the call may use at most, as its route bounds them (policies/tokens.py):
    the prompt's upper bound, not the rate limits' estimate, since money must not be under-reserved."""
    prompt = call.tokens.prompt_bound(call.body)
    output = call.tokens.output(call.body, default_max_tokens)
    return prompt, output, prompt + output


def period_bounds(period: str, now: float) -> tuple[int, int]:
    """The calendar period (UTC) holding `now`: (start, end) in unix seconds."""
    day = datetime.datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        start, end = day, day + datetime.timedelta(days=1)
    elif period == "week":
        start = day - datetime.timedelta(days=day.weekday())
        end = start + datetime.timedelta(days=7)
    else:
        start = day.replace(day=1)
        end = (start + datetime.timedelta(days=32)).replace(day=1)
    return int(start.timestamp()), int(end.timestamp())


@dataclass(slots=True)
class Verdict:
    tokens_ok: bool  # the token estimate fits (and is now reserved)
    rent_ok: bool  # spent + reserved was below max_rented_spend (the cost estimate is now reserved)
    spent: float
    tokens: float


class Budgets(Protocol):
    """Per (key, period) spend and tokens: MemoryBudgets in this process, RedisBudgets shared by every replica."""

    durable: bool  # counters a crash would lose: each call's reservation is written (`pledge`) before it leaves

    async def reserve(self, key_id: str, start: int, end: int, max_spend: float | None, cost: float,
                      max_tokens: int | None, want_tokens: int) -> Verdict: ...

    async def settle(self, hold: Hold, cost: float, used: int) -> None: ...

    def settle_now(self, hold: Hold, cost: float, used: int) -> bool:
        """Settle without waiting, where that needs no round trip; False: `settle` must do it."""

    async def status(self, key_id: str, start: int, end: int) -> tuple[float, float]: ...

    async def pledge(self, pledge: Pledge) -> None:
        """Write (or raise) the call's reservation before it leaves; raises StoreError if it cannot."""

    def release(self, pledge: Pledge) -> None:
        """The call is settled and the ledger's sums have its figures: its next write drops the reservation."""

    async def forget(self, pledge: Pledge) -> None:
        """The call is settled with nothing the ledger records: drop the reservation now."""


class MemoryBudgets:
    """Budgets in this process (embedded store): per (owner, period) [spent, reserved, tokens, reserved tokens].
    An owner is a key id, or a team's `team:<name>` (`members` then names its keys, whose ledger rows count)."""

    def __init__(self, ledger: SQLiteLedger, members: Callable[[str], Awaitable[list[str]]] | None = None) -> None:
        self.ledger = ledger
        self.members = members  # async (team name) -> its key ids
        self.counts: dict[tuple[str, int], list[float]] = {}
        # the file's written reservations (the SQLite ledger's)
        self.holds: SQLiteHolds | None = getattr(ledger, "holds", None)
        self.durable = self.holds is not None
        self.orphans_settled = not self.durable
        self.settling: asyncio.Lock | None = None

    async def settle_orphans(self) -> None:
        """Before the first count: reservations an earlier process left unsettled go into the ledger at their
        reserved bound."""
        if self.settling is None:
            self.settling = asyncio.Lock()
        async with self.settling:
            if not self.orphans_settled:
                settled = await self.ledger.settle_orphans()
                self.orphans_settled = True
                if settled:
                    log.warning("settled %d budget reservations that a stopped process left open, at their "
                                "reserved bound (ledger rows marked estimated)", settled)

    async def counters(self, key_id: str, start: int) -> list[float]:
        counts = self.counts.get((key_id, start))
        if counts is None:
            if not self.orphans_settled:
                await self.settle_orphans()
            spent = used = 0.0
            team = key_id[len(OWNER_PREFIX):] if key_id.startswith(OWNER_PREFIX) else None
            keys = set(await self.members(team)) if team is not None and self.members is not None else {key_id}
            for row, values in await self.ledger.read(start, time.time() + 86400 * 32,
                                                      key_id=key_id if team is None else None):
                if row.key_id not in keys:
                    continue
                spent += values[COST]
                used += values[PROMPT] + values[COMPLETION]
            counts = self.counts.setdefault((key_id, start), [spent, 0.0, used, 0.0])
            for old in [k for k in self.counts if k[0] == key_id and k[1] != start]:
                del self.counts[old]  # an earlier period is over
        return counts

    async def reserve(self, key_id: str, start: int, end: int, max_spend: float | None, cost: float,
                      max_tokens: int | None, want_tokens: int) -> Verdict:
        c = await self.counters(key_id, start)
        if max_tokens is not None and c[2] + c[3] + min(want_tokens, max_tokens) > max_tokens:
            return Verdict(False, False, c[0], c[2])
        rent = max_spend is not None and c[0] + c[1] < max_spend
        if rent:
            c[1] += cost
        if max_tokens is not None:
            c[3] += want_tokens
        return Verdict(True, rent, c[0], c[2])

    async def settle(self, hold: Hold, cost: float, used: int) -> None:
        self.apply(await self.counters(hold.key_id, hold.start), hold, cost, used)

    def settle_now(self, hold: Hold, cost: float, used: int) -> bool:
        """At once, when the period's counters are here (the hold's reservation made them); False while they
        must first be read from the ledger."""
        c = self.counts.get((hold.key_id, hold.start))
        if c is None:
            return False
        self.apply(c, hold, cost, used)
        return True

    @staticmethod
    def apply(c: list[float], hold: Hold, cost: float, used: int) -> None:
        c[0] += cost
        c[1] -= hold.cost
        c[2] += used
        c[3] -= hold.tokens

    async def status(self, key_id: str, start: int, end: int) -> tuple[float, float]:
        c = await self.counters(key_id, start)
        return c[0], c[2]

    async def pledge(self, pledge: Pledge) -> None:
        if self.holds is not None:
            pledge.id = await self.holds.hold(pledge.row(), pledge.id)

    def release(self, pledge: Pledge) -> None:
        if self.holds is not None and pledge.id is not None:
            self.holds.release(pledge.id)

    async def forget(self, pledge: Pledge) -> None:
        if self.holds is not None and pledge.id is not None:
            await self.holds.forget(pledge.id)


# KEYS: the period's hash. ARGV: max spend (-1: none), cost to reserve, max tokens (-1: none), tokens to
# reserve, expire at. Returns {tokens ok, rent ok, spent, tokens used}.
RESERVE = """
local v = redis.call('HMGET', KEYS[1], 's', 'h', 't', 'ht')
local spent, held, used, held_t = tonumber(v[1] or '0'), tonumber(v[2] or '0'), tonumber(v[3] or '0'),
  tonumber(v[4] or '0')
local max_spend, cost, max_t, want_t = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if max_t >= 0 and used + held_t + math.min(want_t, max_t) > max_t then
  return {0, 0, tostring(spent), tostring(used)}
end
local rent = 0
if max_spend >= 0 and spent + held < max_spend then
  rent = 1
  if cost > 0 then redis.call('HINCRBYFLOAT', KEYS[1], 'h', cost) end
end
if max_t >= 0 and want_t > 0 then redis.call('HINCRBYFLOAT', KEYS[1], 'ht', want_t) end
redis.call('EXPIREAT', KEYS[1], ARGV[5])
return {1, rent, tostring(spent), tostring(used)}
"""
# KEYS: the period's hash. ARGV: reserved cost, real cost, reserved tokens, real tokens, expire at.
SETTLE = """
redis.call('HINCRBYFLOAT', KEYS[1], 'h', -tonumber(ARGV[1]))
redis.call('HINCRBYFLOAT', KEYS[1], 's', ARGV[2])
redis.call('HINCRBYFLOAT', KEYS[1], 'ht', -tonumber(ARGV[3]))
redis.call('HINCRBYFLOAT', KEYS[1], 't', ARGV[4])
redis.call('EXPIREAT', KEYS[1], ARGV[5])
return 1
"""


class RedisBudgets:
    """Budgets in Redis: one hash per key and period, {prefix}budget:{<key id>:<period start>} (its own hash
    slot, so each script touches one slot and runs unchanged on Redis Cluster)."""

    durable = False  # each reservation is an atomic write to the period's hash in Redis already

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._reserve = store.client.register_script(RESERVE)
        self._settle = store.client.register_script(SETTLE)

    def name(self, key_id: str, start: int) -> str:
        return f"{self.store.prefix}budget:{{{key_id}:{start}}}"

    async def reserve(self, key_id: str, start: int, end: int, max_spend: float | None, cost: float,
                      max_tokens: int | None, want_tokens: int) -> Verdict:
        args = [-1 if max_spend is None else repr(float(max_spend)), repr(cost),
                -1 if max_tokens is None else max_tokens, want_tokens, end + 86400]
        async with self.store.guard("budget reserve"):
            ok, rent, spent, used = await self._reserve(keys=[self.name(key_id, start)], args=args)
        return Verdict(bool(ok), bool(rent), float(spent), float(used))

    async def settle(self, hold: Hold, cost: float, used: int) -> None:
        async with self.store.guard("budget settle"):
            await self._settle(keys=[self.name(hold.key_id, hold.start)],
                               args=[repr(hold.cost), repr(cost), hold.tokens, used, hold.end + 86400])

    def settle_now(self, hold: Hold, cost: float, used: int) -> bool:
        return False  # a round trip: always in the background

    async def status(self, key_id: str, start: int, end: int) -> tuple[float, float]:
        async with self.store.guard("budget status"):
            spent, used = await self.store.client.hmget(self.name(key_id, start), "s", "t")
        return float(spent or 0), float(used or 0)

    async def pledge(self, pledge: Pledge) -> None:
        """Nothing more to write: `reserve` was the write."""

    def release(self, pledge: Pledge) -> None:
        """Nothing written, nothing to drop."""

    async def forget(self, pledge: Pledge) -> None:
        """Nothing written, nothing to drop."""


HOLDS: Slot[list[Hold]] = Slot("budget holds")  # what the budget step reserved, to settle when the call ends
# may the call spill to a rented provider now? (its rented cost reserved in each budget, or False): the proxy asks
# at the moment it would rent
BEFORE_RENT: Slot[Callable[[], Awaitable[bool]]] = Slot("before renting")


class Budget:
    """A pipeline step (it reserves on entry) and an observer of finished calls (it settles from the record, whose
    tokens and rented cost are counted once for every observer). Each call counts against its key's budget and,
    for a key in a team, its team's too (every key of the team together): a reservation is taken in each or in
    none, and a call rents only while both have room."""

    name = "budget"
    writes = (HOLDS, BEFORE_RENT)

    def __init__(self, policy: Policy, budgets: Budgets, rented_cost: Callable[[str, int, int], float],
                 background: Background) -> None:
        self.budgets = budgets
        self.rented_cost = rented_cost  # (provider, prompt, completion) -> currency units
        self.background = background
        self.default_max_tokens = policy.rate_limits.default_max_tokens
        self.overflow = {m.name: m.overflow.provider for m in policy.models if m.overflow}
        self.outage_logged = False
        self.durable = getattr(budgets, "durable", False)  # write each call's reservation before it leaves
        self.bucket_seconds = policy.ledger.bucket_seconds
        self.ledger_records = policy.ledger.enabled  # the ledger's observer records each sent call

    @staticmethod
    def owners(call: Call) -> list[tuple[str, KeyBudget, str]]:
        """(budget owner id, its budget, who it is in a refusal) for every budget the call counts against."""
        key = call.key
        assert key is not None  # authenticated by an earlier step
        out = []
        if key.budget is not None:
            out.append((key.id, key.budget, "This API key"))
        team = call.team
        if team is not None and team.budget is not None:
            out.append((team.id, team.budget, f"Team {team.name}"))
        return out

    async def enter(self, call: Call) -> None:
        key, team = call.key, call.team
        if key is not None and key.budget is None and (team is None or team.budget is None):
            return  # the common case, before any list is built
        owners = self.owners(call)
        if not owners:
            return
        holds: list[tuple[Hold, KeyBudget]] = []
        try:
            for owner, budget, who in owners:
                holds.append((await self.enter_one(call, owner, budget, who), budget))
        except BaseException:  # a later budget refused: give back what the earlier ones reserved
            await asyncio.gather(*(self.budgets.settle(hold, 0.0, 0) for hold, _ in holds if hold.tokens))
            raise
        HOLDS.put(call, [hold for hold, _ in holds])
        if self.durable and any(hold.tokens for hold, _ in holds):
            await self.write_pledge(call, [hold for hold, _ in holds], None, 0.0)
        provider = self.overflow.get(call.model) if call.key is not None and call.key.data_policy == "allow_rented" \
            and call.rent_allowed \
            else None
        rented = [(hold, budget) for hold, budget in holds if budget.max_rented_spend is not None]
        if rented and provider is not None:
            BEFORE_RENT.put(call, partial(self.reserve_rents, call, rented, provider))

    async def enter_one(self, call: Call, owner: str, budget: KeyBudget, who: str) -> Hold:
        """Reserve the call's tokens in one owner's budget (or refuse it, holding nothing)."""
        start, end = period_bounds(budget.period, time.time())
        hold = Hold(owner, start, end, 0.0, 0)
        if budget.max_tokens_per_period is None and budget.when_spent != "reject":
            return hold  # only renting is budgeted, and it reserves when (if) the call spills
        want = estimate(call, self.default_max_tokens)[2] if budget.max_tokens_per_period is not None else 0
        verdict = await self.reserve(call, hold, -1 if budget.when_spent != "reject" else budget.max_rented_spend,
                                     0.0, budget.max_tokens_per_period, want)
        if verdict is None:
            return hold
        if not verdict.tokens_ok:
            self.refuse(f"{who} has used its {budget.max_tokens_per_period} tokens for the {budget.period}",
                        "token_budget_exceeded", end)
        hold.tokens = want
        if budget.when_spent == "reject" and budget.max_rented_spend is not None and not verdict.rent_ok:
            HOLDS.take(call)  # settled here: the refused call's record has nothing to settle
            await self.budgets.settle(hold, 0.0, 0)
            self.refuse(f"{who} has spent its rented budget of {budget.max_rented_spend:g} for the "
                        f"{budget.period}", "budget_exceeded", end)
        return hold

    async def reserve(self, call: Call, hold: Hold, max_spend: float | None, cost: float, max_tokens: int | None,
                      want: int) -> Verdict | None:
        """One atomic check-and-reserve; None while the store is down (then the call stays owned)."""
        try:
            verdict = await self.budgets.reserve(hold.key_id, hold.start, hold.end,
                                                 None if max_spend == -1 else max_spend, cost, max_tokens, want)
        except StoreUnavailable:
            if not self.outage_logged:
                self.outage_logged = True
                log.warning("budget store unavailable: budgeted keys stay on owned backends, token budgets admit")
            call.rent_allowed = False
            return None
        self.outage_logged = False
        return verdict

    async def reserve_rents(self, call: Call, rented: list[tuple[Hold, KeyBudget]], provider: str) -> bool:
        """The call is about to spill: reserve its most likely-high rented cost in each budget that has a rented
        spend, if spent + reserved is still below each (so the spend ends within one request's cost of it); if
        one has no room, give back what the others took and stay owned."""
        prompt, output, _ = estimate(call, self.default_max_tokens)
        cost = self.rented_cost(provider, prompt, output)
        taken: list[Hold] = []
        for hold, budget in rented:
            verdict = await self.reserve(call, hold, budget.max_rented_spend, cost, None, 0)
            if verdict is None or not verdict.rent_ok:
                for earlier in taken:
                    await self.budgets.settle(Hold(earlier.key_id, earlier.start, earlier.end, cost, 0), 0.0, 0)
                    earlier.cost = 0.0
                call.rent_allowed = False
                return False
            hold.cost = cost
            taken.append(hold)
        if self.durable and not await self.write_pledge(call, taken, provider, cost):
            for hold in taken:  # not written: not rented, as while the store is down
                await self.budgets.settle(Hold(hold.key_id, hold.start, hold.end, cost, 0), 0.0, 0)
                hold.cost = 0.0
            call.rent_allowed = False
            return False
        return True

    async def write_pledge(self, call: Call, holds: list[Hold], provider: str | None, cost: float) -> bool:
        """Write the call's reservation (raised to its rented cost when it is about to rent) before it leaves;
        False if the store could not (logged once, as an outage)."""
        pledge = next((hold.pledge for hold in holds if hold.pledge is not None), None)
        if pledge is None:
            key = call.key
            assert key is not None
            prompt, output, _ = estimate(call, self.default_max_tokens)
            now = int(time.time())
            pledge = Pledge(now - now % self.bucket_seconds, call.model, key.id, prompt, output)
        if provider is not None:
            pledge.backend, pledge.served, pledge.cost = f"rented:{provider}", RENTED, cost
        try:
            await self.budgets.pledge(pledge)
        except StoreError:
            if not self.outage_logged:
                self.outage_logged = True
                log.warning("budget store unavailable: budgeted keys stay on owned backends, token budgets admit")
            return False
        for hold in HOLDS.get(call) or holds:
            hold.pledge = pledge
        return True

    def refuse(self, message: str, code: str, end: int) -> None:
        wait = max(1, math.ceil(end - time.time()))
        reset = datetime.datetime.fromtimestamp(end, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        raise RateLimited(f"{message}; it resets at {reset}.", code=code,
                          headers={"retry-after": str(wait), "x-budget-reset": reset})

    async def leave(self, call: Call) -> None:
        """Nothing: what `enter` reserved is settled once the call's record is built (`observe`)."""

    def observe(self, record: Finished) -> None:
        """Settle what the call reserved, in each budget it counted against, against what its record counted: its
        tokens (never below 0, so a provider cannot refund a budget) and its rented cost, for an answer a rented
        provider served."""
        call = record.call
        holds = HOLDS.take(call) if call is not None else None
        if not holds:
            return
        cost = record.cost if record.served_by == RENTED else 0.0
        used = record.prompt_tokens + record.completion_tokens
        for hold in holds:
            if not (hold.cost or hold.tokens or cost):
                continue  # nothing reserved, nothing spent
            # in this process: settled before the next request of the key reserves; in Redis: off the request path
            if not self.budgets.settle_now(hold, cost, used):
                self.background(self.budgets.settle(hold, cost, used))
        pledge = holds[0].pledge if holds else None
        if pledge is not None and pledge.id is not None:
            if self.ledger_records:  # the ledger's next write holds the call (if it was sent) and drops the pledge
                self.budgets.release(pledge)
            else:
                self.background(self.budgets.forget(pledge))
