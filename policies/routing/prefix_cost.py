"""Keep a conversation on the replica holding its prefix unless the queue there costs more than recomputing the
prefix elsewhere, both in vLLM's own seconds.

For each candidate the scorer estimates the seconds to this request's first token there:

    cost = queue + (prompt tokens - tokens it holds) / prefill rate

- queue: vLLM's own mean queue time (vllm:request_queue_time_seconds, _sum over _count) over the requests it
  finished in the last `window` seconds of scrapes; when none finished in the window, 0 if nothing waits there,
  else its mean since it started.
- prefill rate: prompt tokens it computed (prefix-cache queries less hits) per second of its requests' prefill
  (vllm:request_prefill_time_seconds; a server without that histogram: time to first token less queue time),
  over the same window, else since it started. It is per request, under the batch it ran in, which is what a
  request waits for. A replica without a rate yet takes the mean of the others' (they serve one model).
- tokens it holds: the leading blocks of the prompt the gateway sent it, prefix-affinity's record (an LRU sized
  to vLLM's KV cache, evicting a prompt from its end as vLLM does; this scorer is prefix-affinity with another
  decision, so a conversation whose newest blocks were evicted still scores its older ones).

The decision, with outcomes for llm_gateway_routing_decisions_total:
- some candidate holds more of the prompt than every candidate does: the cheapest scores 1, the others 0, so a
  conversation stays (`stay`) unless its replica's queue costs more than the recompute elsewhere (`move`), by
  more than `margin` seconds; load scorers after it cannot overturn that with their weights below its own.
- the prompt's match is a shared prefix (prefix-affinity's rule: continued in more than one way, or the whole
  prompt) on a candidate holding more load than another: all score 1, load decides (`shared`).
- a miss everywhere (or all hold alike): each scores cheapest / its cost, a lean toward the shorter queue that
  the load scorers settle (`miss`).
- a candidate without a fresh scrape, or no prefill rate anywhere: the match alone decides (`no_stats`), as
  prefix-affinity with its guard off: the conversation stays where its prefix is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pydantic import Field

from backends.vllm_stats import VLLMStats
from policies.routing.base import Candidate, Note, RoutingMetrics, Stats
from policies.routing.prefix_affinity import CHARS_PER_TOKEN, PrefixAffinity, PrefixAffinityParams
from policies.routing.request import RoutingRequest

SNAPSHOTS = 512  # per replica: scrapes kept for the window (4 a second over 60 s fit)


class PrefixCostParams(PrefixAffinityParams):
    window: float = Field(10.0, gt=0, le=600)  # seconds of vLLM's figures the queue time and rate are taken over
    margin: float = Field(0.0, ge=0, le=60)  # seconds a move must save over staying


class Figures:
    """A replica's cumulative figures at one scrape: (time, queue s, queue n, prefill s, prefill n, computed tokens)."""

    __slots__ = ("at", "queue_s", "queue_n", "prefill_s", "prefill_n", "computed")

    def __init__(self, stats: VLLMStats) -> None:
        self.at = stats.scraped_at
        self.queue_s, self.queue_n = stats.queue_seconds, stats.queue_requests
        prefill_s, self.prefill_n = stats.prefill_seconds, stats.prefill_requests
        if prefill_s is None and stats.ttft_seconds is not None and stats.queue_seconds is not None:
            prefill_s, self.prefill_n = stats.ttft_seconds - stats.queue_seconds, stats.ttft_requests
        self.prefill_s = prefill_s
        self.computed = (None if stats.prefix_queries is None
                         else max(0.0, stats.prefix_queries - (stats.prefix_hits or 0.0)))

    def restarted_since(self, old: Figures) -> bool:
        return any(new is not None and was is not None and new < was
                   for new, was in ((self.queue_n, old.queue_n), (self.prefill_n, old.prefill_n),
                                    (self.computed, old.computed)))


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or not bottom or bottom <= 0 else top / bottom


