"""Prefer the replicas that hold the request's LoRA adapter, so that an adapter is loaded once, not everywhere.

1 for a replica that holds the adapter (as vLLM last said, plus the loads and unloads this gateway made since:
backends/lora.py) or is loading it now; `room` for one that could load it without unloading another (fewer
than max_loras held); when every one would have to unload one, `room / 2` for the one whose least recently
used adapter has been idle longest (the fleet's least recently used goes), 0 for the others. A request of a
base model (no adapter) scores every replica alike. With a weight above the sum of the load scorers' (the
default profile: 8 against 4 + 2 + 1) it decides whenever one replica holds the adapter and another does
not; among equals the prefix and load scorers decide.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from backends.lora import held
from policies.routing.base import Candidate, Note, Params, Stateless, Stats
from policies.routing.request import RoutingRequest


class LoraAffinityParams(Params):
    room: float = Field(0.5, ge=0, le=1)  # the score of a replica with a free adapter slot
    max_loras: int = Field(1, ge=1, le=1024)  # slots of a replica when its model does not say (lora.max_loras)


class LoraAffinity(Stateless):
    name = "lora-affinity"
    Params = LoraAffinityParams

    def __init__(self, params: LoraAffinityParams | None = None, metrics: object = None) -> None:
        self.params = params or LoraAffinityParams()

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        adapter = request.adapter
        if adapter is None:
            note.outcome = "no_adapter"
            return [1.0] * len(candidates)
        name = adapter.lora_name
        states = [held(r) for r in candidates]
        scores = []
        for state in states:
            if state.holds(name) or name in state.loading:  # a load under way: wait for it, not load it twice
                scores.append(1.0)
            elif adapter.path is None:  # found on some replicas, with no path to load it on others
                scores.append(0.0)
            elif len(state.loaded) < (state.max_loras or self.params.max_loras):
                scores.append(self.params.room)
            else:
                scores.append(0.0)
        if adapter.path is not None and self.params.room not in scores and 1.0 not in scores:
            # every one would have to unload one: the one whose unload is of the longest idle adapter
            idle = [s.idle_since() for s in states]
            oldest = min((at for at in idle if at is not None), default=None)
            scores = [self.params.room / 2 if at is not None and at == oldest else 0.0 for at in idle]
        note.outcome = "held" if 1.0 in scores else "load"
        return scores
