"""Filters: drop candidates that should not serve a request. A filter that would leave none keeps them all."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from policies.routing.base import Candidate, RoutingMetrics, Stats
from policies.routing.base import Params as BaseParams
from policies.routing.request import RoutingRequest


class KVHeadroomParams(BaseParams):
    max_usage: float = Field(0.95, gt=0, le=1)


class KVHeadroom:
    """Skip replicas whose vLLM reports its KV cache at least `max_usage` full: a request sent there waits
    for blocks (or preempts others) while another replica has room."""

    name = "kv-headroom"
    Params = KVHeadroomParams

    def __init__(self, params: KVHeadroomParams | None = None, metrics: RoutingMetrics | None = None) -> None:
        self.max_usage = (params or KVHeadroomParams()).max_usage

    def keep(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats) -> list[Candidate]:
        kept = []
        for replica in candidates:
            s = stats.vllm(replica)
            if s is None or s.kv_usage is None or s.kv_usage < self.max_usage:
                kept.append(replica)
        return kept or list(candidates)


class NotEjected:
    """Skip replicas that outlier ejection took out for now (policies/ejection.py). Every profile runs it first
    (profile.py); while none is ejected it costs one attribute test per candidate and makes no list."""

    name = "not-ejected"
    Params = BaseParams

    def __init__(self, params: BaseParams | None = None, metrics: RoutingMetrics | None = None) -> None:
        pass

    def keep(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats) -> list[Candidate]:
        for replica in candidates:
            outlier = replica.outlier
            if outlier is not None and outlier.ejected:
                return [r for r in candidates if r.outlier is None or not r.outlier.ejected] or list(candidates)
        return candidates if isinstance(candidates, list) else list(candidates)
