"""Measure one backend at several concurrency levels, closed loop: the data the knee is found in.

At level c, c workers each send the next request as soon as their previous one ends, so exactly c requests
are in flight all the time (the way a gateway cap would hold it). Each level has a warm-up that is not
measured: `warmup` seconds and, on top, until every worker has finished one request (bounded by the request
timeout), so the queue has reached its steady state before the window opens. Then a window of `duration`
seconds, or until `requests` requests have completed. With `min_requests`, a `duration` window stays open
past its seconds until at least that many requests completed in it: a slow or busy server then takes longer
instead of yielding a window with no latency figures in it (a fixed window on a server that finishes a request
every few seconds may see none). When the window closes, requests still in flight are cancelled (the server
aborts them), so the load stays at c for the whole window and never drains into it.

Output tokens/s counts the output chunks that arrived inside the window, from every request including those
cut off at its ends, times the level's tokens per chunk (usage.completion_tokens over chunks; 1 on vLLM).
Counting completed requests instead would be quantized: in a closed loop at or below the batch cap the
requests run in lockstep and finish in bursts, so a short window sees whole bursts or none. Requests/s is
that token rate over the output length (every request has the same length). TTFT and inter-chunk gaps are
percentiles over the requests that completed inside the window. Errors count every failed request of the
level, warm-up included. vLLM's running/waiting/KV-cache gauges are scraped from /metrics
about every `metrics_interval` seconds (jittered) during the window: 0.2 s by default, ~50 samples in a 10 s
window, since the knee refuses a level by vLLM's mean waiting and ~10 samples a level let that mean swing
(5.45-8.0 across runs of one level on a CPU vLLM). The waiting gauge's spread (`waiting_stdev`) is recorded
beside its mean.

The client must never be what limits the level. A level of more than `per_process` streams is spread over
client processes (spread.py); every level records the client's own time-mean of requests in flight during the
window (`in_flight_mean`) beside vLLM's running and waiting means, and the report warns when either strays
more than 10% from the level. Token timing is taken per chunk as it is read; `tpot` (a request's last output
chunk minus its first, over its chunks - 1) is the inter-token figure that stays honest when a busy client
reads several chunks at once (the per-gap ITL then shows 0 ms gaps).

Every wait is bounded: a request by `request_timeout`, a warm-up by warmup + request_timeout, a window by
`duration` (or `max_level_time` with `requests` or `min_requests`), the whole sweep by `max_time`. A level whose
window closed on `max_level_time` before its requests completed is marked `complete=False`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

import httpx

from .client import GAUGES, Sample, chat_body, scrape_gauges, stream_chat
from .prompts import PromptMaker

ERROR_PAUSE = 0.1  # a worker whose request failed waits this long, so a dead server is not hammered


class SweepError(Exception):
    """The backend cannot be measured at all (unreachable, wrong model, refuses the request shape)."""


@dataclass(frozen=True)
class SweepSpec:
    url: str
    model: str
    levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prompt_tokens: int = 256
    output_tokens: int = 64
    duration: float | None = 10.0  # seconds measured per level, unless `requests` is set
    requests: int | None = None  # completed requests measured per level
    min_requests: int | None = None  # with `duration`: keep the window open until this many completed
    warmup: float = 2.0
    api_key: str | None = None
    request_timeout: float = 60.0
    max_level_time: float = 300.0  # with `requests` or `min_requests`: the longest a level's window may take
    max_time: float = 3600.0  # the whole sweep
    metrics_interval: float = 0.2  # seconds between scrapes of vLLM's gauges (jittered x0.5-1.5)
    stop_on_errors: bool = True  # higher levels cannot be recommended once a level fails
    seed: int = 0
    per_process: int = 64  # streams one client process drives; a level above it spreads over processes
    max_processes: int | None = None  # at most this many client processes (default: the CPU count)

    def __post_init__(self) -> None:
        if not self.levels or any(c < 1 for c in self.levels):
            raise ValueError("levels must be positive integers")
        if (self.duration is None) == (self.requests is None):
            raise ValueError("set exactly one of duration and requests")
        if self.duration is not None and self.duration <= 0 or self.requests is not None and self.requests < 1:
            raise ValueError("duration and requests must be positive")
        if self.min_requests is not None and (self.duration is None or self.min_requests < 1):
            raise ValueError("min_requests must be positive and goes with duration")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prompt and output tokens must be positive")
        if self.per_process < 1 or self.max_processes is not None and self.max_processes < 1:
            raise ValueError("per_process and max_processes must be positive")
        if (self.warmup < 0 or self.request_timeout <= 0 or self.max_time <= 0 or self.metrics_interval <= 0
                or self.max_level_time <= 0):
            raise ValueError("times must be positive")

    def processes(self, concurrency: int) -> int:
        """Client processes for a level: one per `per_process` streams, at most `max_processes`."""
        most = self.max_processes or os.cpu_count() or 1
        return max(1, min(most, math.ceil(concurrency / self.per_process), concurrency))

    def public(self) -> dict[str, Any]:
        """The inputs as the report records them: never the API key, nor credentials in the URL."""
        out = asdict(self)
        out["api_key"] = "(given)" if self.api_key else None
        parts = urlsplit(self.url)
        out["url"] = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        out["levels"] = list(self.levels)
        return out


@dataclass
class LevelResult:
    concurrency: int
    window_s: float
    requests: int  # completed inside the window (the latency figures are theirs)
    errors: int  # failed requests of the whole level, warm-up included
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    prompt_tokens_mean: float | None
    running_mean: float | None = None
    running_max: float | None = None
    waiting_mean: float | None = None
    waiting_max: float | None = None
    waiting_stdev: float | None = None  # spread of the samples behind waiting_mean (population stdev)
    kv_cache_mean: float | None = None  # fraction, 1.0 = full
    kv_cache_max: float | None = None
    gauge_samples: int = 0
    complete: bool = True  # False: the window closed on a time limit before `requests` completed
    error_examples: list[str] = field(default_factory=list)
    # per request (last output chunk - first) / (chunks - 1): unlike ITL it does not read 0 when a busy client
    # takes several chunks in one read
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    in_flight_mean: float | None = None  # requests the client really held open during the window (time mean)
    processes: int = 1  # client processes the level's streams were spread over


@dataclass
class SweepResult:
    spec: SweepSpec
    prompt_words: int
    levels: list[LevelResult]
    stopped: str | None  # why the sweep ended before its last level
    started_at: float
    finished_at: float


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


class Progress:
    """A one-line live status on a terminal (`\\r`, rewritten); on a pipe, one line per finished level."""

    def __init__(self, stream: TextIO | None = None, live: bool | None = None):
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self._width = 0

    def update(self, line: str) -> None:
        if self.live:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
            self.stream.flush()

    def done(self, line: str) -> None:
        self.stream.write(("\r" + line.ljust(self._width) if self.live else line) + "\n")
        self._width = 0
        self.stream.flush()


class _Level:
    """The shared state of one level's workers."""

    def __init__(self, spec: SweepSpec, concurrency: int):
        self.spec, self.concurrency = spec, concurrency
        self.t0: float | None = None  # the window opened
        self.t1: float | None = None  # the window closed (set early when `requests` completed)
        self.closed = False
        self.measured: list[Sample] = []
        self.window_chunks = 0  # output chunks that arrived inside the window
        self.ok_tokens = self.ok_chunks = 0  # over every successful request of the level
        self.errors = 0
        self.examples: list[str] = []
        self.finished_once: set[int] = set()
        self.all_once = asyncio.Event()
        self.enough = asyncio.Event()
        self.gauges: list[dict[str, float]] = []
        self.in_flight = 0  # requests open right now, and their integral over time (request-seconds)
        self.area = 0.0
        self.area_at = time.perf_counter()
        self.window_area: list[float] = []  # the integral when the window opened, then when it closed
        self.processes = 1

    def _integrate(self, now: float) -> None:
        if now > self.area_at:
            self.area += self.in_flight * (now - self.area_at)
            self.area_at = now

    def sent(self) -> None:
        self._integrate(time.perf_counter())
        self.in_flight += 1

    def returned(self) -> None:
        self._integrate(time.perf_counter())
        self.in_flight -= 1

    def open(self, t0: float) -> None:
        self._integrate(t0)
        self.t0 = t0
        self.window_area = [self.area]

    def close(self, t1: float) -> None:
        self._integrate(t1)
        self.t1 = t1
        self.window_area.append(self.area)

    def in_flight_mean(self) -> float | None:
        if len(self.window_area) < 2 or self.t0 is None or self.t1 is None or self.t1 <= self.t0:
            return None
        return (self.window_area[1] - self.window_area[0]) / (self.t1 - self.t0)

    def add(self, worker: int, sample: Sample) -> None:
        if self.closed:
            return
        self.finished_once.add(worker)
        if len(self.finished_once) == self.concurrency:
            self.all_once.set()
        if sample.error is not None:
            self.errors += 1
            if len(self.examples) < 3 and sample.error not in self.examples:
                self.examples.append(sample.error)
            return
        self.ok_tokens += sample.tokens
        self.ok_chunks += sample.chunks
        if self.t0 is not None and sample.end >= self.t0 and self.t1 is None:
            self.measured.append(sample)
            if self.spec.requests is not None and len(self.measured) >= self.spec.requests:
                self.close(sample.end)
                self.enough.set()
            elif self.spec.min_requests is not None and len(self.measured) >= self.spec.min_requests:
                self.enough.set()  # the window may close once its seconds are over too

    def on_chunk(self, now: float) -> None:
        if self.t0 is not None and self.t1 is None and not self.closed and now >= self.t0:
            self.window_chunks += 1

    def tokens_per_s(self, window: float) -> float:
        per_chunk = self.ok_tokens / self.ok_chunks if self.ok_chunks else 1.0
        return self.window_chunks * per_chunk / window if window > 0 else 0.0

    def status(self, phase: str, now: float, index: str) -> str:
        done = self.measured
        window = now - self.t0 if self.t0 else 0.0
        tps = self.tokens_per_s(window)
        ttft = percentile([s.ttft for s in done if s.ttft is not None], 99)
        g = self.gauges[-1] if self.gauges else {}
        target = f"{self.spec.duration:g} s" if self.spec.duration else f"{self.spec.requests} reqs"
        if self.spec.min_requests:
            target += f" + {self.spec.min_requests} reqs"
        return (f"c={self.concurrency:<4} {index} {phase:<7} {window:5.1f} s of {target}  reqs {len(done):<5} "
                f"{tps:8.0f} tok/s  TTFT p99 {_ms(ttft):>6}  running {_num(g.get(GAUGES[0]))} "
                f"waiting {_num(g.get(GAUGES[1]))}  errors {self.errors}")

    def result(self) -> LevelResult:
        window = max((self.t1 or time.perf_counter()) - (self.t0 or time.perf_counter()), 1e-9)
        done = self.measured
        ttfts = [s.ttft for s in done if s.ttft is not None]
        gaps = [g for s in done for g in s.gaps]
        prompts = [s.prompt_tokens for s in done if s.prompt_tokens]
        tps = self.tokens_per_s(window)
        out = LevelResult(
            concurrency=self.concurrency, window_s=window, requests=len(done), errors=self.errors,
            output_tokens_per_s=tps, requests_per_s=tps / self.spec.output_tokens,
            ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
            itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99),
            e2e_p50_s=percentile([s.end - s.start for s in done], 50),
            prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
            gauge_samples=len(self.gauges),
            complete=len(done) >= (self.spec.requests or self.spec.min_requests or 0),
            error_examples=self.examples,
            in_flight_mean=self.in_flight_mean(), processes=self.processes,
        )
        tpots = [(s.end_chunk - s.first_chunk) / (s.chunks - 1) for s in done if s.chunks > 1 and s.end_chunk]
        out.tpot_p50_s, out.tpot_p99_s = percentile(tpots, 50), percentile(tpots, 99)
        for name, attr in zip(GAUGES, ("running", "waiting", "kv_cache")):
            values = [g[name] for g in self.gauges if name in g]
            if values:
                setattr(out, f"{attr}_mean", sum(values) / len(values))
                setattr(out, f"{attr}_max", max(values))
        waiting = [g[GAUGES[1]] for g in self.gauges if GAUGES[1] in g]
        if waiting:
            out.waiting_stdev = statistics.pstdev(waiting)
        return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _headers(spec: SweepSpec) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if spec.api_key:
        headers["authorization"] = f"Bearer {spec.api_key}"
    return headers


