"""Outlier ejection: a replica that keeps failing, or answers far slower than its peers, sits out for a while.

Two rules, per replica of a model (settings: policies/config/reliability.py `Ejection`):
- `consecutive_failures`: that many 5xx answers or timeouts in a row;
- `ttft`: its time to first token (a moving average over about `ttft_min_samples` streams) above `ttft_ratio`
  times the median of its peers' (those of the same replica set with as many samples).
An ejected replica gets no new request for a backoff that doubles with each ejection (`base_seconds` up to
`max_seconds`) and starts again once it has served well for as long as its last ejection lasted. Never more
than `max_ejected_share` of a replica set is out at once, and never its last replica (Envoy's outlier
detection, with `max_ejection_percent`).

The state lives on each replica (`Replica.outlier`, made at its first failure or stream), so it outlives
policy reloads; routing drops ejected replicas with the `not-ejected` filter (policies/routing/filters.py),
which costs one attribute test per candidate while none is ejected. An ejection ends on a timer of the
event loop; `release_due` ends those due by a given time (for a clock of the caller's own).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from backends.replica_state import Outlier
from backends.replicas import Replica, ReplicaSet

FAILURES, TTFT = "consecutive_failures", "ttft"
CHECK_EVERY = 8  # TTFT samples between two comparisons with the peers


class Rules(Protocol):
    """A model's ejection settings (policies/config/reliability.py `Ejection`; the config imports the routing
    plugins, which import this, so the type is named by its shape)."""

    @property
    def enabled(self) -> bool: ...
    @property
    def consecutive_failures(self) -> int: ...
    @property
    def ttft_ratio(self) -> float | None: ...
    @property
    def ttft_min_samples(self) -> int: ...
    @property
    def base_seconds(self) -> float: ...
    @property
    def max_seconds(self) -> float: ...
    @property
    def max_ejected_share(self) -> float: ...


class Ejections:
    def __init__(self, replicas: ReplicaSet, default: Rules, settings: Mapping[str, Rules] | None = None,
                 on_eject: Callable[[Replica, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, unix: Callable[[], float] = time.time) -> None:
        self.replicas = replicas
        self.default = default  # for a model the settings do not name
        self.settings = dict(settings or {})  # by public model name
        self.on_eject = on_eject
        self.clock = clock
        self.unix = unix

    def config(self, replica: Replica) -> Rules:
        return self.settings.get(replica.model, self.default)

    def failed(self, replica: Replica) -> None:
        """A 5xx answer or a timeout from `replica`."""
        if replica.rented:
            return
        outlier = replica.outlier or self._state(replica)
        outlier.failures += 1
        config = self.config(replica)
        if outlier.failures >= config.consecutive_failures and not outlier.ejected:
            self.eject(replica, FAILURES)

    def succeeded(self, replica: Replica) -> None:
        """A good answer from `replica` (the caller checked `replica.outlier is not None`: free otherwise)."""
        outlier = replica.outlier
        if outlier is None:
            return
        outlier.failures = 0
        if outlier.ejections and not outlier.ejected and self.clock() - outlier.returned_at >= outlier.lasted:
            outlier.ejections = 0  # it served well for as long as it was out: the backoff starts again

    def ttft(self, replica: Replica, seconds: float) -> None:
        """A stream's time to first token on `replica`."""
        if replica.rented:
            return
        outlier = replica.outlier or self._state(replica)
        config = self.config(replica)
        if config.ttft_ratio is None:
            return
        alpha = 2.0 / (config.ttft_min_samples + 1)
        outlier.ttft = seconds if outlier.samples == 0 else outlier.ttft + alpha * (seconds - outlier.ttft)
        outlier.samples += 1
        if outlier.samples >= config.ttft_min_samples and outlier.samples % CHECK_EVERY == 0 and not outlier.ejected:
            peers = sorted(p.outlier.ttft for p in self.replicas.by_model.get(replica.group, ())
                           if p is not replica and p.outlier is not None
                           and p.outlier.samples >= config.ttft_min_samples and not p.outlier.ejected)
            if peers:
                middle = len(peers) // 2
                median = peers[middle] if len(peers) % 2 else (peers[middle - 1] + peers[middle]) / 2
                if outlier.ttft > config.ttft_ratio * median:
                    self.eject(replica, TTFT)

    def eject(self, replica: Replica, rule: str) -> bool:
        """Take `replica` out of routing by `rule`, unless that would put its set over the share allowed out."""
        config = self.config(replica)
        outlier = replica.outlier or self._state(replica)
        if not config.enabled or outlier.ejected:
            return False
        members = [r for r in self.replicas.by_model.get(replica.group, ()) if not r.draining]
        out = sum(1 for r in members if r.outlier is not None and r.outlier.ejected)
        if out + 1 > int(config.max_ejected_share * len(members)) or len(members) - out - 1 < 1:
            return False
        now = self.clock()
        lasted = min(config.max_seconds, config.base_seconds * 2 ** outlier.ejections)
        outlier.ejections += 1
        outlier.ejected, outlier.rule, outlier.lasted = True, rule, lasted
        outlier.until, outlier.until_unix = now + lasted, self.unix() + lasted
        outlier.failures = outlier.samples = 0  # it starts afresh when back
        try:
            outlier.timer = asyncio.get_running_loop().call_later(lasted, self._back, replica)
        except RuntimeError:  # no loop (a caller with a clock of its own): release_due ends it
            outlier.timer = None
        if self.on_eject is not None:
            self.on_eject(replica, rule)
        return True

    def release_due(self, now: float) -> None:
        """End every ejection due by `now`."""
        for replica in self.replicas:
            outlier = replica.outlier
            if outlier is not None and outlier.ejected and outlier.until <= now:
                self._back(replica)

    def _back(self, replica: Replica) -> None:
        outlier = replica.outlier
        if outlier is None or not outlier.ejected:
            return
        if outlier.timer is not None:
            outlier.timer.cancel()
            outlier.timer = None
        outlier.ejected, outlier.until_unix = False, None
        outlier.returned_at = self.clock()

    @staticmethod
    def _state(replica: Replica) -> Outlier:
        outlier = replica.outlier = Outlier()
        return outlier


def ejected(replica: Replica) -> bool:
    outlier = replica.outlier
    return outlier is not None and outlier.ejected
