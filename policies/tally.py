"""A labelled Prometheus counter for the hottest spots of the request path: a plain dict, read at exposition.

prometheus_client's Counter takes a lock and looks up its child on every increment; routing records several
decisions per request, so those are tallied here instead (the request path and /metrics share one event loop
thread) and turned into a counter family only when /metrics is read. The series looks like any Counter's.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily


class TallyCounter:
    def __init__(self, name: str, documentation: str, labels: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.counts: dict[tuple[str, ...], int] = {}

    def add(self, values: tuple[str, ...], amount: int = 1) -> None:
        self.counts[values] = self.counts.get(values, 0) + amount

    def value(self, values: tuple[str, ...]) -> int:
        return self.counts.get(values, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, count in list(self.counts.items()):
            family.add_metric(values, count)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labels)
