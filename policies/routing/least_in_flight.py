"""Prefer the replica with the fewest requests this gateway has in flight to it."""

from __future__ import annotations

from collections.abc import Sequence

from policies.pipeline import Call
from policies.routing.base import Candidate, Note, Stateless, Stats, relative_load


class LeastInFlight(Stateless):
    name = "least-in-flight"
    def score(self, call: Call, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        return relative_load([float(r.in_flight) for r in candidates])
