"""The wiring of one gateway process: `Gateway` builds and holds its parts (the stores, the replicas, the scraper,
the observers, the live policy snapshot) and runs them for the app's lifetime (`lifespan`: the shared upstream
client, the health checks and the background loops, then a bounded shutdown).

The HTTP side is gateway/app.py's: it makes a `Gateway` and hands each route builder the gateway, which each
builder sees only through the narrow Protocol it declares beside itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import orjson
from litestar import Litestar

from backends.egress import GuardedDialer, Resolver, SystemResolver
from backends.http1 import Client
from backends.kv_events import Subscribers
from backends.lora import LoraAdapters, LoraTimings
from backends.replicas import Replica
from backends.upstream import Limits, new_client
from backends.vllm_stats import Scraper, VLLMStats
from gateway.access_log import AccessLog
from gateway.admin.audit import AdminAudit
from gateway.admin.auth import AdminAuth
from gateway.shadow import Shadow
from gateway.http.shutdown import STEP_SECONDS, cancel_all, step
from gateway.background import Background
from gateway.admin.system_audit import SystemAudit
from gateway.batch_calls import BatchCalls
from gateway.attempts import Attempts
from gateway.fallbacks import Fallbacks
from gateway.proxy import Proxy
from gateway.reload import PolicyReloader
from gateway.tracing import tracing_for
from policies.accounting import RecordUsage
from policies.admission import Admission
from policies.audit import Audit
from policies.auth import Authenticate
from policies.batches.runner import Runner
from policies.batches.service import Batches
from policies.compile import replica_set
from policies.config import Policy
from policies.discovery import Discovery
from policies.egress import check_backends, exempt_origins
from policies.finished import Observer
from policies.fleet_caps import FleetModelQueue
from policies.keys import KeyRecord
from policies.ledger.record import RecordLedger
from policies.ledger.report import build_report, costs_of
from policies.ledger.sums import Row
from policies.live_metrics import LiveMetrics
from policies.metrics import GatewayMetrics
from policies.network import ClientNetwork
from policies.ownership import Owners
from policies.routing import Stats
from policies.scaling import ScalingSignal
from policies.snapshot import Shared, Snapshot, compile_snapshot, version_of
from policies.state import open_state
from policies.store import StoreError
from policies.variants import Variants

log = logging.getLogger("gateway")
BATCH_GRACE = 10.0  # seconds a batch line in flight at shutdown has to finish and be recorded


class Gateway:
    """Everything one gateway process holds for its lifetime."""

    def __init__(self, policy: Policy, resolver: Resolver | None = None, policy_path: str | None = None,
                 version: str | None = None) -> None:
        self.resolver = resolver or SystemResolver()  # tests inject one whose answers they control
        self.policy_path = policy_path  # the file a reload reads (gateway/reload.py); None: never reloaded
        self.metrics = GatewayMetrics()
        self.replicas = replica_set(policy, on_change=self._replica_changed)
        for replica in self.replicas:
            self._replica_changed(replica)
        self.replicas.on_drained = self._replica_drained
        scrape = policy.routing.scrape
        self.scraper = Scraper(lambda: list(self.replicas), scrape.interval, scrape.timeout, scrape.stale_after,
                               on_scrape=self._scraped, max_bytes=scrape.max_bytes)
        self.kv_subscribers = Subscribers(lambda: list(self.replicas))
        # LoRA adapters on the replicas of models that have them: what each holds, loads on demand
        self.loras = LoraAdapters(lambda: [r for r in self.replicas if self._lora_of(r) is not None],
                                  lambda r: self._lora_of(r) or LoraTimings(), on_event=self._lora_event)
        self.background = Background(lambda why: self.metrics.background_errors.labels(why).inc())
        variants = Variants(self.metrics)
        state = open_state(policy, variants, self.background.run)  # what the store kind implies (policies/state)
        self.store, self.fleet, self.variant_share = state.store, state.fleet, state.shared_variants
        self.limiter, self.ledger, self.budgets = state.limiter, state.ledger, state.budgets
        self.batch_store = state.batches
        # the Batch API (policies/batches/): files and batches answered here, lines run in the background
        self.batches = Batches(state.batches, lambda: self.policy.batch) \
            if policy.batch.enabled and state.batches is not None else None
        self.batch_runner = Runner(state.batches, lambda: self.policy.batch, BatchCalls(self)) \
            if self.batches is not None and state.batches is not None else None
        self.admin_auth = AdminAuth(policy.admin)
        self.audit = AdminAudit(Audit(state.audit, policy.admin.audit,  # every admin act (gateway/admin/audit.py)
                                      lambda why: self.metrics.background_errors.labels(why).inc()),
                                lambda: self.client_network)
        variants.on_change.append(SystemAudit(self.audit, self.background.run).weights_changed)  # the guard's
        self.key_events = getattr(self.store, "key_events", None)
        self.authenticate = Authenticate(
            self.store, policy.auth.cache_seconds, self.background.run, policy.auth.stale_seconds,
            on_outage=lambda outcome: self.metrics.store_unavailable.labels("auth", outcome).inc(),
        )
        self.owners = Owners(self.store)  # who made each stored response (policies/ownership.py)
        self.record_usage = RecordUsage(self.store, self.background.run)
        self.record_ledger = RecordLedger(self.ledger, policy.ledger, self.background.run,
                                          lambda why: self.metrics.background_errors.labels(why).inc())
        self.access_log = AccessLog()  # one batched log for the process
        self.tracing = tracing_for(policy.tracing, self.metrics)  # raises PolicyError for an unset header variable
        self.shared = Shared(self.replicas, Stats(self.scraper.stats if scrape.enabled else None), self.metrics,
                             self.limiter, self.authenticate, self.owners, self.record_usage, self.background.run,
                             state.queues, self.budgets, self.record_ledger, variants, self._observers,
                             lora_found=self.loras.found)
        if version is None:  # the policy's version: its file's hash when there is a file, else its canonical form's
            version = version_of(Path(policy_path).read_bytes() if policy_path else policy.model_dump_json())
        self.snapshot = compile_snapshot(policy, None, self.shared, version)
        self.live_metrics = LiveMetrics(self.metrics.registry, self.replicas)
        self.live_metrics.serving(self.snapshot.version, self.snapshot.loaded_at)
        self.discovery = Discovery(self.replicas, on_refused=lambda address: self._egress_refused(address, 0, ""))
        self.live_metrics.watching(self.discovery)
        # the replicas each model needs (GET /scaling, llm_gateway_replicas_needed), over every gateway replica
        self.scaling = ScalingSignal(self.metrics.registry, state.shared_store)
        self.reloader: PolicyReloader | None = None  # watches policy_path while the app runs
        self.client: Client | None = None  # the shared upstream client, open while the app runs
        self.proxy: Proxy | None = None
        self.draining = False  # set by SIGTERM (gateway/http/server.py): /ready answers 503 from then on
        self._created = int(time.time())

    # What a request runs under: read from the live snapshot, which a reload replaces whole.
    @property
    def policy(self) -> Policy:
        return self.snapshot.policy

    @property
    def admission(self) -> Admission:
        return self.snapshot.admission

    @property
    def client_network(self) -> ClientNetwork:
        return self.snapshot.client_network

    def _observers(self, policy: Policy, admission: Admission) -> list[Observer]:
        """The observers of finished calls that live in the HTTP shell, for a snapshot of `policy`."""
        observers: list[Observer] = [self.tracing] if self.tracing.enabled else []
        if any(v.shadow for m in policy.models for v in m.variants):
            observers.append(Shadow(admission, self.metrics, self.shared.variants))
        self.access_log.json = policy.access_log.format == "json"
        return [*observers, self.access_log]

    def install(self, snapshot: Snapshot) -> None:
        """Serve new requests under `snapshot` (one reference swap; those in flight keep the proxy they have)."""
        self.snapshot = snapshot
        if self.client is None:
            return  # not serving yet: the lifespan builds the proxy
        policy = snapshot.policy
        if isinstance(self.client.dialer, GuardedDialer):
            self.client.dialer.set_rules(policy.network.private_cidrs, exempt_origins(policy))
        overflow = {m.name: m.overflow for m in policy.models if m.overflow}
        proxy = Proxy(self.replicas, snapshot.admission, snapshot.pipeline, self.metrics, self.client,
                      snapshot.rented, overflow, snapshot.observers)
        proxy.tracing = self.tracing  # read at start: a reload that changes `tracing` needs a restart
        proxy.shadow = next((o for o in snapshot.observers if isinstance(o, Shadow)), None)
        proxy.loras = self.loras
        proxy.rent_check = self.authenticate.may_rent_now
        previous = self.proxy.attempts if self.proxy is not None else None  # retry budgets outlive a reload
        proxy.attempts = Attempts(self.replicas, self.metrics, policy.models, previous)
        proxy.fallbacks = Fallbacks(policy.models, policy.providers, snapshot.rented, self.metrics, self.client)
        self.proxy = proxy

    def batch_runner_wake(self) -> None:
        """A batch was created: the runner looks for work now rather than at its next poll."""
        if self.batch_runner is not None:
            self.batch_runner.wake.set()

    def models_listing(self, key: KeyRecord) -> bytes:
        """/v1/models: only the models this key may use (a LoRA adapter is one, with its base as `parent`)."""
        allowed = key.models
        return orjson.dumps({
            "object": "list",
            "data": [self._model_object(name, parent) for name, _, parent in self._public_models()
                     if allowed is None or name in allowed],
        })

    def model_entry(self, key: KeyRecord, name: str) -> bytes | None:
        """/v1/models/{model}: the model by its public name or an alias, if this key may use it."""
        found = next(((n, parent) for n, aliases, parent in self._public_models() if name == n or name in aliases),
                     None)
        if found is None or (key.models is not None and found[0] not in key.models):
            return None
        return orjson.dumps(self._model_object(*found))

    def _public_models(self) -> Iterator[tuple[str, list[str], str | None]]:
        """(name, aliases, base model of a LoRA adapter or None) of every model the policy serves."""
        for model in self.policy.models:
            yield model.name, model.aliases, None
            if model.lora is None:
                continue
            declared: set[str] = set()
            for adapter in model.lora.adapters:
                declared.update((adapter.name, *adapter.aliases))
                yield adapter.name, adapter.aliases, model.name
            if model.lora.discover:  # those its replicas hold that the policy does not name
                for name in sorted(set(self.loras.found(model.name)) - declared):
                    yield name, [], model.name

    def _model_object(self, name: str, parent: str | None = None) -> dict[str, str | int]:
        entry: dict[str, str | int] = {"id": name, "object": "model", "created": self._created, "owned_by": "llm-gateway"}
        if parent is not None:
            entry["parent"] = parent
        return entry

    async def report(self, window: float, until: float | None = None, team: str | None = None,
                     teams: bool = False) -> dict[str, Any]:
        """The own-vs-rent report (policies/ledger/report.py) for the `window` seconds before `until` (default:
        now), in whole ledger buckets; this replica's unwritten sums are written first. `team`: only that
        team's keys' calls (the backends' time stays the fleet's); `teams`: figures per team too."""
        size = self.policy.ledger.bucket_seconds
        now = time.time()
        end = math.ceil(min(until or now, now) / size) * size
        since = (end - window) // size * size
        await self.record_ledger.flush()
        rows = await self.ledger.read(since, end)
        members = {k.id: k.team for k in await self.store.list_keys() if k.team} if teams or team else None
        if team is not None and members is not None:
            rows = [(row, values) for row, values in rows if not row.key_id or members.get(row.key_id) == team]
        return build_report(rows, costs_of(self.policy, self._discovered_adapters(rows)), since, min(end, now), size,
                            members)

    def _discovered_adapters(self, rows: list[tuple[Row, list[float]]]) -> dict[str, set[str]]:
        """Per model with `lora.discover`: the adapters its replicas hold now, and those the ledger's rows name that
        the policy does not (an adapter served in the window, since unloaded), by the replica that served them."""
        bases = {m.name for m in self.policy.models if m.lora is not None and m.lora.discover}
        if not bases:
            return {}
        out: dict[str, set[str]] = {base: set(self.loras.found(base)) for base in bases}
        known = {name for name, _aliases, _parent in self._public_models()}
        replica_model = {r.name: r.model for r in self.replicas}
        for row, _values in rows:
            base = replica_model.get(row.backend)
            if base in bases and row.model not in known:
                out[base].add(row.model)
        return out

    async def refresh_report_gauges(self) -> None:
        every = self.policy.ledger.report_every_seconds
        while True:
            try:
                self.metrics.report.update(await self.report(self.policy.ledger.report_window_seconds))
            except StoreError as exc:  # the store is down: the gauges keep their last figures
                log.warning("could not refresh the own-vs-rent gauges: %s", exc)
            except Exception:  # a bug: say so, and keep the loop alive
                log.exception("could not refresh the own-vs-rent gauges")
            await asyncio.sleep(every)

    def start_drain(self) -> None:
        """The process is going away: readiness fails at once so the Service stops routing here (a flag only,
        as it is called from a signal handler). Batch lines are claimed no more; those in flight finish."""
        self.draining = True
        if self.batch_runner is not None:
            self.batch_runner.stopping = True

    async def forget_key(self, key_id: str) -> None:
        """Drop a changed key from this process's cache at once and, on Redis, from every replica's: returns
        once they acknowledged (at most 1 s; a lost message leaves them auth.cache_seconds)."""
        self.authenticate.cache.drop(key_id)
        if self.key_events is not None:
            await self.key_events.announce(key_id)

    def _replica_changed(self, replica: Replica) -> None:
        if not replica.draining:
            self.metrics.backend_up.labels(replica.model, replica.name).set(1 if replica.routable else 0)
            self.metrics.backend_limit.labels(replica.model, replica.name).set(
                -1 if replica.limit is None else int(replica.limit))
        admission = getattr(self, "admission", None)  # absent while the replica set is being built
        if admission is not None:
            admission.replica_changed(replica)

    def _replica_drained(self, replica: Replica) -> None:
        if any(r.name == replica.name for r in self.replicas.by_model.get(replica.group, ())):
            return  # came back under the same name: its series are the live one's
        for gauge in (self.metrics.backend_up, self.metrics.backend_limit):  # in_flight's children are memoized
            with contextlib.suppress(KeyError):
                gauge.remove(replica.model, replica.name)

    def _scraped(self, replica: Replica, stats: VLLMStats | None, error: str | None) -> None:
        self.metrics.scraped(replica.model, replica.name, self.scraper.age(replica), failed=error is not None)

    def _lora_of(self, replica: Replica) -> LoraTimings | None:
        """The LoRA settings of the replica's model, or of its variant that an adapter serves; None: no LoRA."""
        model = next((m for m in self.policy.models if m.name == replica.model), None)
        if model is None:
            return None
        if model.lora is not None:
            return LoraTimings(model.lora.max_loras, model.lora.load_timeout, model.lora.max_answer_bytes)
        adapter = next((v.adapter for v in model.variants if v.name == replica.variant and v.adapter is not None), None)
        if adapter is None:
            return None
        return LoraTimings(adapter.max_loras, adapter.load_timeout)

    def _fleet_queues(self) -> list[FleetModelQueue]:
        """The live snapshot's queues: the fleet's store kind makes each one a FleetModelQueue (policies/state)."""
        return cast("list[FleetModelQueue]", list(self.admission.queues.values()))

    def _lora_refresh_seconds(self) -> float:
        return min((m.lora.refresh_seconds for m in self.policy.models if m.lora is not None), default=5.0)

    def _lora_event(self, replica: Replica, adapter: str, event: str) -> None:
        self.metrics.lora_events.labels(replica.model, replica.name, adapter, event).inc()

    def _egress_refused(self, host: str, _port: int, _address: str) -> None:
        self.metrics.egress_refused.labels(host).inc()

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Litestar) -> AsyncIterator[None]:
        t, bounds = self.policy.timeouts, self.policy.upstream
        # A policy violation found now stops startup; a name that does not resolve yet only logs (see README).
        await check_backends(self.policy, self.resolver, unresolved_fatal=False)
        client = new_client(
            t.connect, t.read, t.write, private_cidrs=self.policy.network.private_cidrs, resolver=self.resolver,
            exempt=exempt_origins(self.policy), on_refused=self._egress_refused,
            limits=Limits(bounds.max_header_bytes, bounds.header_seconds, bounds.max_body_bytes, bounds.max_event_bytes),
        )
        self.client = client
        self.replicas.connect(client)  # each replica owns its upstream on the shared client
        self.install(self.snapshot)
        self.discovery.sync(self.policy)  # models whose replicas are found in the cluster
        self.background.run(self.owners.warm())  # read now, so an outage later does not find it missing
        if self.admin_auth.oidc is not None:  # the provider's keys now: the log says at once if it cannot be read
            self.background.run(self.admin_auth.oidc.refresh())
        loops = [asyncio.create_task(self.replicas.run_checks(client, t.health_check))]
        if self.policy_path is not None:
            self.reloader = PolicyReloader(self, self.policy_path)
            loops.append(asyncio.create_task(self.reloader.run()))
        if self.fleet is not None:  # keeps this process's slot leases alive, whichever snapshot serves
            loops.append(asyncio.create_task(self.fleet.renew_forever(self._fleet_queues)))
        if self.key_events is not None:  # other replicas' key changes drop our cached copies
            loops.append(asyncio.create_task(self.key_events.run(self.authenticate.cache.drop,
                                                                 self.authenticate.cache.doubt_all)))
        if self.variant_share is not None:  # weights and guard verdicts shared with the other replicas
            loops.append(asyncio.create_task(self.variant_share.run()))
        if self.policy.routing.scrape.enabled:
            loops.append(asyncio.create_task(self.scraper.run(client)))
        loops.append(asyncio.create_task(self.kv_subscribers.run()))  # idle unless a backend has kv_events
        loops.append(asyncio.create_task(self.loras.run(client, self._lora_refresh_seconds)))  # idle without LoRA
        if self.policy.ledger.enabled:
            loops.append(asyncio.create_task(self.refresh_report_gauges()))
        loops.append(asyncio.create_task(self.scaling.run(lambda: (self.policy, self.admission.queues))))
        if self.batch_runner is not None:
            loops.append(asyncio.create_task(self.batch_runner.run_forever()))
        try:
            yield
        finally:  # each step bounded (gateway/http/shutdown.py): one that hangs is logged and the rest still run
            self.discovery.stop()
            await cancel_all(loops)
            if self.batch_runner is not None:  # lines in flight stop; their claims expire and they run again
                await step("the batch runner's stop", self.batch_runner.stop(BATCH_GRACE), BATCH_GRACE + STEP_SECONDS)
            self.access_log.flush()
            self.background.run(self.record_usage.flush())
            await step("the admission queues' close", self.admission.close())
            self.background.run(self.record_ledger.flush())
            await self.background.drain(timeout=5)
            await step("the limiter's close", self.limiter.close())  # a release still queued reaches Redis first
            await step("the upstream client's close", client.aclose())
            await step("the ledger's close", self.ledger.close())
            if self.batch_store is not None:
                await step("the batch store's close", self.batch_store.close())
            await step("the audit store's close", self.audit.audit.store.close())
            await step("the admin sign-in's close", self.admin_auth.close())
            await step("the trace exporter's close", asyncio.to_thread(self.tracing.close))  # bounded by its timeout
            await step("the store's close", self.store.close())
