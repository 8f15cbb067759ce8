"""Admission: never more than a backend's cap in flight to it; the rest wait in a bounded, fair queue.

Per model, a request takes a replica that is routable and under its cap (the routing profile chooses among
them). When none has room it waits: FIFO within each API key and round-robin across keys, so one key's burst
cannot starve the others. A slot freed by a finished request goes straight to the next waiter. A request that
finds the queue full, or waits past `queue.max_wait`, gets a 429 whose Retry-After is estimated from the rate
at which the model's requests have been completing. A waiter whose client disconnects is cancelled and leaves
the queue at once, so it never reaches a backend. A request whose client sent its timeout (policies/deadline.py)
waits no longer than that, and is refused at once (`past_deadline`) when that rate says its slot comes after.

Adaptive limits (per backend, optional) follow the live knee below the measured cap, AIMD style, from the time
to first token of streamed requests: an answer slower than `target_ttft` cuts the limit by 10% (at most once
a second, so one slow burst is one cut, never below `floor`); an answer within target while the backend is
using its whole limit raises it by 1/limit (about +1 per limit's worth of answers, never above `cap`). A
backend serving longer prompts (slower first tokens) thus gets fewer requests at once.

Scale from zero (a model with `autoscaling`): while none of its replicas can serve (all scaled away, or still
starting), a request waits in the queue as any other, class first and fair across keys, for up to
`autoscaling.cold_start_wait` (or its class's max_wait if longer) instead of getting a 503 at once; the scaling
signal (policies/scaling.py) counts it, so the autoscaler starts a replica, and the first one to pass its
health probe serves the queue. Still none past the bound: 503 `no_replica_started` with Retry-After
COLD_RETRY_AFTER. A key that may rent the model's overflow rents at once instead, as before.

A reserve for interactive work: a request of the batch class (the class batch lines run in, `batch.priority_class`,
or any class listed after it) takes a slot only while no better class waits and at least `queue.reserve` slots of
the replica's limit stay free (default an eighth of its cap, at least 1, never all of it; 0: none); a slot a
class's min_share is owed is its own, the reserve included. With the reserve an interactive request arriving
mid-batch finds a free slot at once; when more arrive at once than it holds, a request of a better class than
the batch class that must wait preempts a batch line (policies/preemption.py, `batch.preempt`): the youngest Batch
API line holding a slot of a replica it may use is stopped (one per waiting request; a line preempted
`batch.max_preemptions` times runs to its end), its slot goes to the waiters as any freed slot, and its runner runs
the line again; so it waits a moment, never for a line to end (seconds). The batch class's own demand (in flight
and queued here) is `batch_demand()`, which the scaling signal keeps apart.

Replicas going down: a waiter is there for a slot of a replica that can serve it. When the last routable
replica it may use goes (its health check or a request's failure marks it down, discovery drains it), it leaves
the line at once with the 503 a new request would get (NoBackendAvailable), so a key that may rent rents
(`overflow.when_unavailable`) and the others learn at once instead of waiting out max_wait for a 429. Waiters
that would wait for a replica to start (scale from zero, as above) keep waiting.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NoReturn, Protocol

from backends.replicas import Replica, ReplicaSet, model_of_group
from policies.config import Autoscaling, Policy, Priorities, PriorityClass, Queue, groups_of
from policies.errors import NoBackendAvailable, RateLimited
from policies.memo import Memo
from policies.metrics import GatewayMetrics
from policies.pipeline import Call
from policies.preemption import preempt_youngest
from policies.priority import default_class
from policies.routing import Profile

QUEUE_FULL, QUEUE_TIMEOUT, COLD_START_TIMEOUT = "queue_full", "queue_timeout", "cold_start_timeout"
PAST_DEADLINE = "past_deadline"  # its client's timeout (policies/deadline.py) ends before a slot can be expected
REPLICAS_DOWN = "replicas_down"  # a waiter none of whose replicas is routable any more (ModelQueue.fail_stranded)
COLD_RETRY_AFTER = 30  # seconds: a model that started no replica within its bound is worth asking again after


class WouldWait(Exception):
    """Every replica is at its cap and the wait would exceed what the caller accepts (overflow instead)."""


class DrainRate:
    """Completions per second over the last `size` completions."""

    def __init__(self, size: int = 64) -> None:
        self.times: deque[float] = deque(maxlen=size)

    def tick(self, now: float) -> None:
        self.times.append(now)

    def per_second(self, now: float) -> float | None:
        if len(self.times) < 2 or now - self.times[-1] > 60:
            return None  # nothing recent to go by
        span = self.times[-1] - self.times[0]
        return (len(self.times) - 1) / span if span > 0 else None


@dataclass(eq=False)
class Waiter:
    owner: str
    exclude: Sequence[Replica]
    call: Call | None = None
    rank: int = 0  # its priority class's place in the policy's list: lower is served first
    started: float = 0.0  # monotonic
    spill_after: float | None = None  # as acquire got it: set for a key that may rent the model's overflow
    future: asyncio.Future[Replica] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(slots=True, eq=False)
class Hold:
    """A freed slot kept a moment for its class's next request (ModelQueue.release)."""

    rank: int  # the class it is kept for (and better ones)
    replica: Replica
    timer: asyncio.TimerHandle | None = None  # ends the hold: the slot then goes to the waiters

    def cancel(self) -> None:
        assert self.timer is not None  # set as the hold is made (ModelQueue.release)
        self.timer.cancel()


