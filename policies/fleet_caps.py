"""Backend caps that hold across every gateway replica: each slot is a lease in Redis.

Per backend one sorted set of leases and one hash of waiting claims, both under the backend's hash tag so
every script touches one Redis Cluster slot:

    {prefix}cap:{<backend>}           zset  lease member -> expiry (server time); ZCARD is the fleet's count
    {prefix}cap:{<backend>}:waiting   hash  process -> "<claim> <last seen>": processes with waiters

Taking a slot is one script (one round trip): drop expired leases, count, and add a lease if the count plus
the claims of processes waiting longer (by more than `caps.fair_within`, or in a better class) is under the
limit. A request that finds room
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
from collections.abc import Callable, Sequence
from functools import partial

from backends.replicas import Replica
from policies.admission import ModelQueue
from policies.config import Caps
from policies.errors import StateUnavailable
from policies.pipeline import Call
from policies.see_through import see_through
from policies.store import StoreError, StoreUnavailable
from policies.store.release_batch import ReleaseBatch

log = logging.getLogger("gateway.caps")

WAKE_WAIT = 0.5  # seconds one blocking wait for a wake-up lasts (under the store's socket timeout)
RETRY_EVERY = 0.25  # seconds between tries to give back leases the store missed

NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# Push a wake-up to the process whose live claim is first in line, other than `me` (which acts on its own).
WAKE = """
local function wake_first(waiting, me, stale, now)
  local claims = redis.call('HGETALL', waiting)
  local first, who = nil, nil
  for i = 1, #claims, 2 do
    local c, seen = string.match(claims[i + 1], '^(%S+) (%S+)$')
    if claims[i] ~= me and tonumber(seen) >= now - stale and (first == nil or tonumber(c) < first) then
      first, who = tonumber(c), claims[i]
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

# KEYS: leases, waiting. ARGV: limit, member, lease, process, rank, waited, register (1/0), stale, fair_within,
# then leases this process gives back first. Returns {1 granted / 0 refused, leases held after}.
ACQUIRE = NOW + WAKE + """
local limit, lease, stale = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[8])
local me = ARGV[4]
local claim = tonumber(ARGV[5]) * 1e10 + now - tonumber(ARGV[6])
local ahead_by = claim - tonumber(ARGV[9])  -- claims before this are ahead (a better class always is)
if #ARGV > 9 then redis.call('ZREM', KEYS[1], unpack(ARGV, 10)) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
local ahead = 0
local claims = redis.call('HGETALL', KEYS[2])
for i = 1, #claims, 2 do
  local c, seen = string.match(claims[i + 1], '^(%S+) (%S+)$')
  if tonumber(seen) < now - stale then
    redis.call('HDEL', KEYS[2], claims[i])
  elseif claims[i] ~= me and tonumber(c) < ahead_by then
    ahead = ahead + 1
  end
end
if held + ahead < limit then
  redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
  redis.call('EXPIRE', KEYS[1], math.ceil(lease) + 60)
  redis.call('HDEL', KEYS[2], me)
  if held + 1 < limit and #claims > 0 then wake_first(KEYS[2], me, stale, now) end
  return {1, held + 1}
end
if ARGV[7] == '1' then
  redis.call('HSET', KEYS[2], me, string.format('%.6f %.6f', claim, now))
  redis.call('EXPIRE', KEYS[2], math.ceil(stale) + 60)
end
if held < limit then wake_first(KEYS[2], me, stale, now) end
return {0, held}
"""

