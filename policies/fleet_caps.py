"""Backend caps that hold across every gateway replica: each slot is a lease in Redis.

Per backend one sorted set of leases, one hash of waiting claims and one of min_share credits, all under the
backend's hash tag so every script touches one Redis Cluster slot:

    {prefix}cap:{<backend>}           zset  lease member -> expiry (server time); ZCARD is the fleet's count
    {prefix}cap:{<backend>}:waiting   hash  "<process>|<class rank>" -> "<claim> <last seen>": classes waiting
    {prefix}cap:{<backend>}:share     hash  class rank -> min_share credit (slots owed to the class)

Taking a slot is one script (one round trip): drop expired leases, count, and add a lease if the count plus
the claims of processes waiting longer (by more than `caps.fair_within`, or in a better class) is under the
limit (for a batch-class request, the limit less the replica's `queue.reserve`: the fleet's count then keeps the
reserve free for interactive work across every gateway replica). Priority classes hold across processes as they do in one (policies/admission.py): a process claims
for every class it has waiters of, and a class with a `min_share` gains that share of every lease freed
(given back or expired) while it waits anywhere in the fleet; once its credit is whole the next slot is its,
ahead of better classes: the script refuses the others (one slot is reserved for it), tells them which class
is due, and wakes the process of that class's longest claim; a process told so asks for its own waiter of
that class first. A request that finds room
in the fleet therefore costs one Redis call. Releases are off the request path and batched: a lease given
back travels with the process's next acquire for that backend, or within 2 ms in one call with every other
lease given back meanwhile (at once, with the acquire for its own head waiter, when the process has one).
Leases last
`caps.lease_seconds` and each process renews its own every third of that, so a gateway that dies gives its
slots back within one lease.

Each process keeps its own queue (class first, fair across keys, bounded wait: policies/admission.py) and,
while it has waiters, retries the fleet for the one at its head whenever one of its own slots comes back, when
woken, and at the latest every `caps.poll_interval`. The claim it leaves when refused (class rank, then how
long its head has waited) makes the fleet serve the longest-waiting process first instead of the one that
polls at the right moment; a claim not refreshed for `stale` seconds (five polls: its process died, gave up
or is starved of CPU) is ignored and removed, so a free slot never waits long for a process that cannot take
it; that process claims again, with its waiter's age, at its next poll. A script that leaves room which another process's claim is first in line for wakes that process:
it pushes to the process's list `{prefix}cap:{<backend>}:wake:<process>` (same hash tag, so the same slot),
on which the waiting process blocks (BLPOP). A slot freed in one process so reaches the longest waiter in
another within a round trip instead of half a poll interval on average, which at a few hundred milliseconds
per stream is the difference between a fleet that keeps its backend full and one that does not.

While Redis is unreachable, `rate_limits.on_store_failure.concurrency` decides: fail_closed (the default)
answers 503 to requests that need a new slot; fail_open admits under the cap counted in this process alone,
so N replicas may send a backend up to N x its cap. Both are logged once per outage and counted in
llm_gateway_cap_store_failures_total. A lease whose give-back the store missed (a request that ended during the
outage, or an acquire whose answer was lost with the old primary, which may have granted it) is sent again
every RETRY_EVERY seconds, and with the next acquire for its backend, until the store answers (a promoted
replica has the lease too) or the lease must have run out: after a failover the backend is back at its full
cap as soon as the new primary answers, not one lease later.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from functools import partial
from typing import NamedTuple

from backends.replicas import Replica
from policies.admission import ModelQueue, Waiter
from policies.config import Caps, Priorities, Queue
from policies.errors import StateUnavailable
from policies.metrics import GatewayMetrics
from policies.pipeline import Call
from policies.see_through import see_through
from policies.routing import Profile
from policies.store import StoreError, StoreUnavailable
from policies.store.redis import RedisStore
from policies.store.pipelined import integer, integers
from policies.store.release_batch import ReleaseBatch

log = logging.getLogger("gateway.caps")

WAKE_WAIT = 0.5  # seconds one blocking wait for a wake-up lasts (under the store's socket timeout)
RETRY_EVERY = 0.25  # seconds between tries to give back leases the store missed

NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# Claims: the waiting hash maps "<process>|<class rank>" to "<claim> <last seen>" (claim: rank * 1e10 + when its
# head started waiting), one per class a process has waiters of. `live_claims` reads them and drops the stale.
# `owed` keeps each class's min_share credit in the `share` hash (rank -> credit): every lease freed (given back
# or expired) adds a waiting class's share to its credit, a class no longer waiting loses it; the first class
# whose credit is whole is due: the next slot is its, ahead of better classes (policies/admission.py does the
# same in one process). `wake_first` pushes a wake-up to the process whose live claim is first in line (of the
# due class when there is one), other than `me` (which acts on its own).
CLAIMS = """
local function live_claims(waiting, stale, now)
  local raw = redis.call('HGETALL', waiting)
  local claims = {}
  for i = 1, #raw, 2 do
    local c, seen = string.match(raw[i + 1], '^(%S+) (%S+)$')
    if tonumber(seen) < now - stale then
      redis.call('HDEL', waiting, raw[i])
    else  -- (a field without its rank: a process of the version before, during a rolling update)
      local who = string.match(raw[i], '^(.*)|%d+$') or raw[i]
      claims[#claims + 1] = {who = who, rank = math.floor(tonumber(c) / 1e10), claim = tonumber(c)}
    end
  end
  return claims
end

local function owed(share, shares, claims, freed)
  local waiting = {}
  for _, c in ipairs(claims) do waiting[c.rank] = true end
  local due, r = nil, 0
  for s in string.gmatch(shares, '%S+') do
    local part = tonumber(s)
    if part > 0 then
      if waiting[r] then
        local credit = tonumber(redis.call('HGET', share, r) or '0')
        if freed > 0 then credit = tonumber(redis.call('HINCRBYFLOAT', share, r, part * freed)) end
        if due == nil and credit >= 1 then due = r end
      else
        redis.call('HDEL', share, r)
      end
    end
    r = r + 1
  end
  if freed > 0 then redis.call('EXPIRE', share, 3600) end
  return due
end

local function wake_first(waiting, me, claims, due)
  local first, who = nil, nil
  for _, c in ipairs(claims) do
    if c.who ~= me and (due == nil or c.rank == due) and (first == nil or c.claim < first) then
      first, who = c.claim, c.who
    end
  end
  if who then
    local wake = waiting .. ':wake:' .. who
    redis.call('LPUSH', wake, '1')
    redis.call('LTRIM', wake, 0, 0)
    redis.call('PEXPIRE', wake, 2000)
  end
end
"""

# KEYS: leases, waiting, share. ARGV: limit, member, lease, process, rank, waited, register (1/0), stale,
# fair_within, each class's min_share ("0 0.1"), this process's other waiting classes ("<rank>:<waited> ..."),
# then leases this process gives back first. With `register`, this process's claims become the asked class's
# and the others given, before anything is decided. Returns {1 granted / 0 refused, leases held after, the due
# class's rank or -1, live claims of the asked class in other processes}.
ACQUIRE = NOW + CLAIMS + """
local limit, lease, stale = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[8])
local me, rank = ARGV[4], tonumber(ARGV[5])
local claim = rank * 1e10 + now - tonumber(ARGV[6])
local ahead_by = claim - tonumber(ARGV[9])  -- claims before this are ahead (a better class always is)
local freed = 0
if #ARGV > 11 then freed = redis.call('ZREM', KEYS[1], unpack(ARGV, 12)) end
freed = freed + redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if ARGV[7] == '1' then
  local keep, ranks = {}, 0
  for _ in string.gmatch(ARGV[10], '%S+') do ranks = ranks + 1 end
  for r, waited in string.gmatch(ARGV[5] .. ':' .. ARGV[6] .. ' ' .. ARGV[11], '(%d+):(%S+)') do
    redis.call('HSET', KEYS[2], me .. '|' .. r,
               string.format('%.6f %.6f', tonumber(r) * 1e10 + now - tonumber(waited), now))
    keep[tonumber(r)] = true
  end
  for r = 0, ranks - 1 do
    if not keep[r] then redis.call('HDEL', KEYS[2], me .. '|' .. r) end
  end
  redis.call('EXPIRE', KEYS[2], math.ceil(stale) + 60)
