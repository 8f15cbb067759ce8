"""The prefix scorers' shared decision once blocks are matched: the load guard, then scores by the match.

prefix-affinity (its own approximate record of what it sent) and precise-prefix (vLLM's KV cache events) differ
only in how they count a candidate's matched leading blocks and how they tell a shared prefix; what they do
with the count is the same, and so is the load guard (its rules are in prefix_affinity.py's docstring): the
preferred replica (the best match, the least loaded among equals) loses the request when it queues
(`guard_queue`), its KV cache is full (`guard_kv`), the match is a shared prefix and another candidate holds
less load (`guard_shared`), or, opt-in, it holds `imbalance` requests more than the least loaded (`load_guard`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import Field

from backends.vllm_stats import VLLMStats
from policies.routing.base import Note, relative_load
from policies.routing.base import Params as BaseParams

KV_FULL = 0.95  # vLLM's KV cache this full preempts soon (the kv-headroom filter's default)


class GuardParams(BaseParams):
    guard: bool = True  # false: the match alone decides (a baseline for benchmarks; a hot prefix piles up)
    imbalance: float | None = Field(None, ge=1)  # opt-in: requests more than the least loaded that also trip it


def prefix_scores(params: GuardParams, seen: Sequence[VLLMStats | None], loads: list[float],
                  matched: Sequence[float], prompt: float, block: float, shared: Callable[[int], bool],
                  note: Note) -> list[float]:
    """Scores for candidates holding `matched` leading blocks (or what they weigh) of a `prompt` of that many
    tokens (`block` tokens a block), given what vLLM reports of each (`seen`) and their load. shared(i):
    candidate i's match ends in a prefix that prompts continued in more than one way (or is the whole prompt,
    sent before)."""
    best = max(matched)
    if best == 0:
        note.outcome = "miss"
        return [0.0] * len(matched)
    preferred = max(range(len(matched)), key=lambda i: (matched[i], -loads[i]))
    if params.guard:
        guarded = load_guard(params, seen, loads, matched, prompt, block, preferred, shared, note)
        if guarded is not None:
            return guarded
    note.outcome = "hit"
    held = min(matched)  # what every candidate holds (a shared prefix copied everywhere) decides nothing
    if held == best:
        return [1.0] * len(matched)
    return [(m - held) / (best - held) for m in matched]


def load_guard(params: GuardParams, seen: Sequence[VLLMStats | None], loads: list[float], matched: Sequence[float],
               prompt: float, block: float, p: int, shared: Callable[[int], bool], note: Note) -> list[float] | None:
    """The scores when the load guard trips for the preferred candidate `p`, else None."""
    others = [i for i in range(len(matched)) if i != p]
    preferred = seen[p]
    if preferred is not None and preferred.waiting:
        costs = [queued(s, prompt) + prompt - m * block for s, m in zip(seen, matched)]
        if costs[p] > min(costs[i] for i in others):
            note.outcome = "guard_queue"
            cheapest = max(1.0, min(costs))
            return [cheapest / max(1.0, c) for c in costs]
    kv = [None if s is None else s.kv_usage for s in seen]
    full = kv[p]
    if full is not None and full >= KV_FULL and any(u is None or u < KV_FULL for i, u in enumerate(kv) if i != p):
        note.outcome = "guard_kv"
        best = max(m for m, u in zip(matched, kv) if u is None or u < KV_FULL) or 1
        return [0.0 if u is not None and u >= KV_FULL else m / best for m, u in zip(matched, kv)]
    least = min(loads)
    if loads[p] > least:
        if shared(p):
            note.outcome = "guard_shared"
            return relative_load(loads)
        if params.imbalance is not None and loads[p] - least >= params.imbalance:
            note.outcome = "load_guard"
            return relative_load(loads)
    return None


def queued(vllm: VLLMStats | None, prompt: float) -> float:
    """Tokens of prefill waiting ahead on a replica: its waiting requests x its mean uncached prompt tokens per
    finished request (vLLM's counters since it started), or x this prompt's when it has none yet."""
    if vllm is None or not vllm.waiting:
        return 0.0
    per_request = prompt
    if vllm.requests_finished and vllm.prefix_queries is not None:
        per_request = max(0.0, vllm.prefix_queries - (vllm.prefix_hits or 0.0)) / vllm.requests_finished
    return vllm.waiting * per_request
