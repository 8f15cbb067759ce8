"""Prefer the replica with the fewest requests this gateway has in flight to it."""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import Candidate, Note, Stateless, Stats, relative_load
from policies.routing.request import RoutingRequest


class LeastInFlight(Stateless):
    name = "least-in-flight"
    def score(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        return relative_load([float(r.in_flight) for r in candidates])
