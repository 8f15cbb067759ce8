"""What each vLLM replica says about its own load, read from its Prometheus /metrics.

One `Scraper` polls every replica's /metrics on an interval, each scrape bounded in total time (`timeout`) and
size (`max_bytes`), so a replica that drips or floods its /metrics holds neither the loop nor memory. A failed or slow scrape
leaves the replica's last stats in place but lets them grow stale; routing treats stale stats as unknown, so a
replica that stops answering /metrics is routed by the gateway's own counts, never refused for it.

The text is parsed by prometheus_client's parser, fed only the families routing reads (vLLM's full exposition
is ~50 KB of histograms, and parsing all of it cost more than everything else the scrape does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from backends.http1 import Client, UpstreamError
from backends.replicas import Replica

log = logging.getLogger("gateway.vllm_stats")

RUNNING, WAITING, KV_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
PREFIX_HITS, PREFIX_QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"  # counters: _total samples
CACHE_CONFIG = "vllm:cache_config_info"
SUCCESS = "vllm:request_success"
FAMILIES = (RUNNING, WAITING, KV_USAGE, PREFIX_HITS, PREFIX_QUERIES, CACHE_CONFIG, SUCCESS)
# histograms read only as their _sum and _count (seconds in all, requests): vLLM's own queue and prefill time
QUEUE_TIME, PREFILL_TIME, TTFT = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                                  "vllm:time_to_first_token_seconds")
HISTOGRAMS = (QUEUE_TIME, PREFILL_TIME, TTFT)
_PREFIXES = (tuple(f"{name}{end}" for name in FAMILIES for end in ("{", " ", "_total{", "_total "))
             + tuple(f"{name}{end}" for name in HISTOGRAMS for end in ("_sum{", "_sum ", "_count{", "_count ")))
_META = tuple(f"# {kind} {name}{end}" for kind in ("HELP", "TYPE") for name in FAMILIES + HISTOGRAMS
              for end in (" ", "_total "))


@dataclass(slots=True)
class VLLMStats:
    """One scrape of one vLLM server, summed over its engines. None: the server did not report it."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    prefix_hits: float | None = None  # tokens served from the prefix cache, since the server started
    prefix_queries: float | None = None  # tokens looked up in it
    block_size: int | None = None  # tokens per KV block
    num_blocks: int | None = None  # KV blocks the server has
    requests_finished: float | None = None  # vllm:request_success_total over every finished_reason
    # since the server started, over the requests it finished: seconds waiting to be scheduled, in prefill, to
    # the first token (each histogram's _sum), and how many requests they count (its _count)
    queue_seconds: float | None = None
    queue_requests: float | None = None
    prefill_seconds: float | None = None
    prefill_requests: float | None = None
    ttft_seconds: float | None = None
    ttft_requests: float | None = None
    scraped_at: float = 0.0  # time.monotonic() of the scrape
    ended_before: int = 0  # the replica's `ended` when the scrape began: this gateway's requests over by then

    @property
    def load(self) -> float | None:
        """Requests the server holds, running or waiting: load from every client, not only this gateway."""
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)

    @property
    def cache_tokens(self) -> int | None:
        """How many tokens of KV cache the server has (its prefix cache can hold at most this many)."""
        if self.block_size is None or self.num_blocks is None:
            return None
        return self.block_size * self.num_blocks

    @property
    def prefix_hit_rate(self) -> float | None:
        if not self.prefix_queries:
            return None
        return (self.prefix_hits or 0.0) / self.prefix_queries


def relevant_lines(text: str) -> str:
    """Only the families in FAMILIES, with their HELP/TYPE lines, so the parser reads a few lines, not 50 KB."""
    return "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES) or line.startswith(_META))