class WaitLine:
    """Waiters by class rank, then round-robin across owners (API keys), FIFO within an owner."""

    def __init__(self, ranks: int) -> None:
        self.by_owner: list[dict[str, deque[Waiter]]] = [{} for _ in range(ranks)]
        self.turns: list[deque[str]] = [deque() for _ in range(ranks)]  # owners with waiters, in turn order
        self.depths = [0] * ranks
        self.depth = 0

    def ahead_of(self, rank: int) -> int:
        """Waiters that would be served before a new one of `rank`."""
        return sum(self.depths[: rank + 1])

    def push(self, waiter: Waiter, front: bool = False) -> None:
        """Queue a waiter; `front` puts it (and its owner's turn) first again, undoing a pop."""
        by_owner, turns = self.by_owner[waiter.rank], self.turns[waiter.rank]
        queue = by_owner.setdefault(waiter.owner, deque())
        if front:
            queue.appendleft(waiter)
            if waiter.owner in turns:
                turns.remove(waiter.owner)
            turns.appendleft(waiter.owner)
        else:
            if not queue:
                turns.append(waiter.owner)
            queue.append(waiter)
        self.depths[waiter.rank] += 1
        self.depth += 1

    def pop(self, first: int | None = None) -> Waiter:
        """The next waiter: of class `first` when it waits, else of the best class that does."""
        rank = first if first is not None and self.depths[first] else next(i for i, d in enumerate(self.depths) if d)
        by_owner, turns = self.by_owner[rank], self.turns[rank]
        owner = turns.popleft()
        queue = by_owner[owner]
        waiter = queue.popleft()
        if queue:
            turns.append(owner)  # this owner's next request waits for everyone else's turn
        else:
            del by_owner[owner]
        self.depths[rank] -= 1
        self.depth -= 1
        return waiter

    def heads(self) -> list[tuple[int, float]]:
        """(rank, when its head started waiting) for each class with waiters."""
        return [(rank, self.by_owner[rank][self.turns[rank][0]][0].started)
                for rank, depth in enumerate(self.depths) if depth]

    def head(self) -> Waiter | None:
        for rank, depth in enumerate(self.depths):
            if depth:
                return self.by_owner[rank][self.turns[rank][0]][0]
        return None

    def waiters(self) -> list[Waiter]:
        """Every waiter, in no particular order."""
        return [w for by_owner in self.by_owner for queue in by_owner.values() for w in queue]

    def remove(self, waiter: Waiter) -> bool:
        by_owner = self.by_owner[waiter.rank]
        queue = by_owner.get(waiter.owner)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del by_owner[waiter.owner]
            self.turns[waiter.rank].remove(waiter.owner)
        self.depths[waiter.rank] -= 1
        self.depth -= 1
        return True


