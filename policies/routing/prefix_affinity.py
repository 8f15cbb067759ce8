"""Send a request where its prompt's longest prefix most likely sits in vLLM's prefix cache.

The approximate scheme the peers use (llm-d's approximate prefix scorer, production-stack's prefixaware): the
prompt text (prompt.py) is cut into blocks of `block_chars` characters (~16 tokens at 4 characters a token)
and each block's hash is chained to the previous one's, so a block hash stands for the whole prefix up to it.
Each replica keeps a bounded LRU of the block hashes this gateway sent it; a candidate's score is its number
of blocks matched from the start beyond what every candidate matches, relative to the best candidate's (the
best match scores 1, one holding only what all hold 0, so with its default weight the match decides unless the
load guard trips; when nothing matches, or all match alike, load decides). The LRU holds `lru_blocks` blocks,
or, once vLLM reports its KV cache size (vllm:cache_config_info), as many blocks as that cache holds tokens: a
replica cannot keep more prefix than its cache has room for. A replica whose vLLM restarted (its
finished-request count went down) starts over with an empty LRU, as its prefix cache did.

Opt-in (`evicted`, e.g. 0.125; 0 by default): what the LRU evicts it keeps a while longer, in a second LRU per
replica of `evicted` times its size. It is read only when no candidate's LRU matches the prompt at all, where
load alone would decide: a candidate whose evicted blocks match the prompt's start is where this conversation last went (outcome `evicted`), and
it is preferred as a match is, the load guard included, which counts the whole prompt as uncached everywhere:
it stays unless vLLM queues there more than elsewhere. The record is an estimate that forgets sooner than
vLLM does (it assumes 4 characters a token, ~4.2 on a Qwen3 tokenizer, and does not see the replies vLLM also
caches); a conversation it forgot but vLLM still partly holds would otherwise go by load and recompute its whole
prefix elsewhere (5-6% of later turns under cache pressure on an H100, docs/benchmarks.md), while the ceiling
(every turn to one server) kept hitting its older blocks. Staying where the prefix was costs no more prefill if
vLLM dropped all of it too: a full miss costs the same anywhere. The evicted match does not count as cached
for the prefill-order estimate (`uncached` is the whole prompt), only as where to go. It is off by default
because it also gives up load balance for those prompts: on simulated servers under cache pressure (whose
prefix cache is exactly the size the record assumes, so each such prompt was a full miss there) it piled load
on one replica and its TTFT got it ejected in 7 of 14 runs, against 3 of 14 without; whether vLLM's larger
holding pays for that on a GPU is for a GPU run to say (tests/benchmarks/routing.py profile `evicted`).

Load guard: the match decides unless there is evidence that following it costs more than a miss elsewhere. It
has no threshold to tune per GPU: each rule compares like with like, or reads vLLM's own signal of trouble.
The preferred replica is the best match (the least loaded among equals). It loses the request when
- it queues (outcome `guard_queue`): its vLLM reports requests waiting (not yet running: the batch is full), and
  the prefill work ahead of this request there (waiting requests x that server's mean uncached prompt tokens
  per request, from its prefix-cache counters) plus this prompt's unmatched part exceeds another candidate's
  queued work plus what it would have to recompute there. Both sides are tokens to prefill on servers of the
  same model, so the prefill rate cancels out. Many running requests are not queueing: a GPU batches them.
  Candidates then score by that estimate (the cheapest 1).
- its KV cache is full (`guard_kv`): vLLM reports at least 95% in use (it preempts running requests when it
  runs out) while another candidate has room. Full candidates score 0, the others by their match.
- the match is a shared prefix (`guard_shared`): the last matched block has been continued in more than one
  way (one system prompt under many conversations), or the whole prompt was sent before (a repeated prompt),
  and another candidate holds less load. Copying a shared
  prefix to a second replica costs one miss that every later request sharing it saves again, so it goes by load,
  and once both hold it the tie goes by load anyway. A conversation's own history is never shared: its later
  turns stay put, however uneven the load, unless the replica queues.
- optionally (`imbalance`, off by default): it holds at least that many requests more than the least loaded
  candidate (the old fixed-difference guard; on a GPU running 100+ requests a difference of 8 is noise).
`guard: false` turns every rule off (the match alone decides: a baseline to measure the guard against).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from pydantic import Field

from backends.vllm_stats import VLLMStats
from policies.routing.base import Candidate, Note, RoutingMetrics, Stats
from policies.routing.prefix_guard import GuardParams, prefix_scores
from policies.routing.request import RoutingRequest

CHARS_PER_TOKEN = 4


SHARED = object()  # an LRU block's mark: prompts continued it in more than one way


class PrefixAffinityParams(GuardParams):
    block_chars: int = Field(64, ge=4, le=4096)  # characters per hashed block (~16 tokens)
    max_blocks: int = Field(4096, ge=1, le=1_000_000)  # blocks hashed per request (longer prompts: the start)
    lru_blocks: int = Field(65536, ge=16, le=100_000_000)  # per replica, until vLLM reports its cache size
    # what the LRU evicts is kept a while, as this share of its size (0, the default: not at all; a full miss
    # everywhere goes by load): the record forgets ~6% sooner than vLLM (4 characters a token against ~4.2;
    # replies unseen), so what it evicted last is what vLLM may still hold; 0.125 keeps twice that margin
    evicted: float = Field(0.0, ge=0, le=1)


class PrefixAffinity:
    name = "prefix-affinity"
    Params = PrefixAffinityParams
    learns = True

    def __init__(self, params: PrefixAffinityParams | None = None, metrics: RoutingMetrics | None = None) -> None:
        self.params = params or PrefixAffinityParams()
        self.metrics = metrics  # GatewayMetrics or None
        # by replica name (they survive a reload of the policy): block hash -> its mark (None: no continuation
        # seen yet; a hash: the one continuation seen; SHARED), least recent first
        self.lrus: dict[str, OrderedDict[int, object]] = {}
        self.evicted: dict[str, OrderedDict[int, None]] = {}  # by replica name: what its LRU let go, least recent first
        self._capacity: dict[str, int] = {}
        self._finished: dict[str, float] = {}  # by replica name: vLLM's finished-request count, last seen

    def blocks(self, request: RoutingRequest) -> list[int]:
        text = request.prompt.text
        size = self.params.block_chars
        if len(text) < size:
            return []
        full = min(len(text) // size, self.params.max_blocks)
        h = hash(request.model)
        out = []
        for start in range(0, full * size, size):
            h = hash((h, text[start:start + size]))
            out.append(h)
        return out

    def matched(self, replica: Candidate, blocks: list[int]) -> int:
        return leading(self.lrus.get(replica.name), blocks)

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        blocks = self.blocks(request)
        if not blocks:  # (what vLLM reports is looked at by the next call that has a prefix: nothing is lost)
            note.outcome = "no_prompt"
            note.blocks = blocks
            return [0.0] * len(candidates)
        seen = [stats.vllm(r) for r in candidates]
        for replica, vllm in zip(candidates, seen):
            self._observe(replica, vllm)
        matched = [self.matched(r, blocks) for r in candidates]
        note.blocks = blocks
        per_token = self.params.block_chars / CHARS_PER_TOKEN

        def shared(i: int) -> bool:
            return self.shared(self.lrus.get(candidates[i].name), blocks, matched[i])

        loads = [stats.load(r, s) for r, s in zip(candidates, seen)]
        if not any(matched) and self.params.evicted and self.evicted:  # forgotten everywhere: where did it go?
            faded = [leading(self.evicted.get(r.name), blocks) for r in candidates]
            if any(faded):  # a preference only: the load guard counts the whole prompt as uncached (block 0)
                scores = prefix_scores(self.params, seen, loads, faded, len(blocks) * per_token, 0.0,
                                       lambda i: False, note)
                if note.outcome == "hit":
                    note.outcome = "evicted"
                return scores
        return prefix_scores(self.params, seen, loads, matched, len(blocks) * per_token, per_token, shared, note)

    @staticmethod
    def shared(lru: OrderedDict[int, object] | None, blocks: list[int], matched: int) -> bool:
        """The match is the whole prompt (sent before) or ends in a block continued in more than one way."""
        return matched == len(blocks) or (lru is not None and lru.get(blocks[matched - 1]) is SHARED)

    def picked(self, request: RoutingRequest, replica: Candidate, note: Note) -> None:
        blocks = note.blocks if note.blocks is not None else self.blocks(request)  # none: a single candidate
        if not blocks:
            return
        matched = self.matched(replica, blocks)
        if self.metrics is not None:
            self.metrics.prefix_match(request.model, matched * self.params.block_chars, matched / len(blocks))
        note.uncached = max(0, len(request.prompt.text) - matched * self.params.block_chars) / CHARS_PER_TOKEN
        lru = self.lrus.get(replica.name)
        if lru is None:
            lru = self.lrus[replica.name] = OrderedDict()
        # Tail first, so a prompt's leading blocks are its most recent: eviction then cuts a prefix from its end,
        # as vLLM's cache does (it frees a request's blocks tail first), and the rest still matches. In order,
        # a full LRU dropped the first block and with it the whole match, while vLLM still held the prefix.
        # Each block is marked with its continuation in this prompt: a second, different one marks it SHARED.
        child = None
        move = lru.move_to_end
        for h in reversed(blocks):
            mark = lru.get(h, lru)  # (the LRU itself stands for "absent")
            if mark is lru:
                lru[h] = child
            else:
                move(h)
                if mark != child and child is not None and mark is not SHARED:
                    lru[h] = child if mark is None else SHARED
            child = h
        capacity = self._capacity.get(replica.name, self.params.lru_blocks)
        if len(lru) <= capacity:
            return
        kept = int(capacity * self.params.evicted)
        evicted = self.evicted.setdefault(replica.name, OrderedDict()) if kept else None
        while len(lru) > capacity:
            h = lru.popitem(last=False)[0]
            if evicted is not None:
                evicted[h] = None
                evicted.move_to_end(h)
        while evicted is not None and len(evicted) > kept:
            evicted.popitem(last=False)

    def _observe(self, replica: Candidate, vllm: VLLMStats | None) -> None:
        """Fit the replica's LRU to its cache size, and forget it when its vLLM restarted: a new server's
        prefix cache is empty (its counters starting over say so)."""
        if vllm is None:
            return
        finished = vllm.requests_finished
        if finished is not None:
            if finished < self._finished.get(replica.name, 0.0):
                self.lrus.pop(replica.name, None)
                self.evicted.pop(replica.name, None)
            self._finished[replica.name] = finished
        tokens = vllm.cache_tokens
        if tokens:
            self._capacity[replica.name] = max(16, tokens * CHARS_PER_TOKEN // self.params.block_chars)


def leading(record: Collection[int] | None, blocks: list[int]) -> int:
    """How many of the prompt's blocks, from its start, the record holds."""
    if not record:
        return 0
    n = 0
    for h in blocks:
        if h not in record:
            break
        n += 1
    return n
