"""One level's streams spread over client processes, so the client never bounds what the server is asked to do.

One asyncio process reads and parses every chunk of every stream; at a few hundred streams of a GPU server that
is more than one core can do, and the level silently runs below the concurrency asked for (seen on an H200: 166
of 256 requests in flight by vLLM's own running mean, and inter-token gaps that read 0 ms because several chunks
waited in one read). Here each process drives its share of the level (`SweepSpec.per_process` streams at most)
with the same worker loop as the one-process sweep. The parent keeps the level's clock in shared memory (warm-up,
window open, window closed), samples vLLM's gauges, and merges what the processes measured into one level.
time.perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process of the machine, so the times the
processes record compare directly.

Every wait is bounded: processes must start within START_TIMEOUT, the window by the spec's limits, the results
by the request timeout, and a process that outlives all that is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import SynchronizedArray
from multiprocessing.context import SpawnProcess
from typing import TypeAlias, TypedDict

import httpx

from .prompts import PromptMaker
from .client import Sample
from .sweep import LevelResult, Progress, SweepError, SweepSpec, _Level, _sample_gauges, _worker, stop

START_TIMEOUT = 60.0  # seconds for the client processes to import and connect
TICK = 0.01  # how often a process reads the shared clock (the window's edges are this exact)
T0, T1, READY, ONCE, MEASURED = range(5)  # the shared clock's slots


class _Part(TypedDict):
    """What one client process measured in the window (see _drive), summed up by the parent."""

    measured: list[Sample]
    window_chunks: int
    ok_tokens: int
    ok_chunks: int
    errors: int
    examples: list[str]
    area: float


Clock: TypeAlias = "SynchronizedArray[float]"  # the shared clock, slots T0..MEASURED
Results: TypeAlias = "Queue[tuple[str, _Part | str]]"  # ("ok", a part) or ("error", why), one per client process


def shares(concurrency: int, processes: int) -> list[int]:
    """The level's streams split as evenly as possible."""
    return [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]


def _bump(clock: Clock, slot: int, amount: float) -> None:
    with clock.get_lock():
        clock[slot] += amount


async def _drive(spec: SweepSpec, share: int, seed: int, words: int, clock: Clock, limit: float) -> _Part:
    """A client process's part of the level; returns what it measured in the window the parent set."""
    # Its own window is the parent's: no request count of its own closes it.
    local = dataclasses.replace(spec, duration=spec.duration or 1.0, requests=None, min_requests=None)
    level = _Level(local, share)
    prompts = PromptMaker(words, seed)
    limits = httpx.Limits(max_connections=share + 4, max_keepalive_connections=share + 4)
    timeout = httpx.Timeout(spec.request_timeout, connect=min(10.0, spec.request_timeout))
    end = time.perf_counter() + limit
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        tasks = [asyncio.create_task(_worker(i, level, client, prompts)) for i in range(share)]
        _bump(clock, READY, 1)
        once_told, counted = False, 0
        try:
            while time.perf_counter() < end:
                if level.all_once.is_set() and not once_told:
                    once_told = True
                    _bump(clock, ONCE, share)
                if len(level.measured) > counted:
                    _bump(clock, MEASURED, len(level.measured) - counted)
                    counted = len(level.measured)
                if clock[T0] and level.t0 is None:
                    level.open(clock[T0])
                if clock[T1]:
                    level.close(clock[T1])
                    break
                await asyncio.sleep(TICK)
            else:
                level.close(time.perf_counter())
        finally:
            await stop(level, tasks)
    t1 = level.t1
    assert t1 is not None  # the loop above closed the level
    return {
        "measured": [s for s in level.measured if s.end <= t1],
        "window_chunks": level.window_chunks, "ok_tokens": level.ok_tokens, "ok_chunks": level.ok_chunks,
        "errors": level.errors, "examples": level.examples,
        "area": (level.window_area[1] - level.window_area[0]) if len(level.window_area) == 2 else 0.0,
    }


def _process(spec: SweepSpec, share: int, seed: int, words: int, clock: Clock, out: Results, limit: float) -> None:
    try:
        out.put(("ok", asyncio.run(_drive(spec, share, seed, words, clock, limit))))
    except BaseException as exc:  # reported to the parent, which fails the sweep with it
        out.put(("error", f"{type(exc).__name__}: {exc}"[:300]))


