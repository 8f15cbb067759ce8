"""Choosing the replica that serves a request: filters, weighted scorers, one picker.

A profile runs in three steps: drop the replicas that cannot serve (filters), score the rest in [0, 1] with
each scorer times its configured weight, pick the best (random among equals, so ties spread load). A new
routing algorithm is one Scorer class registered in SCORERS and one line in the policy file's `routing:`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from backends.replicas import Replica


class Scorer(Protocol):
    name: str

    def score(self, replicas: Sequence[Replica]) -> list[float]:
        """One score in [0, 1] per replica; higher is better."""


class LeastInFlight:
    """Prefer the replica with the fewest requests the gateway has in flight to it."""

    name = "least-in-flight"

    def score(self, replicas: Sequence[Replica]) -> list[float]:
        most = max(r.in_flight for r in replicas)
        if most == 0:
            return [1.0] * len(replicas)
        return [1.0 - r.in_flight / most for r in replicas]


SCORERS: dict[str, type] = {LeastInFlight.name: LeastInFlight}


def routable(replicas: Sequence[Replica], exclude: Sequence[Replica] = ()) -> list[Replica]:
    """The filter step: replicas not known to be down and not already tried for this request."""
    return [r for r in replicas if r.routable and r not in exclude]


class Profile:
    def __init__(self, scorers: Sequence[tuple[Scorer, float]], rng: random.Random | None = None) -> None:
        self.scorers = list(scorers)
        self.rng = rng or random.Random()

    @classmethod
    def from_config(cls, refs) -> Profile:
        return cls([(SCORERS[ref.name](), ref.weight) for ref in refs])

    def pick(self, replicas: Sequence[Replica], exclude: Sequence[Replica] = ()) -> Replica | None:
        candidates = routable(replicas, exclude)
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        totals = [0.0] * len(candidates)
        for scorer, weight in self.scorers:
            for i, s in enumerate(scorer.score(candidates)):
                totals[i] += weight * min(1.0, max(0.0, s))
        best = max(totals)
        return self.rng.choice([c for c, t in zip(candidates, totals) if t == best])
