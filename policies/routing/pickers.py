"""Pickers: the last step of a profile, choosing among candidates by their weighted total scores."""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.routing.base import Candidate


class MaxScore:
    """The highest total; random among equals, so ties spread load."""

    name = "max-score"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, candidates: Sequence[Candidate], totals: list[float]) -> Candidate:
        best = max(totals)
        if totals.count(best) == 1:
            return candidates[totals.index(best)]
        return self.rng.choice([c for c, t in zip(candidates, totals) if t == best])


class Random:
    """Uniformly at random, whatever the scores (a baseline for benchmarks)."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, candidates: Sequence[Candidate], totals: list[float]) -> Candidate:
        return self.rng.choice(list(candidates))