end
local claims = live_claims(KEYS[2], stale, now)
local due = owed(KEYS[3], ARGV[10], claims, freed)
local ahead, peers = 0, 0
for _, c in ipairs(claims) do
  if c.who ~= me then
    if c.rank == rank then peers = peers + 1 end
    if c.claim < ahead_by and (due ~= rank or c.rank == rank) then ahead = ahead + 1 end
  end
end
if due ~= nil and due ~= rank then ahead = ahead + 1 end  -- the next slot is the due class's
if held + ahead < limit then
  redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
  redis.call('EXPIRE', KEYS[1], math.ceil(lease) + 60)
  redis.call('HDEL', KEYS[2], me .. '|' .. rank)
  if due == rank then
    redis.call('HINCRBYFLOAT', KEYS[3], rank, -1)
    due = nil
  end
  if held + 1 < limit and #claims > 0 then wake_first(KEYS[2], me, claims, due) end
  return {1, held + 1, due or -1, peers}
end
if held < limit then wake_first(KEYS[2], me, claims, due) end
return {0, held, due or -1, peers}
"""

# KEYS: leases, waiting, share. ARGV: limit, process, stale, each class's min_share, then the members given back.
# Returns the leases held after.
RELEASE = NOW + CLAIMS + """
local freed = redis.call('ZREM', KEYS[1], unpack(ARGV, 5))
freed = freed + redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held < tonumber(ARGV[1]) or string.find(ARGV[4], '[1-9]') then  -- room to hand over, or credits to keep
  local claims = live_claims(KEYS[2], tonumber(ARGV[3]), now)
  local due = owed(KEYS[3], ARGV[4], claims, freed)
  if held < tonumber(ARGV[1]) then wake_first(KEYS[2], ARGV[2], claims, due) end
