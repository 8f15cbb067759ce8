"""Prefer the replica with the most free KV cache (1 - vllm:kv_cache_usage_perc): more free blocks, more
requests vLLM can run at once. A replica without a fresh scrape scores the mean of the others (neutral)."""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import Candidate, Note, Stateless, Stats
from policies.routing.request import RoutingRequest


class KVCache(Stateless):
    name = "kv-cache"
    def score(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        free: list[float | None] = []
        for replica in candidates:
            s = stats.vllm(replica)
            free.append(None if s is None or s.kv_usage is None else 1.0 - s.kv_usage)
        known = [f for f in free if f is not None]
        neutral = sum(known) / len(known) if known else 1.0
        return [neutral if f is None else f for f in free]
