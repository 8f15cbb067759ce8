"""A labelled Prometheus counter and histogram for the hottest spots of the request path: plain dicts, read at
exposition.

prometheus_client's Counter takes a lock and looks up its child on every increment; routing records several
decisions per request, so those are tallied here instead (the request path and /metrics share one event loop
thread) and turned into a counter family only when /metrics is read. The series looks like any Counter's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily


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


class TallyHistogram:
    """A labelled histogram kept the same way: per label set, one count per bucket (the first bucket whose upper
    bound is at least the value; the last is +Inf) and a sum, made cumulative only when /metrics is read."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...], buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.bounds = tuple(sorted(buckets))
        self.series: dict[tuple[str, ...], list[float]] = {}  # per label set: bucket counts, then the sum

    def observe(self, values: tuple[str, ...], value: float) -> None:
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = [0.0] * (len(self.bounds) + 2)
        series[bisect_left(self.bounds, value)] += 1
        series[-1] += value

    def child(self, values: tuple[str, ...]) -> Callable[[float], None]:
        """`observe` for one label set, its series looked up once (the request path calls it per pick)."""
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = [0.0] * (len(self.bounds) + 2)
        bounds = self.bounds

        def observe(value: float) -> None:
            series[bisect_left(bounds, value)] += 1
            series[-1] += value

        return observe

    def count(self, values: tuple[str, ...]) -> int:
        series = self.series.get(values)
        return 0 if series is None else int(sum(series[:-1]))

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, series in list(self.series.items()):
            running, buckets = 0.0, []
            for bound, n in zip((*map(str, self.bounds), "+Inf"), series[:-1]):
                running += n
                buckets.append((bound, running))
            family.add_metric(list(values), buckets, series[-1])
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
