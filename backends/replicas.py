"""The owned replicas of every model and what the gateway knows about their health.

A replica is `unknown` until its first health check or request, `up` after a success and `down` after
`failure_threshold` consecutive failures (connect errors, 5xx). A down replica gets no traffic; it is probed
again after a backoff that doubles with every failed probe, and one successful probe brings it back.

The set is live: `ReplicaSet.apply(model, desired)` makes a model's replicas the desired ones, by stable name.
A replica that is new is `pending` (no traffic) until its first health probe passes; one that is gone is
drained: it gets no new request, those in flight finish, and then its pooled connections are closed. A replica
that stays keeps its state, counters and slots; only its settings (cap, served name, health path) change. A replica is its address: one that comes back while
still draining (an endpoint flap) is the draining one again, with its state and requests in flight, so the cap
counts them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from backends.http1 import Client, UpstreamError
from backends.replica_state import Held, Outlier
from backends.upstream import Upstream

log = logging.getLogger("gateway.health")

UNKNOWN, UP, DOWN, PENDING = "unknown", "up", "down", "pending"
VARIANT_MARK = "#"  # never in a model's or a variant's name


def group_name(model: str, variant: str | None) -> str:
    """The name of a variant's own replica set (and admission queue, usage row): `model#variant`; a model
    without variants is its own set."""
    return f"{model}{VARIANT_MARK}{variant}" if variant else model


def model_of_group(group: str) -> str:
    """The public model of a replica set's name."""
    return group.partition(VARIANT_MARK)[0]


def split_group(group: str) -> tuple[str, str | None]:
    """(model, variant or None) of a replica set's name."""
    model, _, variant = group.partition(VARIANT_MARK)
    return model, variant or None


@dataclass(frozen=True, slots=True)
class AdaptiveLimit:
    """A limit that follows the observed time to first token, between `floor` and the replica's cap."""

    floor: int
    target_ttft: float  # seconds; slower first tokens shrink the limit


@dataclass(frozen=True, slots=True)
class KVEventSource:
    """Where a replica's KV cache events come from (backends/kv_events.py). bind=True: the gateway binds `endpoint`
    and vLLM, configured with that concrete address, connects to it; False: vLLM binds (`tcp://*:PORT`) and the
    gateway connects."""

    endpoint: str
    bind: bool = True
    topic: str = "kv"
    max_message_bytes: int = 4 * 1024 * 1024
    max_blocks: int = 131072
    replay: str | None = None  # vLLM's replay_endpoint (it binds, a ROUTER): where a gap's batches are asked again


class KVIndex(Protocol):
    """What routing reads of a replica's KV block index (backends/kv_events.py BlockIndex, which imports this
    module: a Protocol here, not that class)."""

    @property
    def block_size(self) -> int | None: ...

    def __len__(self) -> int: ...

    def matched(self, keys: list[int]) -> int: ...

    def weighed(self, keys: list[int], n: int, weight: Callable[[str], float]) -> float: ...

    def shared(self, key: int) -> bool: ...

    def blind(self, window: float, now: float | None = None) -> bool: ...


@dataclass(eq=False)
class Replica:
    name: str
    model: str  # the public model name
    url: str
    served_name: str
    cap: int | None = None  # most requests in flight to it (the knee); None: unlimited
    health_path: str = "/health"  # what the health check GETs (200 = healthy)
    rented: str | None = None  # the provider's name when this is a rented API, not an owned replica
    priority_scheduling: bool = False  # vLLM runs --scheduling-policy priority: requests may carry `priority`
    adaptive: AdaptiveLimit | None = None  # when the limit follows the observed TTFT
    limit: float | None = None  # the current limit: cap, or the adaptive value between floor and cap
    in_flight: int = 0
    ended: int = 0  # requests of this gateway's to it that have ended (`end`), since the gateway started
    state: str = UNKNOWN
    failures: int = 0
    probe_at: float = 0.0  # monotonic time of the next health probe while down
    failed_at: float = 0.0  # monotonic time of its latest failure (a request's or a probe's)
    source: str = "static"  # where the replica came from: static, kubernetes, kserve
    draining: bool = False  # removed from the set: no new requests, those in flight finish
    variant: str | None = None  # the model's variant it serves, when the model has variants
    group: str = ""  # its set in ReplicaSet.by_model and its admission queue: the model, or `model#variant`
    kv_events: KVEventSource | None = None  # set when vLLM publishes its KV cache events to this gateway
    kv_index: KVIndex | None = None  # the BlockIndex those events fill (backends/kv_events.py); kept across reloads
    lora: Held | None = None  # the LoRA adapters it holds (backends/lora.py); kept across reloads
    outlier: Outlier | None = None  # what outlier ejection knows of it (policies/ejection.py); kept across reloads
    # its connection to the API, once the set has a client (ReplicaSet.connect); never copied with the settings
    upstream: Upstream | None = field(default=None, init=False, repr=False)
    # the other replicas of the set at the same URL (another variant or adapter group served by the same vLLM),
    # linked by ReplicaSet whenever its members change
    peers: tuple[Replica, ...] = field(default=(), init=False, repr=False)

    @property
    def routable(self) -> bool:
        return self.state != DOWN and self.state != PENDING and not self.draining

    def __post_init__(self) -> None:
        if not self.group:
            self.group = group_name(self.model, self.variant)
        if self.limit is None:
            self.limit = self.cap

    def connect(self, client: Client) -> Upstream:
        """Its upstream through `client` (made once per client)."""
        if self.upstream is None or self.upstream.client is not client:
            self.upstream = Upstream(client, f"{self.url}/v1")
        return self.upstream

    @property
    def server_in_flight(self) -> int:
        """Requests of this gateway's in flight to its server: its own and its peers' at the same URL."""
        total = self.in_flight
        for peer in self.peers:
            total += peer.in_flight
        return total

    def end(self) -> None:
        """One request of this gateway's to it is over: out of `in_flight`, counted in `ended`."""
        self.in_flight -= 1
        self.ended += 1

    @property
    def has_room(self) -> bool:
        return self.limit is None or self.in_flight < int(self.limit)

    def take_settings(self, other: Replica) -> None:
        """Adopt `other`'s settings (same name and URL): its state, counters and slots stay."""
        self.served_name, self.health_path, self.source = other.served_name, other.health_path, other.source
        self.cap, self.adaptive, self.kv_events = other.cap, other.adaptive, other.kv_events
        if other.cap is None:
            self.limit = None
        elif other.adaptive is None or self.limit is None:
            self.limit = other.cap
        else:  # an adaptive limit keeps what it learned, within the new bounds
            self.limit = min(float(other.cap), max(float(other.adaptive.floor), self.limit))