class PrefixCost(PrefixAffinity):
    name = "prefix-cost"
    Params = PrefixCostParams

    def __init__(self, params: PrefixCostParams | None = None, metrics: RoutingMetrics | None = None) -> None:
        self.cost_params = params or PrefixCostParams()
        super().__init__(self.cost_params, metrics)
        self.history: dict[str, deque[Figures]] = {}  # by replica name: its scrapes within the window, oldest first

    def observe(self, replica: Candidate, stats: VLLMStats) -> deque[Figures]:
        """Record the replica's scrape (once per scrape) and drop those older than the window (the newest one
        older than it stays, as the window's start)."""
        kept = self.history.get(replica.name)
        if kept is None:
            kept = self.history[replica.name] = deque(maxlen=SNAPSHOTS)
        if not kept or stats.scraped_at > kept[-1].at:
            now = Figures(stats)
            if kept and now.restarted_since(kept[-1]):
                kept.clear()
            kept.append(now)
            while len(kept) > 2 and now.at - kept[1].at >= self.cost_params.window:
                kept.popleft()
        return kept

    def figures(self, replica: Candidate, stats: VLLMStats) -> tuple[float | None, float | None]:
        """(expected queue seconds, prefill tokens per second) on the replica from vLLM's own figures."""
        kept = self.observe(replica, stats)
        new, old = kept[-1], kept[0]
        queue: float | None = None
        if new.queue_n is not None and old.queue_n is not None and new.queue_n > old.queue_n:
            queue = _ratio((new.queue_s or 0.0) - (old.queue_s or 0.0), new.queue_n - old.queue_n)
        elif not stats.waiting:
            queue = 0.0  # nothing finished in the window and nothing waits: no queue
        else:
            queue = _ratio(new.queue_s, new.queue_n)
        rate: float | None = None
        if None not in (new.prefill_s, old.prefill_s, new.computed, old.computed) and new.prefill_n != old.prefill_n:
            rate = _ratio(new.computed - old.computed, new.prefill_s - old.prefill_s)  # type: ignore[operator]
        if not rate:
            rate = _ratio(new.computed, new.prefill_s)
        return queue, rate or None

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        blocks = self.blocks(request)
        seen = [stats.vllm(r) for r in candidates]
        for replica, vllm in zip(candidates, seen):
            self._observe(replica, vllm)
        matched = [self.matched(r, blocks) for r in candidates] if blocks else [0] * len(candidates)
        note.blocks = blocks
        figures = [None if s is None else self.figures(r, s) for r, s in zip(candidates, seen)]
        best, held = max(matched), min(matched)
        loads = [stats.load(r, s) for r, s in zip(candidates, seen)]
        if best > held:
            preferred = max(range(len(candidates)), key=lambda i: (matched[i], -loads[i]))
            if loads[preferred] > min(loads) and self.shared(self.lrus.get(candidates[preferred].name), blocks,
                                                             matched[preferred]):
                note.outcome = "shared"
                return [1.0] * len(candidates)
        costs = self.costs(request, figures, matched)
        if costs is None:
            note.outcome = "no_stats"
            if best == held:
                return [0.0] * len(candidates)
            return [(m - held) / (best - held) for m in matched]
        if best == held:
            note.outcome = "miss"
            cheapest = max(1e-3, min(costs))
            return [cheapest / max(1e-3, c) for c in costs]
        home = max(range(len(candidates)), key=lambda i: (matched[i], -costs[i]))
        chosen = min(range(len(candidates)), key=lambda i: (costs[i], -matched[i]))
        if costs[home] - costs[chosen] <= self.cost_params.margin:
            chosen = home
        note.outcome = "stay" if chosen == home else "move"
        return [1.0 if i == chosen else 0.0 for i in range(len(candidates))]

    def costs(self, request: RoutingRequest, figures: Sequence[tuple[float | None, float | None] | None],
              matched: list[int]) -> list[float] | None:
        """Seconds to the first token on each candidate, or None when vLLM's figures do not tell them all."""
        if any(f is None or f[0] is None for f in figures):
            return None
        rates = [f[1] for f in figures if f is not None and f[1]]
        if not rates:
            return None
        fallback = sum(rates) / len(rates)
        prompt = len(request.prompt.text) / CHARS_PER_TOKEN
        per_block = self.params.block_chars / CHARS_PER_TOKEN
        out = []
        for f, m in zip(figures, matched):
            queue, rate = f or (0.0, None)
            out.append((queue or 0.0) + max(0.0, prompt - m * per_block) / (rate or fallback))
        return out
