"""Keep a session on one replica: a consistent hash of a request header (default `x-session-id`).

Rendezvous hashing: every candidate gets hash(session, replica name) and the highest wins, so a session maps
to the same replica for as long as that replica can take it, moves to its next choice while it is down or
full, and comes back when it returns; adding or removing a replica moves only the sessions that chose it.
The hash is stable across processes, so every gateway replica sends a session to the same backend. Requests
without the header score 0 everywhere and are left to the other scorers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from pydantic import Field

from policies.routing.base import Candidate, Note, RoutingMetrics, Stateless, Stats
from policies.routing.base import Params as BaseParams
from policies.routing.request import RoutingRequest


class SessionAffinityParams(BaseParams):
    header: str = Field("x-session-id", pattern=r"^[A-Za-z0-9-]{1,64}$")


class SessionAffinity(Stateless):
    name = "session-affinity"
    Params = SessionAffinityParams

    def __init__(self, params: SessionAffinityParams | None = None, metrics: RoutingMetrics | None = None) -> None:
        self.header = (params or SessionAffinityParams()).header.lower()

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        session = request.headers.get(self.header) if request.headers is not None else None
        if not session:
            note.outcome = "no_session"
            return [0.0] * len(candidates)
        note.outcome = "pinned"
        ranks = [rendezvous(session, r.name) for r in candidates]
        best = max(ranks)
        return [1.0 if rank == best else 0.0 for rank in ranks]


def rendezvous(session: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{session}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