@dataclass(frozen=True, slots=True)
class HealthTimings:
    interval: float = 5.0  # seconds between active probes of every replica
    failure_threshold: int = 1  # consecutive failures that take a replica out
    backoff_initial: float = 1.0  # first wait before re-probing a replica that is out; doubles per failure
    backoff_max: float = 60.0


class ReplicaSet:
    """All replicas, by public model name (by `model#variant` for a model's variants: each is a set of its
    own), plus the passive and active health bookkeeping."""

    def __init__(self, by_model: dict[str, list[Replica]], health: HealthTimings,
                 on_change: Callable[[Replica], None] | None = None) -> None:
        self.health = health
        self.by_model = by_model
        self._on_change: Callable[[Replica], None] = on_change or (lambda replica: None)
        self.draining: list[Replica] = []  # removed replicas whose requests in flight have not all finished
        # called once a drained replica's connections are closed
        self.on_drained: Callable[[Replica], None] = lambda replica: None
        self.probed_once = False  # the first full round of health checks since start has ended (see /ready)
        self.client: Client | None = None  # the shared upstream client, once serving (`connect`)
        self.link_peers()

    def link_peers(self) -> None:
        """Give each replica the others at its URL (Replica.peers); after every change of the members."""
        by_url: dict[str, list[Replica]] = {}
        for replica in self:
            by_url.setdefault(replica.url, []).append(replica)
        for same in by_url.values():
            for replica in same:
                replica.peers = tuple(r for r in same if r is not replica)

    def connect(self, client: Client) -> None:
        """Serve through `client`: every replica, and each one that joins later, gets its upstream on it."""
        self.client = client
        for replica in self:
            replica.connect(client)

    def apply(self, model: str, desired: list[Replica]) -> None:
        """Make `model`'s replicas the `desired` ones, by name: new ones wait for a health probe before they get
        traffic, gone ones drain, the others take the new settings and keep their state. The model's list is
        changed in place, so whoever holds it (the admission queue) sees the change at once."""
        current = self.by_model.setdefault(model, [])
        wanted = {r.name: r for r in desired}
        keep: list[Replica] = []
        for replica in current:
            new = wanted.pop(replica.name, None)
            if new is not None and new.url == replica.url:
                replica.take_settings(new)
                keep.append(replica)
                self._on_change(replica)  # a larger cap may have room for waiters
                continue
            if new is not None:
                wanted[new.name] = new  # same name, another URL: the old one drains, the new one is probed
            self.drain(replica)
        for new in wanted.values():
            back = self._undrain(new)
            if back is not None:  # the draining replica came back (an endpoint flap): its in-flight count holds
                keep.append(back)
                self._on_change(back)
                continue
            new.state = PENDING
            if self.client is not None:
                new.connect(self.client)
            keep.append(new)
            log.info("backend %s (%s) of model %s added from %s: probing before it gets traffic",
                     new.name, new.url, model, new.source)
            self._on_change(new)
        current[:] = keep
        self.link_peers()

    def _undrain(self, new: Replica) -> Replica | None:
        """The draining replica with `new`'s name and URL, back in service with `new`'s settings, or None.

        A replica is its address: an endpoint removed and re-added (a flaky readiness probe, a slice deleted and
        recreated) is the same backend with the same requests in flight, so it must not start again from 0 in
        flight under the same cap (that would let the backend hold twice its cap)."""
        back = next((r for r in self.draining if r.name == new.name and r.url == new.url), None)
        if back is None:
            return None
        self.draining.remove(back)
        back.draining = False
        back.take_settings(new)
        log.info("backend %s (%s) of model %s is back while draining: it keeps its %d request(s) in flight",
                 back.name, back.url, back.model, back.in_flight)
        return back

    def remove_model(self, model: str) -> None:
        """Drain every replica of a model that is no longer served."""
        for replica in self.by_model.pop(model, []):
            self.drain(replica)
        self.link_peers()

    def drain(self, replica: Replica) -> None:
        replica.draining = True
        self.draining.append(replica)
        log.info("backend %s (%s) of model %s removed: draining %d request(s) in flight",
                 replica.name, replica.url, replica.model, replica.in_flight)
        self._on_change(replica)

    def finish_drains(self, client: Client | None = None) -> None:
        """Drained replicas with nothing in flight close their pooled connections and are forgotten."""
        done = [r for r in self.draining if r.in_flight <= 0]
        if not done:
            return
        self.draining = [r for r in self.draining if r.in_flight > 0]
        live = {r.url for r in self}
        for replica in done:
            if client is not None and replica.url not in live:
                client.close_origin(replica.url)
            log.info("backend %s (%s) drained: its connections are closed", replica.name, replica.url)
            self.on_drained(replica)

    def __iter__(self) -> Iterator[Replica]:
        for replicas in self.by_model.values():
            yield from replicas

    def load_of(self, group: str) -> float:
        """Requests in flight per routable replica of `group` (infinite when none is routable)."""
        total = count = 0
        for replica in self.by_model.get(group, ()):
            if replica.routable:
                total += replica.in_flight
                count += 1
        return total / count if count else float("inf")

    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0
        if replica.state != UP:
            if replica.state == DOWN:
                log.info("backend %s (%s) is up again", replica.name, replica.url)
            replica.state = UP
            self._on_change(replica)

    def failed(self, replica: Replica, reason: str) -> None:
        replica.failures += 1
        replica.failed_at = time.monotonic()
        if replica.failures < self.health.failure_threshold and replica.state != DOWN:
            return
        if replica.state != DOWN:
            log.warning("backend %s (%s) is down: %s", replica.name, replica.url, reason)
        replica.state = DOWN
        replica.probe_at = time.monotonic() + backoff(self.health, replica.failures)
        self._on_change(replica)

    def ready(self) -> dict[str, bool]:
        """Per model: has at least one replica (of any of its variants) answered its health check."""
        out: dict[str, bool] = {}
        for group, replicas in self.by_model.items():
            model = model_of_group(group)
            out[model] = out.get(model, False) or any(r.state == UP for r in replicas)
        return out

    async def check(self, client: Client, replica: Replica, timeout: float) -> bool:
        """Probe its health path. A 200 to a probe sent before the replica's latest failure is stale: a request
        that failed while the probe was out outranks it, so the replica stays down until a later probe."""
        sent = time.monotonic()
        try:
            status, _ = await client.get(f"{replica.url}{replica.health_path}", timeout=timeout)
            ok = status == 200
            reason = f"health check returned {status}"
        except UpstreamError as exc:
            ok, reason = False, f"health check failed: {exc}"
        if ok:
            if replica.failed_at < sent:
                self.succeeded(replica)
        else:
            self.failed(replica, reason)
        return ok

    async def check_due(self, client: Client, timeout: float) -> None:
        """One round: every replica that is not down, and every down one whose backoff has passed (pending
        ones included)."""
        now = time.monotonic()
        due = [r for r in self if r.state != DOWN or r.probe_at <= now]
        await asyncio.gather(*(self.check(client, r, timeout) for r in due))

    async def run_checks(self, client: Client, timeout: float) -> None:
        """The active health loop; wakes often enough to honour short backoffs."""
        last_full = 0.0
        while True:
            now = time.monotonic()
            if now - last_full >= self.health.interval:
                last_full = now
                await self.check_due(client, timeout)
                self.probed_once = True
            else:  # between rounds: the down ones whose backoff has passed, and new ones waiting for a first probe
                due = [r for r in self if r.state == PENDING or (r.state == DOWN and r.probe_at <= now)]
                await asyncio.gather(*(self.check(client, r, timeout) for r in due))
            self.finish_drains(client)
            await asyncio.sleep(min(self.health.interval, 0.5))


def backoff(health: HealthTimings, failures: int) -> float:
    # the exponent capped as the watch's is: 2.0 ** 1024 overflows, and a replica down for ~17 h at a 60 s backoff
    # reaches that many failures (the health loop would end on the OverflowError)
    return min(health.backoff_max, health.backoff_initial * 2.0 ** min(max(0, failures - 1), 30))
