"""The replicas each model needs at its knee: a signal for an autoscaler that leads vLLM's own waiting count.

Per model (per variant of a model that has variants), once a second:

    demand   = requests in flight to its owned replicas + requests waiting in its queue, over every gateway
               replica (Redis store: each process writes its own two figures to one hash per model,
               `{prefix}scaling:{<model>}`, and sums everyone's; a process silent for STALE seconds is left out)
    smoothed = demand when it rises (at once); when it falls, an exponential decay toward it with the time
               constant `autoscaling.smoothing_seconds` (and 0 once under 0.05 of a request)
    needed   = ceil(smoothed * (1 + autoscaling.headroom) / cap), cap = one replica's cap (the knee)

Batch-class requests (batch lines, and the batch class generally: policies/admission.py) are left out of
`demand` unless `autoscaling.count_batches`: batch work fills the idle capacity of the replicas there are and can
wait, so a batch alone does not start a second replica (a model scaled to zero with batch work waiting needs one,
or the batch never runs). Their own figure, in flight plus queued over every gateway
replica (not smoothed), is `llm_gateway_batch_demand{model}` and `batch_demand` in GET /scaling: an autoscaler
that should start replicas for batch work too reads it (or the policy sets count_batches).

It is `llm_gateway_replicas_needed{model}` on /metrics and `needed` in GET /scaling (KEDA's metrics-api
scaler reads it with targetValue 1). A model with no `autoscaling` block gets the signal with the block's
defaults when its cap is known; one without a known cap gets none.

Why it leads vLLM's `num_requests_waiting`: the gateway never sends a replica more than its cap, so vLLM's
own queue stays empty while the excess waits here; vLLM's waiting count rises only past `--max-num-seqs`,
which with a cap at the knee it never reaches (and without one, only once latency has already exploded).
In flight counts too: `needed` rises as soon as demand nears one replica's cap (by the headroom), before any
request waits anywhere. And it counts what waits for a model that has no replica at all (scaled to zero),
which no backend metric can: a vLLM that is not running exports nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from policies.admission import ModelQueue
from policies.config import Autoscaling, Policy, groups_of, replica_cap
from policies.store.redis import RedisStore

log = logging.getLogger("gateway.scaling")

EVERY = 1.0  # seconds between two computations of the signal (and writes of this process's figures)
STALE = 5.0  # a process whose figures are older than this is left out of the fleet's demand (it died)
FORGET = 60.0  # ...and its field is removed once older than this
ZERO = 0.05  # a smoothed demand under this is none: the decay would otherwise never reach 0


@dataclass(slots=True)
class Figures:
    """One model's signal, as GET /scaling shows it."""

    needed: int  # replicas to serve the demand at the knee, with the headroom
    demand: float  # in flight + queued, over every gateway replica, now (batch-class work: with count_batches)
    smoothed: float  # what `needed` is computed from
    in_flight: int  # this process's share of `demand`
    queued: int
    cap: int  # one replica's cap
    replicas: int  # replicas that can take requests now (as this process sees them)
    batch_demand: float = 0.0  # batch-class requests in flight + queued, over every gateway replica, now


def smooth(previous: float, demand: float, elapsed: float, tau: float) -> float:
    """A rise at once; a fall as an exponential decay toward `demand` with time constant `tau` seconds."""
    if demand >= previous or tau <= 0:
        return demand
    value = demand + (previous - demand) * math.exp(-elapsed / tau)
    return 0.0 if value < ZERO else value


def needed(smoothed: float, cap: int, headroom: float) -> int:
    if smoothed <= 0:
        return 0
    return max(1, math.ceil(round(smoothed * (1 + headroom) / cap, 9)))  # round: 0.1 * 3 is 0.30000000000000004