end
return held
"""

# KEYS: leases. ARGV: lease, then the members this process holds. Returns {leases held, members found expired}.
RENEW = NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lease, lost = tonumber(ARGV[1]), 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i])
  else
    lost = lost + 1
  end
end
if #ARGV > 1 then redis.call('EXPIRE', KEYS[1], math.ceil(lease) + 60) end
return {redis.call('ZCARD', KEYS[1]), lost}
"""


class Grant(NamedTuple):
    """What an acquire got: `member`, the new lease (None: no room for this process now); `held`, the fleet's
    leases after; `due`, the class the fleet owes the next slot by its min_share (None: none); `peers`, the
    other processes waiting with a request of the asked class."""

    member: str | None
    held: int
    due: int | None = None
    peers: int = 0


class FleetSlots:
    """The Redis side: one script per acquire, release and renewal, through the store's client and guard."""

    def __init__(self, store: RedisStore, caps: Caps) -> None:
        self.store = store
        self.lease = caps.lease_seconds
        self.poll = caps.poll_interval
        # a process with waiters refreshes its claim at every poll; one not refreshed for five polls is starved
        # or gone, and a free slot must not sit idle waiting for it (it claims again, with its wait, when back)
        self.stale = max(0.1, 5 * caps.poll_interval)
        self.fair_within = caps.fair_within
        self.prefix = f"{store.prefix}cap:"
        self.process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.members = itertools.count()
        self.down_until = 0.0  # after a failure, skip Redis for a second instead of paying its deadline per request
        self._acquire = store.script(ACQUIRE)
        self._release = store.script(RELEASE)
        self._renew = store.script(RENEW)

    def leases(self, backend: str) -> str:
        return f"{self.prefix}{{{backend}}}"

    def waiting(self, backend: str) -> str:
        return f"{self.prefix}{{{backend}}}:waiting"

    def share(self, backend: str) -> str:
        return f"{self.prefix}{{{backend}}}:share"

    def wake_list(self, backend: str) -> str:
        return f"{self.waiting(backend)}:wake:{self.process}"

    @property
    def down(self) -> bool:
        return time.monotonic() < self.down_until

    @contextlib.asynccontextmanager
    async def guard(self, op: str) -> AsyncIterator[None]:
        try:
            async with self.store.guard(op):
                yield
        except StoreUnavailable:
            self.down_until = time.monotonic() + 1.0
            raise
        self.down_until = 0.0  # it answers again: no need to wait out the second

    def new_member(self) -> str:
        return f"{self.process}:{next(self.members)}"

    async def acquire(self, backend: str, limit: int, rank: int, waited: float, register: bool,
                      give_back: Sequence[str] = (), member: str | None = None, shares: str = "0",
                      others: str = "") -> Grant:
        """A lease for a request of class `rank` whose wait began `waited` s ago, or none when the fleet has no
        room for it now. `give_back`: leases of this process to release first, in the same round trip.
        `shares`: each class's min_share, space-separated, in rank order; `others`: with `register`, this
        process's other waiting classes as "<rank>:<waited>" (see ACQUIRE)."""
        member = member or self.new_member()
        async with self.guard("cap_acquire"):
            granted, held, due, peers = integers(await self._acquire(
                keys=[self.leases(backend), self.waiting(backend), self.share(backend)],
                args=[limit, member, self.lease, self.process, rank, f"{waited:.6f}", int(register), self.stale,
                      self.fair_within, shares, others, *give_back]), 4)
        return Grant(member if granted else None, held, None if due < 0 else due, peers)

    async def release(self, backend: str, limit: int, members: Sequence[str], shares: str = "0") -> int:
        async with self.guard("cap_release"):
            return integer(await self._release(keys=[self.leases(backend), self.waiting(backend), self.share(backend)],
                                               args=[limit, self.process, self.stale, shares, *members]))

    async def woken(self, backend: str, timeout: float) -> bool:
        """Block up to `timeout` s until another process's script leaves room this process is first in line for."""
        async with self.guard("cap_wait"):
            return await self.store.client.blpop([self.wake_list(backend)], timeout=timeout) is not None

    async def renew(self, backend: str, members: Sequence[str]) -> tuple[int, int]:
        async with self.guard("cap_renew"):
            held, lost = integers(await self._renew(keys=[self.leases(backend)], args=[self.lease, *members]), 2)
        return held, lost

    async def withdraw(self, backend: str, ranks: int) -> None:
        """This process no longer waits for the backend: its claims (one per class) must not hold others back."""
        async with self.guard("cap_withdraw"):
            await self.store.client.hdel(self.waiting(backend), *(f"{self.process}|{r}" for r in range(ranks)))

    async def held(self, backend: str) -> int:
        """Leases held across the fleet now (for tests and tools)."""
        async with self.guard("cap_held"):
            return int(await self.store.client.zcount(self.leases(backend), f"({time.time()}", "+inf"))

    async def renew_forever(self, queues: Callable[[], list[FleetModelQueue]]) -> None:
        """Every third of a lease: extend this process's leases and refresh the fleet-wide counts, for the
        queues `queues()` names now (a reloaded policy brings new ones)."""
        while True:
            await asyncio.sleep(self.lease / 3)
            for queue in queues():
                try:
                    await queue.renew()
                except Exception:  # one bad round must not end the renewals (and so every lease)
                    log.exception("renewing the slot leases of model %s failed", queue.model)


