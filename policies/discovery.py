"""The models whose replicas are found in a cluster: one source each (backends/sources/), kept in step with
the policy, feeding the live replica set.

Each endpoint a source reports becomes a replica named `MODEL@ADDRESS:PORT` (stable while the endpoint is),
with the model's `discovery` settings: cap, health path, and, with `kv_events`, where its vLLM publishes its KV
cache events (`tcp://ADDRESS:PORT` at that section's port: backends/kv_events.py subscribes while the replica is
in the set and stops when it leaves; only an address a source reported, never a client's). An address outside
`network.private_cidrs` is refused, never added: listed with its reason in `refused` (shown by /admin/replicas
while the source reports it), logged when it appears, and counted in llm_gateway_egress_refused_total at every
event that reports it. Sources report from their own threads; the set is changed on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from backends.egress import Network, inside, networks
from backends.replicas import KVEventSource, Replica, ReplicaSet
from backends.sources.base import Endpoint, Source
from backends.sources.watch import Watcher, WatchTimings
from policies.config import Discovery as DiscoveryConfig
from policies.config import KubernetesAccess, Model, Policy, groups_of
from policies.config.discovery import DiscoveredKVEvents

log = logging.getLogger("gateway.discovery")

SourceFactory = Callable[[DiscoveryConfig, KubernetesAccess], Source]
# what a model's source watches: kind, namespace, service, inference service, port, and the API access
Target = tuple[str, str, str | None, str | None, int | str | None, KubernetesAccess]


def make_source(config: DiscoveryConfig, access: KubernetesAccess) -> Source:
    from backends.sources.kubernetes import KubernetesSource, api_client

    timings = watch_timings(access)
    if config.kind == "kubernetes":
        assert config.service is not None  # the schema's names_its_target
        return KubernetesSource(api_client(access.kubeconfig), config.namespace, config.service, config.port, timings)
    from backends.sources.kserve import KServeSource

    assert config.inference_service is not None  # the schema's names_its_target
    return KServeSource(api_client(access.kubeconfig), config.namespace, config.inference_service, config.port,
                        timings)


def watch_timings(access: KubernetesAccess) -> WatchTimings:
    return WatchTimings(read_timeout=access.read_timeout, connect_timeout=access.connect_timeout,
                        relist_every=access.relist_seconds, backoff_initial=access.backoff_initial,
                        backoff_max=access.backoff_max)


class Discovery:
    def __init__(self, replicas: ReplicaSet, on_refused: Callable[[str], None] | None = None,
                 source_factory: SourceFactory = make_source) -> None:
        self.replicas = replicas
        self.on_refused: Callable[[str], None] = on_refused or (lambda address: None)
        self.make_source = source_factory
        self.running: dict[str, tuple[Target, Source]] = {}  # model -> (what it watches, the source)
        self.models: dict[str, tuple[Model, DiscoveryConfig, str | None]] = {}  # set -> model, source, variant
        self.last: dict[str, list[Endpoint]] = {}
        self.refused: dict[str, dict[str, Refused]] = {}  # replica set -> the refused endpoints it has now
        self.nets: list[Network] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    def sync(self, policy: Policy) -> None:
        """Start, keep or stop each model's source to match `policy` (at start and at every reload)."""
        self.loop = asyncio.get_running_loop()
        self.nets = networks(policy.network.private_cidrs)
        self.models = {group: (m, (v or m).discovery, v.name if v else None)
                       for m in policy.models for group, v in groups_of(m) if (v or m).discovery is not None}
        for name in [n for n in self.running if n not in self.models]:
            self.running.pop(name)[1].stop()
            self.last.pop(name, None)
            self.refused.pop(name, None)
        for name, (_, config, _) in self.models.items():
            target: Target = (config.kind, config.namespace, config.service, config.inference_service, config.port,
                      policy.kubernetes)
            running = self.running.get(name)
            if running is not None and running[0] == target:
                self.apply(name, self.last.get(name, []))  # same endpoints, maybe new settings
                continue
            if running is not None:
                running[1].stop()
            try:
                source = self.make_source(config, policy.kubernetes)
            except Exception as exc:  # noqa: BLE001 - no kubeconfig, not in a cluster: this model has no replicas
                self.running.pop(name, None)
                log.error("model %s: discovery (%s) cannot reach the Kubernetes API, the model gets no replica: %s"
                          " (set kubernetes.kubeconfig, or run in a pod with a service account)",
                          name, config.kind, exc)
                continue
            self.running[name] = (target, source)
            source.start(partial(self.emit, name, source))

    def emit(self, model: str, source: Source, endpoints: list[Endpoint]) -> None:
        """From a source's thread: hand the new desired list to the event loop."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.changed, model, source, endpoints)

    def changed(self, model: str, source: Source, endpoints: list[Endpoint]) -> None:
        running = self.running.get(model)
        if running is None or running[1] is not source:
            return  # a source that was replaced or stopped: its last words do not count
        self.last[model] = endpoints
        self.apply(model, endpoints)
        for refused in self.refused.get(model, {}).values():  # counted per event, not once per process
            self.on_refused(refused.address)

    def apply(self, name: str, endpoints: list[Endpoint]) -> None:
        """`name` is a replica set: a model, or one of its variants (`model#variant`)."""
        model, config, variant = self.models[name]
        desired = []
        before, refused = self.refused.get(name, {}), {}
        for endpoint in endpoints:
            if not inside(endpoint.address, self.nets):
                key = f"{name}@{endpoint.address}:{endpoint.port}"
                refused[key] = Refused(key, endpoint.address, endpoint.url(config.scheme), config.kind,
                                       "outside network.private_cidrs")
                if key not in before:
                    log.warning("refused: endpoint %s of model %s (%s %s/%s) is outside network.private_cidrs;"
                                " never routed to", endpoint.address, name, config.kind, config.namespace,
                                config.service or config.inference_service)
                continue
            desired.append(Replica(
                name=f"{name}@{endpoint.address}:{endpoint.port}", model=model.name, url=endpoint.url(config.scheme),
                served_name=served_name(model, variant), cap=config.cap, health_path=config.health_path,
                source=config.kind, variant=variant, kv_events=kv_event_source(config.kv_events, endpoint),
            ))
        self.refused[name] = refused
        self.replicas.apply(name, desired)

    def watches(self) -> list[tuple[str, str, Watcher]]:
        """(replica set, source kind, watch) of every running source: their state for metrics and the admin API."""
        return [(name, source.kind, watcher) for name, (_, source) in sorted(self.running.items())
                for watcher in getattr(source, "watchers", list)()]

    def stop(self) -> None:
        for _, source in self.running.values():
            source.stop()
        self.running.clear()


@dataclass(frozen=True, slots=True)
class Refused:
    """An endpoint a source reported that the gateway will not route to, and why."""

    name: str  # MODEL@ADDRESS:PORT, as its replica would be named
    address: str
    url: str
    source: str
    reason: str


def kv_event_source(config: DiscoveredKVEvents | None, endpoint: Endpoint) -> KVEventSource | None:
    """Where a discovered replica's vLLM publishes its KV cache events: its own address (vLLM binds)."""
    if config is None:
        return None
    replay = f"tcp://{endpoint.host}:{config.replay_port}" if config.replay_port is not None else None
    return KVEventSource(f"tcp://{endpoint.host}:{config.port}", False, config.topic, config.max_message_bytes,
                         config.max_blocks, replay)


def served_name(model: Model, variant: str | None) -> str:
    chosen = next((v for v in model.variants if v.name == variant), None)
    return (chosen.served_name if chosen else None) or model.served_name or model.name