def reserve_for(cap: int, asked: int | None) -> int:
    """The slots of a replica of cap `cap` that the batch class leaves free (`asked`: queue.reserve)."""
    return max(0, min(max(1, cap // 8) if asked is None else asked, cap - 1))


class ModelQueue:
    """One model's replicas and queue, counting slots in this process (the embedded store's behaviour)."""

    autoscaling: Autoscaling | None = None  # the model's: with it, requests wait for a first replica (see above)
    batch_class = "batch"  # the class batch lines run in (policy.batch.priority_class; Admission sets it)

    def __init__(self, model: str, replicas: list[Replica], config: Queue, profile: Profile,
                 metrics: GatewayMetrics, priorities: Priorities | None = None) -> None:
        self.model = model
        self.replicas = replicas
        self.config = config
        self.profile = profile
        self.metrics = metrics
        self.priorities = priorities or Priorities()
        self.classes = self.priorities.classes
        self.default = default_class(self.priorities)
        self.line = WaitLine(len(self.classes))
        self.batch_rank = self.rank_of_batch()
        self.batch_held: set[int] = set()  # id() of the batch-class calls holding a slot here
        self.credits: dict[str, float] = {}  # by class name: freed slots owed to it by its min_share (share_due)
        self.holds: list[Hold] = []  # see release
        self.stranding = False  # a fail_stranded is scheduled
        self.drain = DrainRate()
        self.last_cut: dict[Replica, float] = {}
        public = model_of_group(model)  # a variant's queue (`model#variant`): its backends are the model's
        self.in_flight_gauge = Memo(partial(metrics.in_flight.labels, public))  # by replica name
        self.held_gauge = Memo(partial(metrics.slots_held.labels, public))  # by replica name
        self.depth_gauges = [metrics.queue_depth.labels(model, c.name) for c in self.classes]
        self.wait_histograms = [metrics.queue_wait.labels(model, c.name) for c in self.classes]

    @property
    def depth(self) -> int:
        return self.line.depth

    def reprioritize(self, priorities: Priorities) -> None:
        """Take a reloaded `priorities` at once. Queued waiters keep their place within their class, move to
        its new rank (the default class's, if theirs is gone) and keep the deadline they started with; slots
        held for a class go to the waiters now."""
        if priorities == self.priorities:
            return
        waiters = []
        while self.line.depth:
            waiters.append(self.pop())
        self.priorities, self.classes = priorities, priorities.classes
        self.default = default_class(priorities)
        names = {c.name for c in self.classes}
        self.credits = {name: credit for name, credit in self.credits.items() if name in names}
        self.line = WaitLine(len(self.classes))
        self.batch_rank = self.rank_of_batch()
        self.depth_gauges = [self.metrics.queue_depth.labels(self.model, c.name) for c in self.classes]
        self.wait_histograms = [self.metrics.queue_wait.labels(self.model, c.name) for c in self.classes]
        for waiter in waiters:
            waiter.rank = self.class_of(waiter.call)[0]
            self.push(waiter)
        for hold in list(self.holds):
            hold.cancel()
            self.end_hold(hold)

    def set_batch_class(self, name: str) -> None:
        self.batch_class = name
        self.batch_rank = self.rank_of_batch()

    def rank_of_batch(self) -> int:
        """The rank from which classes are batch classes: the batch class's (the last class when the policy has
        none of that name, as policies/priority.py places batch lines); none (past the last) when that is the
        default class, whose requests the reserve is for."""
        names = [c.name for c in self.classes]
        rank = names.index(self.batch_class) if self.batch_class in names else len(names) - 1
        return len(names) if names[rank] == self.default.name else rank

    def reserve_of(self, replica: Replica) -> int:
        """Slots of the replica the batch class leaves free: queue.reserve, else an eighth of its cap (at least
        1: a quarter left a batch 67% of what a quarter-full cap leaves idle, against the 80% it should fill;
        tests/benchmarks/batch_fill.py); never the whole cap, so batch work always has a slot of an idle replica."""
        cap = replica.cap if replica.cap is not None else replica.limit
        if cap is None:
            return 0
        return reserve_for(int(cap), self.config.reserve)

    def limit_for(self, replica: Replica, rank: int) -> int:
        """How many requests in flight to a capped replica leave room for one more of class `rank`."""
        assert replica.limit is not None  # callers pass capped replicas only
        limit = int(replica.limit)
        return limit - self.reserve_of(replica) if rank >= self.batch_rank else limit

    def batch_demand(self) -> tuple[int, int]:
        """Batch-class requests (in flight, queued) here: what the scaling signal keeps apart."""
        return len(self.batch_held), sum(self.line.depths[self.batch_rank:])

    def class_of(self, call: Call | None) -> tuple[int, PriorityClass]:
        chosen = (call.priority if call is not None else None) or self.default
        for rank, klass in enumerate(self.classes):
            if klass.name == chosen.name:
                return rank, klass
        return self.classes.index(self.default), self.default

    def free_replica(self, call: Call | None, exclude: Sequence[Replica], rank: int = 0) -> Replica | None:
        if rank < self.batch_rank:
            return self.profile.pick(call, [r for r in self.replicas if r.has_room], exclude=exclude)
        return self.profile.pick(call, [r for r in self.replicas if r.limit is None
                                        or self.busy(r) < self.limit_for(r, rank)], exclude=exclude)

    def take(self, replica: Replica) -> Replica:
        replica.in_flight += 1
        self.in_flight_gauge(replica.name).inc()
        self.held_gauge(replica.name).set(replica.in_flight)
        return replica

    async def take_now(self, call: Call | None, exclude: Sequence[Replica], rank: int, will_wait: bool) -> Replica | None:
        """A slot at once, or None (then the caller waits); here without a suspension point."""
        replica = self.free_replica(call, exclude, rank)
        return None if replica is None else self.take(replica)

    def busy(self, replica: Replica) -> int:
        """Requests in flight to the replica, as its cap counts them."""
        return replica.in_flight

    async def acquire(self, owner: str, exclude: Sequence[Replica], spill_after: float | None = None,
                      call: Call | None = None) -> Replica:
        cold = not any(r.routable and r not in exclude for r in self.replicas)
        if cold and not self.waits_for_a_replica(exclude, spill_after):
            raise self.unreachable()
        rank, klass = self.class_of(call)
        if klass.rent_first and spill_after is not None:
            spill_after = 0.0  # this class leaves owned capacity to the others when it can rent
        if self.line.ahead_of(rank) == 0:
            replica = (self.holds and self.take_held(rank, exclude)) or \
                await self.take_now(call, exclude, rank, will_wait=spill_after is None)
            if replica is not None:
                if rank >= self.batch_rank and call is not None:
                    self.batch_held.add(id(call))
                return replica
        if spill_after is not None and (self.depth >= self.config.max_depth or self.retry_after(rank) > spill_after):
            raise WouldWait
        if self.depth >= self.config.max_depth:
            self.refuse(QUEUE_FULL, f"model {self.model} is at capacity and its queue is full", rank)
        if not self.may_wait(exclude, spill_after):  # its replicas went while take_now asked the fleet
            raise self.unreachable()
        max_wait = klass.max_wait or self.config.max_wait
        if cold and self.autoscaling is not None:  # cold: it has autoscaling (waits_for_a_replica)
            max_wait = max(max_wait, self.autoscaling.cold_start_wait)
        if call is not None and call.request.deadline < math.inf:
            max_wait = self.within_deadline(call, rank, max_wait)
        waiter = Waiter(owner, exclude, call, rank, time.monotonic(), spill_after)
        self.push(waiter)
        if rank < self.batch_rank and self.batch_held:
            self.preempt_for(waiter)
        try:
            async with asyncio.timeout(max_wait):
                replica = await asyncio.shield(waiter.future)
        except TimeoutError:
            self.remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled():
                replica = waiter.future.result()  # the slot arrived with the deadline: use it
            else:
                waiter.future.cancel()
                if cold and not any(r.routable for r in self.replicas):
                    self.none_started(max_wait)
                if call is not None and time.perf_counter() >= call.request.deadline:
                    self.refuse(PAST_DEADLINE, f"model {self.model} stayed at capacity until the client's timeout "
                                               f"({max_wait:.1f} s)", waiter.rank)
                self.refuse(QUEUE_TIMEOUT, f"model {self.model} stayed at capacity for {max_wait:g} s", waiter.rank)
        except asyncio.CancelledError:  # the client went away while waiting
            self.remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(waiter.future.result())
            waiter.future.cancel()
            raise
        self.wait_histograms[waiter.rank].observe(time.monotonic() - waiter.started)  # its rank after a reload
        if waiter.rank >= self.batch_rank and call is not None:
            self.batch_held.add(id(call))
        return replica

    def preempt_for(self, waiter: Waiter) -> None:
        """A request of a better class than the batch class waits: stop the youngest Batch API line holding a slot
        of a replica it may use, if any may be stopped (policies/preemption.py); its slot comes to the waiters as
        any freed one."""
        usable = [r for r in self.replicas if r.routable and r not in waiter.exclude]
        if preempt_youngest(self.batch_held, usable):
            self.metrics.batch_preemptions.labels(self.model).inc()

    def waits_for_a_replica(self, exclude: Sequence[Replica], spill_after: float | None) -> bool:
        """No replica can serve: wait for one to start (scale from zero) rather than fail at once? Only for a
        model with autoscaling, on a first attempt (not a retry after a replica failed), for a key that cannot
        rent the model's overflow."""
        return self.autoscaling is not None and not exclude and spill_after is None

    def may_wait(self, exclude: Sequence[Replica], spill_after: float | None) -> bool:
        """Can waiting here still serve a request that excludes `exclude`: a routable replica it may use is
        there (its slot frees in time), or one is to start for it (waits_for_a_replica)?"""
        return any(r.routable and r not in exclude for r in self.replicas) or \
            self.waits_for_a_replica(exclude, spill_after)

    def unreachable(self) -> NoBackendAvailable:
        return NoBackendAvailable(f"no backend of model {self.model} is reachable; try again shortly")

    def replicas_changed(self) -> None:
        """A replica came back, went, or changed its limit: waiters get the room there is, and those that
        waiting can no longer serve leave right after (fail_stranded: once the change is whole, so a replica
        set that drains a replica and takes it back in one go strands nobody)."""
        self.dispatch()
        if self.depth and not self.stranding:
            self.stranding = True
            asyncio.get_running_loop().call_soon(self.fail_stranded)

    def fail_stranded(self) -> None:
        """Fail every waiter none of whose replicas is routable any more (all down, or all it excludes) with
        the 503 a new request would get, unless it waits for one to start: the proxy rents it when its key
        may, and a private one learns now rather than after its max_wait."""
        self.stranding = False
        for waiter in self.line.waiters():
            if waiter.future.done() or self.may_wait(waiter.exclude, waiter.spill_after):
                continue
            self.remove(waiter)
            self.turn_away(waiter)

    def turn_away(self, waiter: Waiter) -> None:
        """A waiter out of the line that no replica can serve any more: its acquire raises the 503."""
        self.metrics.admission_rejected.labels(self.model, REPLICAS_DOWN).inc()
        waiter.future.set_exception(self.unreachable())

    def none_started(self, waited: float) -> NoReturn:
        self.metrics.admission_rejected.labels(self.model, COLD_START_TIMEOUT).inc()
        raise NoBackendAvailable(
            f"model {self.model} has no replica running and none started within {waited:g} s; try again in"
            f" {COLD_RETRY_AFTER} s", code="no_replica_started", param=COLD_START_TIMEOUT,
            headers={"retry-after": str(COLD_RETRY_AFTER)})

    def observe(self, replica: Replica, ttft: float) -> None:
        """An upstream time to first token, for the adaptive limit."""
        adaptive = replica.adaptive
        if adaptive is None:
            return
        # an adaptive limit has a cap, its upper bound (the schema's adaptive_needs_cap), so it has a limit
        assert replica.cap is not None and replica.limit is not None
        now = time.monotonic()
        if ttft > adaptive.target_ttft:
            if now - self.last_cut.get(replica, 0.0) >= 1.0:
                self.last_cut[replica] = now
                replica.limit = max(float(adaptive.floor), replica.limit * 0.9)
        elif self.busy(replica) >= int(replica.limit):
            before = int(replica.limit)
            replica.limit = min(float(replica.cap), replica.limit + 1.0 / replica.limit)
            if int(replica.limit) > before:
                self.dispatch()
        self.metrics.backend_limit.labels(replica.model, replica.name).set(int(replica.limit))

    def share_due(self) -> int | None:
        """The class a freed slot is owed to by its min_share, if any: each freed slot adds a waiting class's
        share to its credit, a whole credit is one slot for it ahead of better classes."""
        due = None
        for rank, klass in enumerate(self.classes):
            if not klass.min_share or not self.line.depths[rank]:
                self.credits.pop(klass.name, None)  # owed only while it waits
                continue
            credit = self.credits.get(klass.name, 0.0) + klass.min_share
            if due is None and credit >= 1.0:
                credit -= 1.0
                due = rank
            self.credits[klass.name] = credit
        return due

    def release(self, replica: Replica, call: Call | None = None) -> None:
        if self.batch_held and call is not None:
            self.batch_held.discard(id(call))
        due = self.share_due() if self.depth else None
        if due is not None:
            self.free(replica, first=due)
            return
        if call is not None and self.depth and self.priorities.hold:
            rank = self.class_of(call)[0]
            if not self.line.ahead_of(rank):
                # only worse classes wait: the slot stays taken a moment for this class's next request, which
                # takes it over (take_held); otherwise it goes to the waiters when the moment is over
                hold = Hold(rank, replica)
                hold.timer = asyncio.get_running_loop().call_later(self.priorities.hold, self.end_hold, hold)
                self.holds.append(hold)
                return
        self.free(replica)

    def free(self, replica: Replica, first: int | None = None) -> None:
        replica.end()
        self.in_flight_gauge(replica.name).dec()
        self.held_gauge(replica.name).set(replica.in_flight)
        self.drain.tick(time.monotonic())
        self.dispatch(first)

    def take_held(self, rank: int, exclude: Sequence[Replica]) -> Replica | None:
        """A slot held for this class (or a worse one), handed over as it is: still counted as taken."""
        for i, hold in enumerate(self.holds):
            if rank <= hold.rank and hold.replica.routable and hold.replica not in exclude:
                del self.holds[i]
                hold.cancel()
                return hold.replica
        return None

    def end_hold(self, hold: Hold) -> None:
        self.holds.remove(hold)
        self.free(hold.replica)

    def dispatch(self, first: int | None = None) -> None:
        """Hand free slots to waiters, class by class and fairly within one, for as long as there are both;
        the first to class `first` when it waits (a slot its min_share is owed)."""
        skipped: list[Waiter] = []  # waiters whose only free replica is one they already failed on
        while self.depth and any(r.routable and r.has_room for r in self.replicas):
            waiter = self.pop(first)
            # a slot its min_share is owed is the class's own, the reserve included (or the share is never paid)
            rank = 0 if first is not None and waiter.rank == first else waiter.rank
            first = None
            replica = self.free_replica(waiter.call, waiter.exclude, rank)
            if replica is None:
                skipped.append(waiter)
                if waiter.rank >= self.batch_rank and not waiter.exclude and not any(self.line.depths[:self.batch_rank]):
                    break  # only batch-class waiters are left, and what room there is is the reserve
                continue
            waiter.future.set_result(self.take(replica))
        for waiter in reversed(skipped):
            self.push(waiter, front=True)

    def push(self, waiter: Waiter, front: bool = False) -> None:
        self.line.push(waiter, front)
        self.depth_gauges[waiter.rank].set(self.line.depths[waiter.rank])

    def pop(self, first: int | None = None) -> Waiter:
        waiter = self.line.pop(first)
        self.depth_gauges[waiter.rank].set(self.line.depths[waiter.rank])
        return waiter

    def remove(self, waiter: Waiter) -> None:
        if self.line.remove(waiter):
            self.depth_gauges[waiter.rank].set(self.line.depths[waiter.rank])

    def within_deadline(self, call: Call, rank: int, max_wait: float) -> float:
        """The wait a request of class `rank` may have before its client's deadline: refused at once when the
        deadline is past, or when the queue's drain rate says its slot comes after it (a 429 the client can
        retry on, rather than its own timeout)."""
        left = call.request.deadline - time.perf_counter()
        if left >= max_wait:
            return max_wait
        expected = self.expected_wait(rank)
        if left <= 0 or (expected is not None and expected > left):
            self.refuse(PAST_DEADLINE, f"model {self.model} is at capacity and no slot is expected within the "
                                       f"client's timeout ({max(left, 0.0):.1f} s left)", rank)
        return left

    def expected_wait(self, rank: int | None = None) -> float | None:
        """Seconds until a slot for a request of class `rank` (None: behind the whole queue), at the rate the
        model's requests have been completing; None with no recent rate to go by."""
        rate = self.drain.per_second(time.monotonic())
        if rate is None:
            return None
        ahead = self.depth if rank is None else self.line.ahead_of(rank)
        return (ahead + 1) / rate

    def retry_after(self, rank: int | None = None) -> float:
        expected = self.expected_wait(rank)
        return self.config.max_wait if expected is None else expected

    def starved_wait(self, rank: int) -> float:
        """What a request of class `rank` that just waited its max_wait in vain can expect to wait next: with a
        min_share, its place among its own class at that share of the drain rate; without, better classes
        alone may fill the cap for as long again, so its max_wait (never the 1 s the overall rate suggests)."""
        klass = self.classes[rank]
        rate = self.share_rate(rank)
        if rate:
            return (self.line.depths[rank] + 1) / rate
        return klass.max_wait or self.config.max_wait

    def share_rate(self, rank: int) -> float | None:
        """Slots per second a class's waiters here can count on by its min_share (None: no share, or no recent
        rate to go by): that share of the slots freed."""
        rate = self.drain.per_second(time.monotonic())
        return rate * self.classes[rank].min_share if rate else None

    def refuse(self, reason: str, message: str, rank: int | None = None) -> NoReturn:
        self.metrics.admission_rejected.labels(self.model, reason).inc()
        wait = max(0.001, self.retry_after(rank))
        if reason == QUEUE_TIMEOUT and rank:  # a worse class that got no slot: its own expected wait
            wait = max(wait, self.starved_wait(rank))
        raise RateLimited(
            f"{message}; try again in {wait:.1f} s",
            code="model_at_capacity",
            param=reason,
            headers={"retry-after": str(max(1, math.ceil(wait))), "retry-after-ms": str(math.ceil(wait * 1000))},
        )


class QueueFactory(Protocol):
    """Makes a model's queue: ModelQueue counts a cap in this process; the Redis store's FleetModelQueue
    (policies/fleet_caps.py) counts every gateway replica's requests. The store's state picks (policies/state)."""

    def __call__(self, model: str, replicas: list[Replica], config: Queue, profile: Profile, metrics: GatewayMetrics,
                 priorities: Priorities | None = None) -> ModelQueue: ...


class Admission:
    """Every model's queue, each made by `queues` (the store kind's: see QueueFactory)."""

    def __init__(self, policy: Policy, replicas: ReplicaSet, profiles: dict[str, Profile],
                 metrics: GatewayMetrics, queues: QueueFactory = ModelQueue) -> None:
        self.queues = {  # one per model, or per variant of a model that has variants (`model#variant`)
            group: queues(group, replicas.by_model[group], m.queue, profiles[m.name], metrics, policy.priorities)
            for m in policy.models for group, _ in groups_of(m)
        }
        for m in policy.models:
            for group, _ in groups_of(m):
                self.queues[group].autoscaling = m.autoscaling
                self.queues[group].set_batch_class(policy.batch.priority_class)
        for replica in replicas:
            metrics.backend_limit.labels(replica.model, replica.name).set(replica.cap or -1)

    async def close(self) -> None:
        """Give back what is still held (leases end by themselves anyway) and wait for pending releases."""
        for queue in self.queues.values():
            closing = getattr(queue, "close", None)
            if closing is not None:
                await closing()

    async def acquire(self, model: str, owner: str, exclude: Sequence[Replica] = (),
                      spill_after: float | None = None, call: Call | None = None) -> Replica:
        """A replica with room (counted in its in_flight), chosen by the model's routing profile for `call`;
        raises WouldWait instead of queueing longer than `spill_after` seconds, when given. `model` names a
        replica set: a model, or one variant of it (`model#variant`)."""
        return await self.queues[model].acquire(owner, exclude, spill_after, call)

    def release(self, replica: Replica, call: Call | None = None) -> None:
        self.queues[replica.group].release(replica, call)

    def observe(self, replica: Replica, ttft: float) -> None:
        queue = self.queues.get(replica.group)
        if queue is not None and replica.rented is None:
            queue.observe(replica, ttft)

    def replica_changed(self, replica: Replica) -> None:
        """A replica came back (or went): waiters may now have somewhere to go, or nowhere any more."""
        queue = self.queues.get(replica.group)
        if queue is not None:
            queue.replicas_changed()