async def _wait_for(predicate: Callable[[], bool], limit: float) -> bool:
    end = time.perf_counter() + max(0.0, limit)
    while not predicate():
        if time.perf_counter() >= end:
            return False
        await asyncio.sleep(TICK * 2)
    return True


async def run_spread_level(client: httpx.AsyncClient, spec: SweepSpec, concurrency: int, words: int,
                           progress: Progress, index: str = "", deadline: float = math.inf) -> LevelResult:
    processes = spec.processes(concurrency)
    ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of this process's event loop is inherited
    clock: Clock = ctx.Array("d", 5)
    out: Results = ctx.Queue()
    window_limit = spec.max_level_time
    if spec.requests is None and spec.min_requests is None:
        assert spec.duration is not None  # exactly one of duration and requests (SweepSpec)
        window_limit = spec.duration
    limit = START_TIMEOUT + spec.warmup + spec.request_timeout + window_limit + 30.0  # a process's own bound
    procs = [ctx.Process(target=_process, daemon=True,
                         args=(spec, n, spec.seed * 100_000 + concurrency * 100 + i, words, clock, out, limit))
             for i, n in enumerate(shares(concurrency, processes))]
    level = _Level(spec, concurrency)
    level.processes = processes
    gauges = None
    for proc in procs:
        proc.start()
    try:
        if not await _wait_for(lambda: clock[READY] >= processes, START_TIMEOUT):
            raise SweepError(f"c={concurrency}: {processes - int(clock[READY])} of {processes} client processes "
                             f"did not start within {START_TIMEOUT:g} s")
        progress.update(f"c={concurrency:<4} {index} warm-up  over {processes} client processes")
        await asyncio.sleep(min(spec.warmup, max(0.0, deadline - time.perf_counter())))
        await _wait_for(lambda: clock[ONCE] >= concurrency,
                        min(spec.request_timeout, deadline - time.perf_counter()))
        t0 = time.perf_counter()
        clock[T0] = t0
        level.t0 = t0
        gauges = asyncio.create_task(_sample_gauges(level, client))
        room = max(0.0, min(spec.duration or spec.max_level_time, deadline - t0))
        requests, min_requests = spec.requests, spec.min_requests
        if requests is not None:
            await _wait_for(lambda: clock[MEASURED] >= requests, room)
        else:
            await asyncio.sleep(room)
            if min_requests is not None:
                more = max(0.0, min(spec.max_level_time, deadline - t0) - room)
                await _wait_for(lambda: clock[MEASURED] >= min_requests, more)
        t1 = time.perf_counter()
        clock[T1] = t1
        level.t1 = t1
        parts = await asyncio.to_thread(_collect, out, processes, spec.request_timeout + 30.0)
    finally:
        if gauges is not None:
            gauges.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gauges
        clock[T1] = clock[T1] or time.perf_counter()  # on an error, tell the processes to stop too
        await asyncio.to_thread(_reap, procs)
    level.closed = True
    for part in parts:
        level.measured.extend(part["measured"])
        level.window_chunks += part["window_chunks"]
        level.ok_tokens += part["ok_tokens"]
        level.ok_chunks += part["ok_chunks"]
        level.errors += part["errors"]
        level.examples.extend(e for e in part["examples"] if e not in level.examples)
    del level.examples[3:]
    level.window_area = [0.0, sum(part["area"] for part in parts)]
    progress.done(level.status("done", t1, index) + f"  ({processes} client processes)")
    return level.result()


def _collect(out: Results, processes: int, limit: float) -> list[_Part]:
    parts: list[_Part] = []
    end = time.monotonic() + limit
    while len(parts) < processes:
        try:
            status, value = out.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            raise SweepError(f"{processes - len(parts)} client processes sent no results within {limit:g} s") \
                from None
        if status != "ok" or isinstance(value, str):  # "ok" comes with a part
            raise SweepError(f"a client process failed: {value}")
        parts.append(value)
    return parts


def _reap(procs: list[SpawnProcess]) -> None:
    for proc in procs:
        proc.join(timeout=10)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
