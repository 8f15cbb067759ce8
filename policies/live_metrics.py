"""Metrics of what changes while the gateway serves: the policy's version and reloads, the live replicas, and
the discovery watches that feed them.

The replica counts are read from the live set when /metrics is scraped (a collector), so nothing on the
request path or in the replica set keeps them up to date.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from backends.replicas import ReplicaSet
from policies.discovery import Discovery


class LiveMetrics:
    def __init__(self, registry: CollectorRegistry, replicas: ReplicaSet) -> None:
        self.reloads = Counter(
            "llm_gateway_policy_reload", "Policy reloads by result (ok, invalid: refused, the old one serves).",
            ["result"], registry=registry,
        )
        self.loaded = Gauge(
            "llm_gateway_policy_loaded_timestamp_seconds", "When the live policy was loaded, by its version (hash).",
            ["version"], registry=registry,
        )
        registry.register(ReplicaCollector(replicas))
        registry.register(KVIndexCollector(replicas))
        self.registry = registry

    def watching(self, discovery: Discovery) -> None:
        """Export the state of `discovery`'s watches (policies/discovery.py), read at each scrape."""
        self.registry.register(WatchCollector(discovery))

    def reloaded(self, result: str, version: str | None = None) -> None:
        self.reloads.labels(result).inc()
        if version is not None:
            self.serving(version)

    def serving(self, version: str, loaded_at: float | None = None) -> None:
        self.loaded.clear()
        self.loaded.labels(version).set(loaded_at or time.time())


class ReplicaCollector:
    """llm_gateway_replicas{model,source,state} and llm_gateway_replicas_draining{model}, from the live set."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def describe(self) -> list[Metric]:
        return []  # collected live; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        counts = GaugeMetricFamily("llm_gateway_replicas", "Owned replicas per model, by source and state.",
                                   labels=["model", "source", "state"])
        draining = GaugeMetricFamily("llm_gateway_replicas_draining",
                                     "Removed replicas still finishing requests in flight, per model.",
                                     labels=["model"])
        tally = Tally((r.model, r.source, r.state) for r in self.replicas)
        for (model, source, state), n in sorted(tally.items()):
            counts.add_metric([model, source, state], n)
        for model, n in sorted(Tally(r.model for r in self.replicas.draining).items()):
            draining.add_metric([model], n)
        yield counts
        yield draining


class KVIndexCollector:
    """Per backend whose vLLM publishes KV cache events (backends/kv_events.py): the blocks its index holds, and
    the blocks stored and removed, the clears (gaps, restarts, AllBlocksCleared), gaps and refused input so far."""

    COUNTERS = (("llm_gateway_kv_blocks_stored", "Blocks vLLM reported stored.", "stored_total"),
                ("llm_gateway_kv_blocks_removed", "Indexed blocks vLLM reported evicted.", "removed_total"),
                ("llm_gateway_kv_index_clears", "Index clears: AllBlocksCleared, a gap, a restart, down.", "clears"),
                ("llm_gateway_kv_event_gaps", "Sequence gaps in the event stream (events lost).", "gaps"),
                ("llm_gateway_kv_events_refused", "Messages or events refused as malformed, oversized or unknown.",
                 "refused"))

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        indexed = [(r, r.kv_index) for r in self.replicas if r.kv_index is not None]
        blocks = GaugeMetricFamily("llm_gateway_kv_blocks", "KV cache blocks vLLM holds, as its events say.",
                                   labels=["model", "backend"])
        for r, index in indexed:
            blocks.add_metric([r.model, r.name], len(index))
        yield blocks
        for name, doc, attribute in self.COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model", "backend"])
            for r, index in indexed:
                family.add_metric([r.model, r.name], getattr(index, attribute))
            yield family


class WatchCollector:
    """Each discovery watch's state, last sync and failures, from the watches themselves: a watch that broke
    (the API server down, a frozen connection, an exception in its thread) shows here, not only in the log."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "source", "watch"]
        up = GaugeMetricFamily("llm_gateway_discovery_watch_up", "1 while a discovery watch is in sync with the"
                               " Kubernetes API; 0 while it is broken (retrying with backoff, its replicas as last"
                               " seen) or has not listed yet.", labels=labels)
        synced = GaugeMetricFamily("llm_gateway_discovery_watch_last_sync_timestamp_seconds", "When the watch last"
                                   " heard from the API server (a list, an event or a bookmark); 0: never.",
                                   labels=labels)
        failures = CounterMetricFamily("llm_gateway_discovery_watch_failures", "Failed lists and watches (errors,"
                                       " timeouts, a stream silent past kubernetes.read_timeout).", labels=labels)
        for model, source, watcher in self.discovery.watches():
            values = [model, source, watcher.name]
            up.add_metric(values, 1 if watcher.state == "ok" else 0)
            synced.add_metric(values, watcher.last_sync or 0)
            failures.add_metric(values, watcher.failures)
        yield up
        yield synced
        yield failures