class ScalingSignal:
    """Computes every model's figures once a second; reading them (GET /scaling, a scrape) costs nothing."""

    def __init__(self, registry: CollectorRegistry, store: RedisStore | None = None) -> None:
        self.store = store  # the Redis store when several gateway replicas share one (None: this process alone)
        self.process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.figures: dict[str, Figures] = {}
        self.state: dict[str, tuple[float, float]] = {}  # model -> (smoothed, monotonic time)
        self.fleet_failing = False
        self.needed_gauge = Gauge(
            "llm_gateway_replicas_needed", "Replicas of a model needed to serve its demand (in flight + queued"
            " across every gateway replica, smoothed) at one replica's cap, with autoscaling.headroom.",
            ["model"], registry=registry)
        self.demand_gauge = Gauge(
            "llm_gateway_scaling_demand", "A model's requests in flight plus queued across every gateway replica,"
            " smoothed as the replicas-needed signal uses it.", ["model"], registry=registry)
        self.batch_gauge = Gauge(
            "llm_gateway_batch_demand", "A model's batch-class requests in flight plus queued across every gateway"
            " replica; counted in llm_gateway_replicas_needed only with autoscaling.count_batches.", ["model"],
            registry=registry)

    def key(self, model: str) -> str:
        assert self.store is not None  # asked only with a shared store (fleet_demand)
        return f"{self.store.prefix}scaling:{{{model}}}"

    async def fleet_demand(self, local: dict[str, tuple[int, int]],
                           batch: dict[str, tuple[int, int]]) -> tuple[dict[str, float], dict[str, float]]:
        """Write this process's figures and sum every live process's, per model: (all demand, batch demand).
        A field is "<in flight> <queued> <time> <batch in flight> <batch queued>" (a process of the version
        before writes the first three: no batch demand of its own)."""
        store = self.store
        assert store is not None  # called only with a shared store (refresh)
        now = time.time()
        out: dict[str, float] = {}
        batches: dict[str, float] = {}
        for model, (in_flight, queued) in local.items():
            key = self.key(model)
            async with store.guard("scaling_signal"):
                pipe = store.client.pipeline(transaction=False)
                pipe.hset(key, self.process, f"{in_flight} {queued} {now:.3f} {batch[model][0]} {batch[model][1]}")
                pipe.expire(key, int(FORGET))
                pipe.hgetall(key)
                *_, fields = await pipe.execute()
                total, batched, dead = 0.0, 0.0, []
                for process, value in fields.items():
                    parts = (value.decode() if isinstance(value, bytes) else value).split()
                    age = now - float(parts[2])
                    if age > FORGET:
                        dead.append(process)
                    if age <= STALE:
                        total += int(parts[0]) + int(parts[1])
                        if len(parts) >= 5:
                            batched += int(parts[3]) + int(parts[4])
                if dead:
                    await store.client.hdel(key, *dead)
            out[model], batches[model] = total, batched
        return out, batches

    async def refresh(self, policy: Policy, queues: Mapping[str, ModelQueue]) -> None:
        """Recompute every model's figures from `queues` (the serving snapshot's admission queues, by model)."""
        groups = []
        for m in policy.models:
            for group, variant in groups_of(m):
                cap = replica_cap(m, variant)
                if cap is not None and group in queues:
                    groups.append((group, cap, m.autoscaling or Autoscaling()))
        local, batch = {}, {}
        for group, _, _ in groups:
            queue = queues[group]
            local[group] = (sum(r.in_flight for r in queue.replicas), queue.depth)
            batch[group] = queue.batch_demand()
        demand = {group: float(a + b) for group, (a, b) in local.items()}
        batched = {group: float(a + b) for group, (a, b) in batch.items()}
        if self.store is not None and local:
            try:
                demand, batched = await self.fleet_demand(local, batch)
                if self.fleet_failing:
                    log.info("the scaling signal counts every gateway replica again")
                self.fleet_failing = False
            except Exception as exc:  # the store is down: this process's own figures, an undercount, say so once
                if not self.fleet_failing:
                    log.warning("the scaling signal counts this gateway replica alone: the store failed (%s)",
                                type(exc).__name__)
                self.fleet_failing = True
        now = time.monotonic()
        figures = {}
        for group, cap, settings in groups:
            before, at = self.state.get(group, (0.0, now))
            counted = demand[group] if settings.count_batches else max(0.0, demand[group] - batched[group])
            value = smooth(before, counted, now - at, settings.smoothing_seconds)
            self.state[group] = (value, now)
            replicas = sum(1 for r in queues[group].replicas if r.routable)
            wanted = needed(value, cap, settings.headroom)
            if batched[group] > 0 and wanted == 0:  # batch work and no replica wanted: one, or it never runs
                wanted = 1
            figures[group] = Figures(wanted, counted, round(value, 3),
                                     *local[group], cap, replicas, batched[group])
            self.needed_gauge.labels(group).set(figures[group].needed)
            self.demand_gauge.labels(group).set(value)
            self.batch_gauge.labels(group).set(batched[group])
        for gone in set(self.figures) - set(figures):  # a model the policy no longer has
            self.state.pop(gone, None)
            for gauge in (self.needed_gauge, self.demand_gauge, self.batch_gauge):
                gauge.remove(gone)
        self.figures = figures

    def view(self, model: str | None = None) -> dict[str, Any] | None:
        """GET /scaling's body: every model's figures, or one model's (None: no such model has a signal)."""
        if model is not None:
            figures = self.figures.get(model)
            return None if figures is None else asdict(figures)
        return {"models": {name: asdict(f) for name, f in self.figures.items()},
                "fleet": self.store is not None and not self.fleet_failing}

    async def run(self, current: Callable[[], tuple[Policy, Mapping[str, ModelQueue]]]) -> None:
        """Every EVERY seconds, for whichever snapshot serves (`current()`: its policy and admission queues)."""
        while True:
            try:
                await self.refresh(*current())
            except Exception:  # one bad round must not end the signal
                log.exception("computing the scaling signal failed")
            await asyncio.sleep(EVERY)
