"""Send a request where its prompt's longest prefix most likely sits in vLLM's prefix cache.

The approximate scheme the peers use (llm-d's approximate prefix scorer, production-stack's prefixaware): the
prompt text (prompt.py) is cut into blocks of `block_chars` characters (~16 tokens at 4 characters a token)
and each block's hash is chained to the previous one's, so a block hash stands for the whole prefix up to it.
Each replica keeps a bounded LRU of the block hashes this gateway sent it; a candidate's score is its number
of blocks matched from the start relative to the best candidate's (the best match scores 1, so with its
default weight the match decides unless the load guard trips; when nothing matches, load decides). The LRU holds `lru_blocks` blocks, or, once vLLM
reports its KV cache size (vllm:cache_config_info), as many blocks as that cache holds tokens: a replica
cannot keep more prefix than its cache has room for. A replica whose vLLM restarted (its finished-request count
went down) starts over with an empty LRU, as its prefix cache did.

Load guard: affinity alone piles one hot prefix onto one replica. When the best-matching candidate holds at
least `imbalance` more requests than the least loaded one (running + waiting from vLLM, or this gateway's own
in-flight count, whichever is higher), the scorer scores by load instead, so the request goes where there is
room and the prefix is learned there too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pydantic import Field

from policies.pipeline import Call
from policies.routing.base import Candidate, Stats, relative_load
from policies.routing.base import Params as BaseParams
from policies.routing.prompt import prompt_text

CHARS_PER_TOKEN = 4


class Params(BaseParams):
    block_chars: int = Field(64, ge=4, le=4096)  # characters per hashed block (~16 tokens)
    max_blocks: int = Field(4096, ge=1, le=1_000_000)  # blocks hashed per request (longer prompts: the start)
    lru_blocks: int = Field(65536, ge=16, le=100_000_000)  # per replica, until vLLM reports its cache size
    imbalance: float = Field(8, ge=0)  # requests more than the least loaded candidate that trip the guard


class PrefixAffinity:
    name = "prefix-affinity"
    Params = Params

    def __init__(self, params: Params | None = None, metrics=None) -> None:
        self.params = params or Params()
        self.metrics = metrics  # RoutingMetrics or None
        self.lrus: dict[str, OrderedDict[int, None]] = {}  # by replica name: survives a reload of the policy
        self.outcome: str | None = None
        self._last: tuple[Call | None, list[int], list[int]] = (None, [], [])  # (call, blocks, matched per cand.)
        self._capacity: dict[str, int] = {}
        self._finished: dict[str, float] = {}  # by replica name: vLLM's finished-request count, last seen

    def blocks(self, call: Call) -> list[int]:
        text = prompt_text(call.endpoint, call.body)
        size = self.params.block_chars
        if len(text) < size:
            return []
        full = min(len(text) // size, self.params.max_blocks)
        h = hash(call.model)
        out = []
        for start in range(0, full * size, size):
            h = hash((h, text[start:start + size]))
            out.append(h)
        return out

    def matched(self, replica: Candidate, blocks: list[int]) -> int:
        lru = self.lrus.get(replica.name)
        if not lru:
            return 0
        n = 0
        for h in blocks:
            if h not in lru:
                break
            n += 1
        return n

    def score(self, call: Call, candidates: Sequence[Candidate], stats: Stats) -> list[float]:
        blocks = self.blocks(call)
        if not blocks:  # (what vLLM reports is looked at by the next call that has a prefix: nothing is lost)
            self.outcome = "no_prompt"
            self._last = (call, blocks, [0] * len(candidates))
            return [0.0] * len(candidates)
        for replica in candidates:
            self._observe(replica, stats)
        matched = [self.matched(r, blocks) for r in candidates]
        self._last = (call, blocks, matched)
        if max(matched) == 0:
            self.outcome = "miss"
            return [0.0] * len(candidates)
        scores, self.outcome = guarded(matched, [stats.load(r) for r in candidates], self.params.imbalance)
        return scores

    def picked(self, call: Call, replica: Candidate) -> None:
        last_call, blocks, _ = self._last
        if last_call is not call:  # picked without scoring (a single candidate)
            blocks = self.blocks(call)
        self._last = (None, [], [])
        if not blocks:
            return
        if self.metrics is not None:
            matched = self.matched(replica, blocks)
            self.metrics.prefix_match(call.model, matched * self.params.block_chars, matched / len(blocks))
        lru = self.lrus.get(replica.name)
        if lru is None:
            lru = self.lrus[replica.name] = OrderedDict()
        # Tail first, so a prompt's leading blocks are its most recent: eviction then cuts a prefix from its end,
        # as vLLM's cache does (it frees a request's blocks tail first), and the rest still matches. In order,
        # a full LRU dropped the first block and with it the whole match, while vLLM still held the prefix.
        for h in reversed(blocks):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        capacity = self._capacity.get(replica.name, self.params.lru_blocks)
        while len(lru) > capacity:
            lru.popitem(last=False)

    def _observe(self, replica: Candidate, stats: Stats) -> None:
        """Fit the replica's LRU to its cache size, and forget it when its vLLM restarted: a new server's
        prefix cache is empty (its counters starting over say so)."""
        vllm = stats.vllm(replica)
        if vllm is None:
            return
        finished = vllm.requests_finished
        if finished is not None:
            if finished < self._finished.get(replica.name, 0.0):
                self.lrus.pop(replica.name, None)
            self._finished[replica.name] = finished
        tokens = vllm.cache_tokens
        if tokens:
            self._capacity[replica.name] = max(16, tokens * CHARS_PER_TOKEN // self.params.block_chars)


def guarded(matched: list[int], loads: list[float], imbalance: float) -> tuple[list[float], str]:
    """(scores, outcome) for candidates that hold `matched` leading blocks (at least one does): relative to the
    best match, or by load when the preferred candidate holds `imbalance` requests more than the least loaded."""
    best = max(matched)
    preferred = max(range(len(matched)), key=lambda i: (matched[i], -loads[i]))
    if loads[preferred] - min(loads) >= imbalance:
        return relative_load(loads), "load_guard"
    return [m / best for m in matched], "hit"
