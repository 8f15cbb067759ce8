"""One model's routing: filters -> weighted scorers -> picker, and what each decision tells the metrics.

Every plugin's time for each pick goes to the metrics (`llm_gateway_routing_plugin_duration_seconds`, by plugin
and step), kept in a plain tally as the decisions are, each series looked up once when the profile is built:
timing costs two clock reads and one call per plugin.

Plugins get the request as routing sees it (`RoutingRequest`, request.py), made from the call once per pick: its
prompt text is read at most once however many scorers ask. A retry's pick makes a new one (the call has no slot to
keep it in): a handful of attribute reads, and the prompt read again only if a scorer asks, as before.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from time import perf_counter

from backends.replicas import Replica
from policies.routing.base import Filter, Note, Picker, ProfileChoice, RoutingMetrics, Scorer, Stats
from policies.routing.filters import NotEjected
from policies.routing.registry import FILTERS, PICKERS, SCORERS
from policies.routing.request import NO_REQUEST, Routable, RoutingRequest


class Profile:
    def __init__(self, scorers: Sequence[tuple[Scorer, float]], filters: Sequence[Filter] = (),
                 picker: Picker | None = None, stats: Stats | None = None, metrics: RoutingMetrics | None = None, model: str = "",
                 name: str = "") -> None:
        self.name = name
        self.model = model
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.learners = [s for s, _ in self.scorers if s.learns]
        self.picker: Picker = picker or PICKERS["max-score"]()
        self.stats = stats or Stats()
        self.metrics = metrics  # GatewayMetrics (decision, plugin_timer) or None
        timer = (lambda plugin, step: metrics.plugin_timer(model, plugin, step)) if metrics is not None else None
        # per plugin and step, the histogram's observe for it (None: not timed), looked up once here
        # (not-ejected, an attribute test per candidate, is not worth two clock reads)
        self.filter_timers = [timer(f.name, "filter") if timer and not isinstance(f, NotEjected) else None
                              for f in self.filters]
        self.score_timers = [timer(s.name, "score") if timer else None for s, _ in self.scorers]
        self.learn_timers = [timer(s.name, "learn") if timer else None for s in self.learners]
        self.pick_timer = timer(self.picker.name, "pick") if timer else None

    def pick(self, call: Routable | None, replicas: Sequence[Replica], exclude: Sequence[Replica] = ()) -> Replica | None:
        request = call.routing() if call is not None else NO_REQUEST
        candidates = [r for r in replicas if r.routable and r not in exclude]
        for f, timed in zip(self.filters, self.filter_timers):
            if len(candidates) <= 1:
                break
            if timed is None:
                candidates = f.keep(request, candidates, self.stats)
                continue
            start = perf_counter()
            candidates = f.keep(request, candidates, self.stats)
            timed(perf_counter() - start)
        if not candidates:
            return None
        notes: dict[int, Note] = {}
        if len(candidates) == 1:
            chosen = candidates[0]
        else:
            chosen = self.choose(request, candidates, notes)
        uncached = None
        for scorer, timed in zip(self.learners, self.learn_timers):
            start = perf_counter()
            note = notes.get(id(scorer)) or Note()
            scorer.picked(request, chosen, note)
            if timed is not None:
                timed(perf_counter() - start)
            if note.uncached is not None:
                uncached = note.uncached if uncached is None else min(uncached, note.uncached)
        if call is not None:
            call.routed(uncached)
        return chosen

    def choose(self, request: RoutingRequest, candidates: list[Replica], notes: dict[int, Note]) -> Replica:
        stats = self.stats
        totals: list[float] = [0.0] * len(candidates)
        decisions = []
        for (scorer, weight), timed in zip(self.scorers, self.score_timers):
            note = notes[id(scorer)] = Note()
            start = perf_counter()
            scores = scorer.score(request, candidates, stats, note)
            if timed is not None:
                timed(perf_counter() - start)
            high = max(scores)
            if high > 1.0 or min(scores) < 0.0:
                scores = [min(1.0, max(0.0, s)) for s in scores]
                high = max(scores)
            totals = [t + weight * s for t, s in zip(totals, scores)]
            decisions.append((scorer, note, scores, high))
        start = perf_counter()
        chosen = self.picker.pick(candidates, totals)
        if self.pick_timer is not None:
            self.pick_timer(perf_counter() - start)
        if self.metrics is not None:
            index = candidates.index(chosen)
            model, decision = self.model, self.metrics.decision
            for scorer, note, scores, high in decisions:
                decision(model, scorer.name, note.outcome or ("agreed" if scores[index] == high else "overruled"))
        return chosen


def build_profile(config: ProfileChoice, model: str = "", stats: Stats | None = None, metrics: RoutingMetrics | None = None,
                  rng: random.Random | None = None, name: str = "") -> Profile:
    """A Profile from the policy file's `routing.profiles.<name>` (a RoutingProfile); plugins get their params."""
    filters = [NotEjected(), *(FILTERS[ref.name](ref.params, metrics) for ref in config.filters)]
    scorers = [(SCORERS[ref.name](ref.params, metrics), ref.weight) for ref in config.scorers]
    picker = PICKERS[config.picker](rng)
    return Profile(scorers, filters, picker, stats, metrics, model, name)
