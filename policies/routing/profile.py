"""One model's routing: filters -> weighted scorers -> picker, and what each decision tells the metrics."""

from __future__ import annotations

import random
from collections.abc import Sequence

from backends.replicas import Replica
from policies.pipeline import Call
from policies.routing.base import Filter, Picker, Scorer, Stats
from policies.routing.registry import FILTERS, PICKERS, SCORERS

NO_CALL = Call(request_id="", endpoint="", headers={}, client_host="", arrived=0.0)  # a pick for no request


class Profile:
    def __init__(self, scorers: Sequence[tuple[Scorer, float]], filters: Sequence[Filter] = (),
                 picker: Picker | None = None, stats: Stats | None = None, metrics=None, model: str = "",
                 name: str = "") -> None:
        self.name = name
        self.model = model
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.learners = [s for s, _ in self.scorers if getattr(s, "learns", True)]
        self.picker = picker or PICKERS["max-score"]()
        self.stats = stats or Stats()
        self.metrics = metrics  # RoutingMetrics or None

    def pick(self, call: Call | None, replicas: Sequence[Replica], exclude: Sequence[Replica] = ()) -> Replica | None:
        call = call or NO_CALL
        candidates = [r for r in replicas if r.routable and r not in exclude]
        for f in self.filters:
            if len(candidates) <= 1:
                break
            candidates = f.keep(call, candidates, self.stats)
        if not candidates:
            return None
        if len(candidates) == 1:
            chosen = candidates[0]
        else:
            chosen = self.choose(call, candidates)
        for scorer in self.learners:
            scorer.picked(call, chosen)
        return chosen

    def choose(self, call: Call, candidates: list[Replica]) -> Replica:
        stats = self.stats
        totals: list[float] | None = None
        decisions = []
        for scorer, weight in self.scorers:
            scorer.outcome = None
            scores = scorer.score(call, candidates, stats)
            high = max(scores)
            if high > 1.0 or min(scores) < 0.0:
                scores = [min(1.0, max(0.0, s)) for s in scores]
                high = max(scores)
            if totals is None:
                totals = [weight * s for s in scores]
            else:
                totals = [t + weight * s for t, s in zip(totals, scores)]
            decisions.append((scorer, scores, high))
        chosen = self.picker.pick(candidates, totals)
        if self.metrics is not None:
            index = candidates.index(chosen)
            model, decision = self.model, self.metrics.decision
            for scorer, scores, high in decisions:
                decision(model, scorer.name, scorer.outcome or ("agreed" if scores[index] == high else "overruled"))
        return chosen


def build_profile(config, model: str = "", stats: Stats | None = None, metrics=None,
                  rng: random.Random | None = None, name: str = "") -> Profile:
    """A Profile from the policy file's `routing.profiles.<name>` (a RoutingProfile); plugins get their params."""
    filters = [FILTERS[ref.name](FILTERS[ref.name].Params.model_validate(ref.params), metrics)
               for ref in config.filters]
    scorers = [(SCORERS[ref.name](SCORERS[ref.name].Params.model_validate(ref.params), metrics), ref.weight)
               for ref in config.scorers]
    picker = PICKERS[config.picker](rng)
    return Profile(scorers, filters, picker, stats, metrics, model, name)