# KEYS: leases, waiting. ARGV: limit, process, stale, then the members given back. Returns the leases held after.
RELEASE = NOW + WAKE + """
redis.call('ZREM', KEYS[1], unpack(ARGV, 4))
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held < tonumber(ARGV[1]) then wake_first(KEYS[2], ARGV[2], tonumber(ARGV[3]), now) end
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


class FleetSlots:
    """The Redis side: one script per acquire, release and renewal, through the store's client and guard."""

    def __init__(self, store, caps: Caps) -> None:
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

    def wake_list(self, backend: str) -> str:
        return f"{self.waiting(backend)}:wake:{self.process}"

    @property
    def down(self) -> bool:
        return time.monotonic() < self.down_until

    @contextlib.asynccontextmanager
    async def guard(self, op: str):
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
                      give_back: Sequence[str] = (), member: str | None = None) -> tuple[str | None, int]:
        """(the new lease's member, `member` if given, or None when the fleet has no room for this process now;
        leases held). `give_back`: leases of this process to release first, in the same round trip."""
        member = member or self.new_member()
        async with self.guard("cap_acquire"):
            granted, held = await self._acquire(
                keys=[self.leases(backend), self.waiting(backend)],
                args=[limit, member, self.lease, self.process, rank, f"{waited:.6f}", int(register), self.stale,
                      self.fair_within, *give_back])
        return (member if int(granted) else None), int(held)

    async def release(self, backend: str, limit: int, members: Sequence[str]) -> int:
        async with self.guard("cap_release"):
            return int(await self._release(keys=[self.leases(backend), self.waiting(backend)],
                                           args=[limit, self.process, self.stale, *members]))

    async def woken(self, backend: str, timeout: float) -> bool:
        """Block up to `timeout` s until another process's script leaves room this process is first in line for."""
        async with self.guard("cap_wait"):
            return await self.store.client.blpop([self.wake_list(backend)], timeout=timeout) is not None

    async def renew(self, backend: str, members: Sequence[str]) -> tuple[int, int]:
        async with self.guard("cap_renew"):
            held, lost = await self._renew(keys=[self.leases(backend)], args=[self.lease, *members])
        return int(held), int(lost)

    async def withdraw(self, backend: str) -> None:
        """This process no longer waits for the backend: its claim must not hold others back."""
        async with self.guard("cap_withdraw"):
            await self.store.client.hdel(self.waiting(backend), self.process)

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

    def __init__(self, *args, fleet: FleetSlots, on_store_failure: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fleet = fleet
        self.mode = on_store_failure
        self.held: dict[Replica, list[str | None]] = {r: [] for r in self.replicas}  # None: counted locally only
        self.fleet_count: dict[Replica, int] = dict.fromkeys(self.replicas, 0)
        self.claimed: set[Replica] = set()  # backends where this process left a waiting claim
        # leases given back but not yet sent to Redis: with the next acquire for the backend, or in a batch
        self.returning: ReleaseBatch[Replica, str] = ReleaseBatch(self.send_back)
        self.stranded: dict[Replica, dict[str, float]] = {}  # leases the store missed -> when to stop trying
        self.retrier: asyncio.Task | None = None
        self.tasks: set[asyncio.Task] = set()
        self.poller: asyncio.Task | None = None
        self.wake = asyncio.Event()  # another process left room this one is first in line for
        self.listeners: dict[Replica, asyncio.Task] = {}
        self.pumping = self.pump_again = False
        self.outage_logged = False

    def busy(self, replica: Replica) -> int:
        return self.fleet_count[replica]

    def seen(self, replica: Replica, held: int) -> None:
        self.fleet_count[replica] = held
        self.held_gauge(replica.name).set(held)

    def spawn(self, coro) -> None:
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
        candidates = [r for r in self.replicas if r.limit is None or self.fleet_count[r] < int(r.limit)]
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
                return self.take_locally(call, exclude, candidates)
            asked = self.fleet.new_member()
            returned, stranded = self.returning.take(replica), self.stranded.pop(replica, {})
            try:
                member, held = await see_through(
                    self.fleet.acquire(replica.name, int(replica.limit), rank, waited, register,
                                       [*returned, *stranded], asked),
                    partial(self.orphaned, replica))
            except StoreUnavailable:  # the old primary may have granted `asked` before it went
                self.stranded.setdefault(replica, {}).update(stranded)
                self.strand(replica, [asked, *returned])
                return self.take_locally(call, exclude, candidates)
            self.outage_logged = False
            self.seen(replica, held)
            if member is not None:
                self.claimed.discard(replica)
                return self.take(replica, member)
            if register:
                self.claim(replica)
            candidates = [r for r in candidates if r is not replica]
        return None

    def orphaned(self, replica: Replica, got: tuple[str | None, int]) -> None:
        """An acquire whose request went away ended: a lease it got goes back with the next release batch."""
        member, held = got
        self.seen(replica, held)
        if member is not None:
            self.returning.add(replica, member)

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

    def take_locally(self, call: Call | None, exclude: Sequence[Replica], candidates: list[Replica]) -> Replica | None:
        """The shared store is unreachable: follow on_store_failure, loudly."""
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
        replica = self.profile.pick(call, [r for r in candidates if r.has_room], exclude=exclude)
        return None if replica is None else self.take(replica)

    def release(self, replica: Replica, call: Call | None = None) -> None:
        """(`call`: the per-process hold for a class's next request is not kept here: across processes the
        freed lease goes to the longest claim, whatever this process's classes do.)"""
        replica.in_flight -= 1
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
                self.seen(replica, await self.fleet.release(replica.name, int(replica.limit or 1 << 30), members))
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
                        held = await self.fleet.release(replica.name, int(replica.limit or 1 << 30), members)
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
        """(`first`, a class owed a slot by its min_share, is not honoured across processes: see release.)"""
        if self.depth:
            self.spawn(self.pump())

    def push(self, waiter, front: bool = False) -> None:
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
                waiter = self.pop()
                candidates = [r for r in self.replicas if r.routable and r not in waiter.exclude]
                try:
                    replica = await self.take_among(waiter.call, waiter.exclude, candidates, waiter.rank,
                                                    time.monotonic() - waiter.started, True)
                except StateUnavailable:
                    replica = None
                if replica is None:
                    if not waiter.future.done():
                        self.push(waiter, front=True)
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
                await self.fleet.withdraw(replica.name)

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