class FleetModelQueue(ModelQueue):
    """A model's queue whose caps count every gateway replica's requests (see the module's docstring)."""

    def __init__(self, model: str, replicas: list[Replica], config: Queue, profile: Profile,
                 metrics: GatewayMetrics, priorities: Priorities | None = None, *, fleet: FleetSlots,
                 on_store_failure: str) -> None:
        super().__init__(model, replicas, config, profile, metrics, priorities)
        self.fleet = fleet
        self.mode = on_store_failure
        self.held: dict[Replica, list[str | None]] = {r: [] for r in self.replicas}  # None: counted locally only
        # a replica discovery adds later starts at 0 too, until its first acquire or renewal says more
        self.fleet_count: dict[Replica, int] = defaultdict(int, dict.fromkeys(self.replicas, 0))
        self.claimed: set[Replica] = set()  # backends where this process left a waiting claim
        # leases given back but not yet sent to Redis: with the next acquire for the backend, or in a batch
        self.returning: ReleaseBatch[Replica, str] = ReleaseBatch(self.send_back)
        self.stranded: dict[Replica, dict[str, float]] = {}  # leases the store missed -> when to stop trying
        self.retrier: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.poller: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()  # another process left room this one is first in line for
        self.listeners: dict[Replica, asyncio.Task[None]] = {}
        self.pumping = self.pump_again = False
        self.outage_logged = False
        self.due: dict[Replica, int] = {}  # the class each backend's fleet owes its next slot (min_share)
        self.peers: dict[int, int] = {}  # by class rank: other processes waiting with that class, last seen

    @property
    def shares(self) -> str:
        """Each class's min_share in rank order, as the scripts take them."""
        return " ".join(f"{c.min_share:g}" for c in self.classes)

    def others(self, rank: int) -> str:
        """This process's waiting classes but `rank`, with how long each one's head has waited."""
        now = time.monotonic()
        return " ".join(f"{r}:{now - started:.6f}" for r, started in self.line.heads() if r != rank)

    def first_due(self) -> int | None:
        """A class the fleet owes a slot that waits here: it goes first."""
        due = [rank for rank in self.due.values() if self.waits(rank)]
        return min(due) if due else None

    def waits(self, rank: int) -> bool:
        """Whether requests of class `rank` wait here (a rank a reload removed: no)."""
        return rank < len(self.line.depths) and self.line.depths[rank] > 0

    def busy(self, replica: Replica) -> int:
        return self.fleet_count[replica]

    def share_rate(self, rank: int) -> float | None:
        """The class's share of the slots the fleet frees, estimated from this process's completions scaled by
        its part of the leases held (its requests run on the same backends as the others'), split among the
        processes whose waiters of that class the fleet serves in turn."""
        rate = super().share_rate(rank)
        if rate is None:
            return None
        capped = [r for r in self.replicas if r.limit is not None]
        mine, fleet = sum(r.in_flight for r in capped), sum(self.fleet_count.get(r, 0) for r in capped)
        return rate * (fleet / mine if mine and fleet > mine else 1.0) / (1 + self.peers.get(rank, 0))

    def seen(self, replica: Replica, held: int) -> None:
        self.fleet_count[replica] = held
        self.held_gauge(replica.name).set(held)

    def spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def take(self, replica: Replica, member: str | None = None) -> Replica:
        replica.in_flight += 1
        self.in_flight_gauge(replica.name).inc()
        self.held.setdefault(replica, []).append(member)
        if member is None:
            self.held_gauge(replica.name).set(max(self.fleet_count[replica], replica.in_flight))
        return replica

    async def take_now(self, call: Call | None, exclude: Sequence[Replica], rank: int, will_wait: bool) -> Replica | None:
        # what this process last saw of the fleet spares a round trip to a backend known to be full; the
        # queue's poller asks Redis about every replica, so a stale view only delays, never blocks
        candidates = [r for r in self.replicas if r.limit is None or self.fleet_count[r] < self.limit_for(r, rank)]
        return await self.take_among(call, exclude, candidates, rank, 0.0, will_wait)

    async def take_among(self, call: Call | None, exclude: Sequence[Replica], candidates: list[Replica], rank: int,
                         waited: float, register: bool) -> Replica | None:
        while candidates:
            replica = self.profile.pick(call, candidates, exclude=exclude)
            if replica is None:
                return None
            if replica.limit is None:
                return self.take(replica)  # no cap: nothing to share
            if self.fleet.down:
                return self.take_locally(call, exclude, candidates, rank)
            asked = self.fleet.new_member()
            returned, stranded = self.returning.take(replica), self.stranded.pop(replica, {})
            try:
                got = await see_through(
                    self.fleet.acquire(replica.name, self.limit_for(replica, rank), rank, waited, register,
                                       [*returned, *stranded], asked, self.shares,
                                       self.others(rank) if register else ""),
                    partial(self.orphaned, replica))
            except StoreUnavailable:  # the old primary may have granted `asked` before it went
                self.stranded.setdefault(replica, {}).update(stranded)
                self.strand(replica, [asked, *returned])
                return self.take_locally(call, exclude, candidates, rank)
            self.outage_logged = False
            self.seen(replica, got.held)
            self.note_due(replica, got)
            self.peers[rank] = got.peers
            if got.member is not None:
                self.claimed.discard(replica)
                return self.take(replica, got.member)
            if register:
                self.claim(replica)
            due = self.due.get(replica)
            if due is not None and due != rank and self.waits(due):
                self.dispatch()  # the slot is owed to a class that waits here too: its waiter asks next
            candidates = [r for r in candidates if r is not replica]
        return None

    def orphaned(self, replica: Replica, got: Grant) -> None:
        """An acquire whose request went away ended: a lease it got goes back with the next release batch."""
        self.seen(replica, got.held)
        self.note_due(replica, got)
        if got.member is not None:
            self.returning.add(replica, got.member)

    def note_due(self, replica: Replica, got: Grant) -> None:
        if got.due is None or got.due >= len(self.classes):  # (a rank of an older policy's classes: none here)
            self.due.pop(replica, None)
        else:
            self.due[replica] = got.due

    def claim(self, replica: Replica) -> None:
        self.claimed.add(replica)
        if replica not in self.listeners:
            self.listeners[replica] = asyncio.get_running_loop().create_task(self.listen(replica))

    async def listen(self, replica: Replica) -> None:
        """While this process waits for the backend: block on its wake list, and wake the poller when pushed."""
        try:
            while replica in self.claimed and self.depth:
                if await self.fleet.woken(replica.name, WAKE_WAIT):
                    self.wake.set()
        except StoreError:  # StoreUnavailable too: the poller's interval still serves the queue
            pass
        finally:
            self.listeners.pop(replica, None)

    def take_locally(self, call: Call | None, exclude: Sequence[Replica], candidates: list[Replica],
                     rank: int) -> Replica | None:
        """The shared store is unreachable: follow on_store_failure, loudly (fail_open: the cap counted in this
        process alone, less the reserve for a batch-class request, as in one process)."""
        self.metrics.cap_store_failures.labels(self.model, self.mode).inc()
        if not self.outage_logged:
            self.outage_logged = True
            if self.mode == "fail_open":
                log.warning("cap store unavailable: caps of model %s fail open, counted in this process only (the"
                            " gateway replicas together may exceed a backend's cap)", self.model)
            else:
                log.warning("cap store unavailable: model %s refuses requests that need a slot (fail_closed)",
                            self.model)
        if self.mode != "fail_open":
            raise StateUnavailable("the backend slot store is unavailable; try again shortly")
        room = [r for r in candidates if r.limit is None or r.in_flight < self.limit_for(r, rank)]
        replica = self.profile.pick(call, room, exclude=exclude)
        return None if replica is None else self.take(replica)

    def release(self, replica: Replica, call: Call | None = None) -> None:
        """(`call`: the per-process hold for a class's next request is not kept here: across processes the
        freed lease goes to the claim first in line: the due class's (min_share), else the best class's longest.)"""
        if self.batch_held and call is not None:
            self.batch_held.discard(id(call))
        replica.end()
        self.in_flight_gauge(replica.name).dec()
        self.drain.tick(time.monotonic())
        held = self.held.get(replica)
        member = held.pop() if held else None
        if member is None:
            self.held_gauge(replica.name).set(max(self.fleet_count[replica], replica.in_flight))
        else:  # with the next acquire for this backend, or within the batch's 2 ms with the others given back
            self.returning.add(replica, member)
        self.dispatch()  # waiters here: the pump's acquire carries the lease back at once

    async def send_back(self, batch: dict[Replica, list[str]]) -> None:
        """The leases given back meanwhile, one script call per backend; then serve the waiters they free."""
        for replica, members in batch.items():
            try:
                self.seen(replica, await self.fleet.release(replica.name, int(replica.limit or 1 << 30), members,
                                                            self.shares))
            except StoreUnavailable:
                self.strand(replica, members)
        await self.pump()

    def strand(self, replica: Replica, members: Sequence[str]) -> None:
        """Leases the store missed: tried again until it answers, for as long as one may still be held there
        (a lease from now: none of them was renewed since)."""
        until = time.monotonic() + self.fleet.lease
        stranded = self.stranded.setdefault(replica, {})
        for member in members:
            stranded.setdefault(member, until)
        if self.retrier is None and stranded:
            log.warning("could not give back %d slot(s) of backend %s while the store is down; trying again"
                        " until it answers", len(members), replica.name)
            self.retrier = asyncio.get_running_loop().create_task(self.retry_stranded())

    async def retry_stranded(self) -> None:
        try:
            while self.stranded:
                await asyncio.sleep(RETRY_EVERY)
                now = time.monotonic()
                for replica, stranded in list(self.stranded.items()):
                    members = [m for m, until in stranded.items() if until > now]
                    if len(members) < len(stranded):  # their leases have run out: nothing left to give back
                        self.stranded[replica] = stranded = {m: stranded[m] for m in members}
                    if not members:
                        self.stranded.pop(replica, None)
                        continue
                    try:
                        held = await self.fleet.release(replica.name, int(replica.limit or 1 << 30), members,
                                                        self.shares)
                    except StoreUnavailable:
                        continue
                    for member in members:
                        stranded.pop(member, None)
                    if not stranded and self.stranded.get(replica) is stranded:
                        del self.stranded[replica]
                    self.seen(replica, held)
                    log.info("gave back %d slot(s) of backend %s the store had missed", len(members), replica.name)
                self.dispatch()
        finally:
            self.retrier = None

    def dispatch(self, first: int | None = None) -> None:
        """(`first`, a class this process owes a slot, is ignored: the fleet keeps the min_share credits, and
        the pump serves the class it says is due first.)"""
        if self.depth:
            self.spawn(self.pump())

    def push(self, waiter: Waiter, front: bool = False) -> None:
        super().push(waiter, front)
        if self.poller is None:  # someone waits here now: ask the fleet until nobody does
            self.poller = asyncio.get_running_loop().create_task(self.poll())

    async def pump(self) -> None:
        """Serve waiters from the head of the line for as long as the fleet has room for them."""
        if self.pumping:
            self.pump_again = True
            return
        self.pumping = True
        try:
            while self.depth:
                self.pump_again = False
                waiter = self.pop(self.first_due())
                candidates = [r for r in self.replicas if r.routable and r not in waiter.exclude]
                try:
                    replica = await self.take_among(waiter.call, waiter.exclude, candidates, waiter.rank,
                                                    time.monotonic() - waiter.started, True)
                except StateUnavailable:
                    replica = None
                if replica is None:
                    if waiter.future.done():
                        pass
                    elif self.may_wait(waiter.exclude, waiter.spill_after):
                        self.push(waiter, front=True)
                    else:  # its last replica went while the fleet was asked (fail_stranded, for this one)
                        self.turn_away(waiter)
                        continue
                    if not self.pump_again:
                        break
                elif waiter.future.done():  # it gave up while the slot was on its way
                    self.release(replica)
                else:
                    waiter.future.set_result(replica)
        finally:
            self.pumping = False

    async def poll(self) -> None:
        try:
            while self.depth:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.fleet.poll):
                        await self.wake.wait()
                self.wake.clear()
                await self.pump()
        finally:
            self.poller = None
        for replica in list(self.claimed):  # nobody waits here any more: stop holding others back
            self.claimed.discard(replica)
            with contextlib.suppress(StoreUnavailable):
                await self.fleet.withdraw(replica.name, len(self.classes))

    async def renew(self) -> None:
        for replica in self.replicas:
            if replica.limit is None:
                continue
            members = [m for m in self.held.get(replica, ()) if m is not None]
            try:
                held, lost = await self.fleet.renew(replica.name, members)
            except StoreUnavailable:
                continue
            self.seen(replica, held)
            if lost:
                self.metrics.cap_leases_lost.labels(self.model, replica.name).inc(lost)
                log.warning("%d slot lease(s) of backend %s expired while their requests ran (this process"
                            " stalled longer than caps.lease_seconds)", lost, replica.name)

    async def close(self) -> None:
        if self.poller is not None:
            self.poller.cancel()
        if self.retrier is not None:
            self.retrier.cancel()
        for listener in list(self.listeners.values()):
            listener.cancel()
        await self.returning.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)