async def calibrate(client: httpx.AsyncClient, spec: SweepSpec) -> int:
    """Words per prompt that make about `prompt_tokens` tokens on this server; also checks the request shape."""
    url, headers, target = spec.url, _headers(spec), spec.prompt_tokens
    words = max(1, round(target * 0.75))
    for _ in range(4):  # proportional steps converge fast: the chat template adds a few fixed tokens
        sample = await stream_chat(client, url, chat_body(spec.model, PromptMaker(words).next(), 1), headers,
                                   spec.request_timeout)
        if sample.error:
            raise SweepError(f"{url} refused a test request for model {spec.model!r}: {sample.error}")
        got = sample.prompt_tokens
        if not got or abs(got - target) <= max(2, target // 50) or (words == 1 and got > target):
            break
        words = max(1, round(words * target / got))
    sample = await stream_chat(client, url, chat_body(spec.model, PromptMaker(words).next(), spec.output_tokens),
                               headers, spec.request_timeout)
    if sample.error:
        raise SweepError(f"{url} refused a full-length test request: {sample.error}")
    if sample.tokens != spec.output_tokens or sample.ttft is None:
        raise SweepError(f"{url} produced {sample.tokens} of {spec.output_tokens} output tokens"
                         f"{' and no text' if sample.ttft is None else ''}: does it honour ignore_eos?")
    return words


async def _worker(index: int, level: _Level, client: httpx.AsyncClient, prompts: PromptMaker) -> None:
    spec, headers = level.spec, _headers(level.spec)
    while True:  # ends when the level cancels it; each pass is bounded by request_timeout
        level.sent()
        try:
            sample = await stream_chat(client, spec.url, chat_body(spec.model, prompts.next(), spec.output_tokens),
                                       headers, spec.request_timeout, level.on_chunk)
        finally:
            level.returned()
        if sample.error is None and sample.tokens != spec.output_tokens:
            sample.error = f"short response: {sample.tokens} of {spec.output_tokens} output tokens"
        level.add(index, sample)
        if sample.error is not None:
            await asyncio.sleep(ERROR_PAUSE)


async def _sample_gauges(level: _Level, client: httpx.AsyncClient) -> None:
    headers = _headers(level.spec)
    while True:  # cancelled when the window closes
        gauges = await scrape_gauges(client, level.spec.url, headers)
        if gauges:
            level.gauges.append(gauges)
        # Jittered: a closed loop runs in lockstep, and a fixed period can alias with it and see one phase only.
        await asyncio.sleep(level.spec.metrics_interval * random.uniform(0.5, 1.5))


async def _show(level: _Level, progress: Progress, index: str) -> None:
    while True:
        phase = "warm-up" if level.t0 is None else "measure"
        progress.update(level.status(phase, time.perf_counter(), index))
        await asyncio.sleep(0.5)


async def stop(level: _Level, tasks: list[asyncio.Task[None]]) -> None:
    """Close the level and cancel its workers (their requests are aborted) and helpers."""
    level.closed = True
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_level(client: httpx.AsyncClient, spec: SweepSpec, concurrency: int, prompts: PromptMaker,
                    progress: Progress, index: str = "", deadline: float = math.inf) -> LevelResult:
    level = _Level(spec, concurrency)
    tasks = [asyncio.create_task(_worker(i, level, client, prompts)) for i in range(concurrency)]
    tasks.append(asyncio.create_task(_show(level, progress, index)))
    try:
        if spec.warmup > 0:
            await asyncio.sleep(min(spec.warmup, max(0.0, deadline - time.perf_counter())))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(level.all_once.wait(),
                                       min(spec.request_timeout, max(0.0, deadline - time.perf_counter())))
        t0 = time.perf_counter()
        level.open(t0)
        tasks.append(asyncio.create_task(_sample_gauges(level, client)))
        limit = max(0.0, min(spec.duration or spec.max_level_time, deadline - t0))
        if spec.requests is None:
            await asyncio.sleep(limit)
            if spec.min_requests is not None and not level.enough.is_set():
                more = max(0.0, min(spec.max_level_time, deadline - t0) - limit)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(level.enough.wait(), more)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(level.enough.wait(), limit)
        if level.t1 is None:
            level.close(time.perf_counter())
    finally:
        await stop(level, tasks)
    assert level.t1 is not None  # closed above, if not before
    progress.done(level.status("done", level.t1, index))
    return level.result()
