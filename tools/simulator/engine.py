"""The continuous-batching latency model of one vLLM engine: pure asyncio, no HTTP.

One loop task runs steps while there is work and sleeps on an event when there is none. Each step admits
waiting requests (FIFO) into the running batch up to max_num_seqs, charges prefill for the prompt tokens it
admitted that the prefix cache does not hold, sleeps for the step's duration (see SimConfig) and then gives
every running sequence one token. Steps are scheduled against deadlines so event-loop jitter does not
accumulate into lost throughput.

Prompts arrive already "tokenized" (a list of strings or token ids; see protocol.tokenize). Output is a
deterministic function of prompt and seed: words from a small list, one token per word.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import random
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterable, Sequence

from .config import SimConfig
from .metrics import SimMetrics

WORDS = ("the", "model", "token", "batch", "cache", "request", "server", "answer", "quickly", "simple", "data",
         "prompt", "queue", "step", "gateway", "router", "latency", "stream", "window", "memory", "block",
         "prefix", "engine", "decode", "prefill", "of", "and", "to", "in", "is", "a", "we", "it", "that",
         "with", "for", "on", "as", "this", "each")

_ids = itertools.count(1)
logger = logging.getLogger(__name__)


class PrefixCache:
    """LRU set of full-block hashes, so a repeated prompt prefix skips prefill as in vLLM."""

    def __init__(self, capacity_blocks: int):
        self._capacity = max(1, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def clear(self) -> None:
        self._blocks.clear()

    def match_and_insert(self, hashes: Sequence[int]) -> int:
        """Return how many leading blocks were cached, then cache all of them, the last first: vLLM frees a
        request's blocks tail first, so when the cache is full a prefix loses its end and keeps its start."""
        hits = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hits += 1
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)
        return hits


