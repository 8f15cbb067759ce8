"""Prefer the replica whose vLLM holds the fewest requests (running + waiting), so load that other gateway
replicas or direct clients put on a backend counts too. Without a fresh scrape, this gateway's own in-flight
count stands in."""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import Candidate, Note, Stateless, Stats, relative_load
from policies.routing.request import RoutingRequest


class VLLMQueue(Stateless):
    name = "vllm-queue"
    def score(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        return relative_load([stats.load(r) for r in candidates])