def parse_metrics(text: str, scraped_at: float | None = None) -> VLLMStats:
    """VLLMStats from a Prometheus text exposition of a vLLM server (several engines are summed)."""
    stats = VLLMStats(scraped_at=time.monotonic() if scraped_at is None else scraped_at)
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(relevant_lines(text)):
        for sample in family.samples:  # keyed by sample name: exporters differ in how they TYPE counters
            name = sample.name.removesuffix("_total")
            if name == CACHE_CONFIG:
                stats.block_size = _int(sample.labels.get("block_size"), stats.block_size)
                blocks = _int(sample.labels.get("num_gpu_blocks"), None)
                if blocks is not None:
                    stats.num_blocks = (stats.num_blocks or 0) + blocks
            elif name in FAMILIES or name.endswith(("_sum", "_count")):
                sums[name] = sums.get(name, 0.0) + sample.value
    stats.running, stats.waiting, stats.kv_usage = sums.get(RUNNING), sums.get(WAITING), sums.get(KV_USAGE)
    stats.prefix_hits, stats.prefix_queries = sums.get(PREFIX_HITS), sums.get(PREFIX_QUERIES)
    stats.requests_finished = sums.get(SUCCESS)
    stats.queue_seconds, stats.queue_requests = sums.get(QUEUE_TIME + "_sum"), sums.get(QUEUE_TIME + "_count")
    stats.prefill_seconds, stats.prefill_requests = sums.get(PREFILL_TIME + "_sum"), sums.get(PREFILL_TIME + "_count")
    stats.ttft_seconds, stats.ttft_requests = sums.get(TTFT + "_sum"), sums.get(TTFT + "_count")
    if stats.kv_usage is not None:  # summed over engines; a fraction either way
        stats.kv_usage = min(1.0, max(0.0, stats.kv_usage))
    return stats


def _int(text: str | None, default: int | None) -> int | None:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


class Scraper:
    """Polls /metrics of every owned replica; `stats(replica)` is the latest, or None once older than
    `stale_after` seconds (or never scraped)."""

    def __init__(self, replicas: Callable[[], Iterable[Replica]], interval: float = 0.25, timeout: float = 1.0,
                 stale_after: float | None = None,
                 on_scrape: Callable[[Replica, VLLMStats | None, str | None], None] | None = None,
                 max_bytes: int = 4 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes  # one scrape's body: a larger one is dropped (routing.scrape.max_bytes)
        self.replicas = replicas
        self.interval = interval
        self.timeout = timeout
        self.stale_after = stale_after if stale_after is not None else max(1.0, 4 * interval)
        self.latest: dict[str, VLLMStats] = {}  # by replica name
        self.on_scrape = on_scrape or (lambda replica, stats, error: None)

    def stats(self, replica: Replica) -> VLLMStats | None:
        stats = self.latest.get(replica.name)
        if stats is None or time.monotonic() - stats.scraped_at > self.stale_after:
            return None
        return stats

    def age(self, replica: Replica) -> float | None:
        """Seconds since the replica's last good scrape; None when it never had one."""
        stats = self.latest.get(replica.name)
        return None if stats is None else time.monotonic() - stats.scraped_at

    async def scrape(self, client: Client, replica: Replica) -> VLLMStats | None:
        ended = replica.ended
        try:
            status, body = await client.get(f"{replica.url}/metrics", timeout=self.timeout, max_bytes=self.max_bytes,
                                            limit_name="routing.scrape.max_bytes")
            if status != 200:
                raise ValueError(f"/metrics returned {status}")
            stats = parse_metrics(body.decode("utf-8", "replace"))
        except (UpstreamError, ValueError) as exc:
            self.on_scrape(replica, None, str(exc))
            return None
        stats.ended_before = ended
        self.latest[replica.name] = stats
        self.on_scrape(replica, stats, None)
        return stats

    async def scrape_all(self, client: Client) -> None:
        owned = [r for r in self.replicas() if r.rented is None]
        await asyncio.gather(*(self.scrape(client, r) for r in owned))

    async def run(self, client: Client) -> None:
        while True:
            started = time.monotonic()
            await self.scrape_all(client)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