class GenRequest:
    """One sequence in the engine. Iterate it for its text pieces; `finish_reason` is set when it ends."""

    def __init__(self, cfg: SimConfig, prompt: Sequence[str | int], max_tokens: int, ignore_eos: bool,
                 stop: Iterable[str], seed: int | None):
        self.request_id = next(_ids)
        self.prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.stop = tuple(s for s in stop if s)
        self.output_tokens = 0
        self.cached_tokens = 0
        self.text = ""
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.stop_reason: str | None = None  # the stop string that matched
        self.arrival = asyncio.get_running_loop().time()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._natural = cfg.natural_output_tokens
        self._block_hashes = self._hash_blocks(prompt, cfg.block_size)
        digest = hashlib.sha256(f"{cfg.seed}|{seed}|{prompt!r}".encode()).digest()
        self._rng = random.Random(int.from_bytes(digest[:8], "big"))
        # context_seeded: the prompt's text, from which (with the output so far) each word is drawn
        self._context = "".join(p for p in prompt if isinstance(p, str)) if cfg.context_seeded else None
        self._seed = f"{cfg.seed}|{seed}|"
        self._sentence_start = True
        self._pending: list[str] = []
        self._new = asyncio.Event()
        self._done = asyncio.Event()
        self._engine: Engine | None = None

    @staticmethod
    def _hash_blocks(prompt: Sequence[str | int], block_size: int) -> list[int]:
        hashes, h = [], 0
        for start in range(0, len(prompt) - block_size + 1, block_size):
            h = hash((h, tuple(prompt[start:start + block_size])))
            hashes.append(h)
        return hashes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def abort(self) -> None:
        """Leave the queue or the batch now; a no-op once finished."""
        if self._engine is not None:
            self._engine.abort(self)

    async def wait(self) -> None:
        await self._done.wait()

    async def batches(self) -> AsyncIterator[list[str]]:
        """Yield every piece produced since the last yield; one consumer only."""
        while True:
            if not self._pending and not self.finished:
                self._new.clear()
                await self._new.wait()
            batch, self._pending = self._pending, []
            if batch:
                yield batch
            if self.finished and not self._pending:
                return

    async def __aiter__(self) -> AsyncIterator[str]:
        async for batch in self.batches():
            for piece in batch:
                yield piece

    def _next_piece(self) -> str:
        if self._context is not None:
            return self._piece_of_context(self._context + self.text)
        word = self._rng.choice(WORDS)
        if self._sentence_start:
            word = word.capitalize()
        self._sentence_start = self._rng.random() < 0.12
        return ("" if self.output_tokens == 1 else " ") + word + ("." if self._sentence_start else "")

    def _piece_of_context(self, before: str) -> str:
        """The next word as a function of the text before it alone: capitalised at a line's or a sentence's
        start, a space before it unless it starts a line."""
        digest = hashlib.sha256(f"{self._seed}{before}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        word = rng.choice(WORDS)
        line_start = not before or before.endswith("\n")
        if line_start or before.endswith("."):
            word = word.capitalize()
        return ("" if line_start else " ") + word + ("." if rng.random() < 0.12 else "")

    def _produce(self) -> str | None:
        """Account one generated token, extend the text; return the finish reason if it ends here."""
        self.output_tokens += 1
        if not self.ignore_eos and self.output_tokens >= self._natural:
            self._push("")  # EOS: counted as a token, adds no text
            return "stop"
        piece = self._next_piece()
        if self.stop:
            text = self.text + piece
            start = max(0, len(self.text) - max(map(len, self.stop)) + 1)
            found = [(i, s) for s in self.stop if (i := text.find(s, start)) != -1]
            if found:
                idx, self.stop_reason = min(found)
                self._push(text[len(self.text):idx] if idx >= len(self.text) else "")
                self.text = text[:idx]
                return "stop"
        self.text += piece
        self._push(piece)
        return "length" if self.output_tokens >= self.max_tokens else None

    def _push(self, piece: str) -> None:
        self._pending.append(piece)
        self._new.set()

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._new.set()
        self._done.set()


class Engine:
    """Schedules GenRequests in continuous batches and records vLLM-style metrics."""

    def __init__(self, cfg: SimConfig, metrics: SimMetrics | None = None):
        self.cfg = cfg
        self.metrics = metrics if metrics is not None else SimMetrics(cfg)
        self.metrics.bind_gauges(lambda: len(self._running), self.waiting_gauge, self.kv_cache_usage)
        self._waiting: deque[GenRequest] = deque()
        self._waiting_scheduled = 0  # left waiting by the last schedule step
        self._running: list[GenRequest] = []
        self._prefix = PrefixCache(cfg.kv_cache_tokens // cfg.block_size)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting_gauge(self) -> int:
        """vLLM's num_requests_waiting: what the last schedule step could not admit (vLLM records its stats after
        scheduling, so a request that arrived mid-step and is admitted at the next one never shows; counting it
        made a closed loop below the batch cap look queued)."""
        return min(self._waiting_scheduled, len(self._waiting))

    def kv_cache_usage(self) -> float:
        used = sum(r.prompt_tokens + r.output_tokens for r in self._running)
        return min(1.0, used / self.cfg.kv_cache_tokens)

    def start(self) -> None:
        """Start the loop in the running event loop; idempotent."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="simulator-engine")

    async def stop(self) -> None:
        """Stop the loop and abort whatever is still queued or running."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for req in [*self._waiting, *self._running]:
            self.abort(req)

    def submit(self, prompt: Sequence[str | int], max_tokens: int, *, ignore_eos: bool = False,
               stop: Iterable[str] = (), seed: int | None = None) -> GenRequest:
        """Queue a request; the caller validated lengths (prompt + max_tokens <= max_model_len)."""
        if max_tokens < 1 or not prompt:
            raise ValueError("a request needs a prompt and max_tokens >= 1")
        self.start()
        req = GenRequest(self.cfg, prompt, max_tokens, ignore_eos, stop, seed)
        req._engine = self
        self._waiting.append(req)
        assert self._wake is not None  # made by start()
        self._wake.set()
        return req

    def abort(self, req: GenRequest) -> None:
        if req.finished:
            return
        if req in self._running:
            self._running.remove(req)
        else:
            try:
                self._waiting.remove(req)
            except ValueError:
                pass
        self._finish(req, "abort", asyncio.get_running_loop().time())

    async def _loop(self) -> None:
        try:
            await self._run_steps()
        except Exception:
            # A bug must not leave callers waiting forever: fail what is in flight, as vLLM's engine would.
            logger.exception("simulated engine failed")
            for req in [*self._waiting, *self._running]:
                self._finish(req, "error", asyncio.get_running_loop().time())
            self._waiting.clear()
            self._running.clear()

    async def _run_steps(self) -> None:
        loop = asyncio.get_running_loop()
        prev_end: float | None = None
        while True:
            if not self._waiting and not self._running:
                self._waiting_scheduled = 0
                wake = self._wake
                assert wake is not None  # made by start() before it started this loop
                wake.clear()
                await wake.wait()
                prev_end = None
                continue
            now = loop.time()
            admitted = self._admit(now)
            self._waiting_scheduled = len(self._waiting)
            step_s = self._step_seconds(admitted)
            # Continue from the previous deadline unless we fell behind by a whole step (then restart).
            start = prev_end if prev_end is not None and now - prev_end < step_s else now
            prev_end = start + step_s
            await asyncio.sleep(max(0.0, prev_end - loop.time()))
            self.steps += 1
            self._decode(loop.time())

    def _step_seconds(self, admitted: list[GenRequest]) -> float:
        cfg = self.cfg
        ms = cfg.step_base_ms + cfg.step_ms_per_seq * len(self._running)
        if admitted:
            uncached = sum(r.prompt_tokens - r.cached_tokens for r in admitted)
            ms += cfg.prefill_base_ms + cfg.prefill_ms_per_token * uncached
        return ms / 1000.0

    def _admit(self, now: float) -> list[GenRequest]:
        cfg, admitted = self.cfg, []
        used = sum(r.prompt_tokens + r.output_tokens for r in self._running)
        while self._waiting and len(self._running) < cfg.max_num_seqs:
            req = self._waiting[0]
            if self._running and used + req.prompt_tokens > cfg.kv_cache_tokens:
                break  # no free KV blocks: the head of the queue waits (and so does everyone behind it)
            self._waiting.popleft()
            req.admitted_at = now
            if cfg.enable_prefix_caching:
                hit_tokens = self._prefix.match_and_insert(req._block_hashes) * cfg.block_size
                req.cached_tokens = min(hit_tokens, req.prompt_tokens - 1)  # the last token is always computed
                self.metrics.prefix_queries.inc(req.prompt_tokens)
                self.metrics.prefix_hits.inc(req.cached_tokens)
            self.metrics.prompt_tokens.inc(req.prompt_tokens)
            self.metrics.queue_time.observe(now - req.arrival)
            used += req.prompt_tokens
            self._running.append(req)
            admitted.append(req)
        return admitted

    def _decode(self, now: float) -> None:
        if self._running:
            self.metrics.generation_tokens.inc(len(self._running))
        for req in list(self._running):
            if req.first_token_at is None:
                req.first_token_at = now
                self.metrics.ttft.observe(now - req.arrival)
            else:
                assert req.last_token_at is not None  # set with its first token
                self.metrics.itl.observe(now - req.last_token_at)
            req.last_token_at = now
            reason = req._produce()
            if reason is not None:
                self._running.remove(req)
                self._finish(req, reason, now)

    def _finish(self, req: GenRequest, reason: str, now: float) -> None:
        req._finish(reason)
        self.metrics.finished(reason)
        self.metrics.e2e.observe(now - req.arrival)
