"""A whole sweep: calibrate the prompt, then measure every level in order (sweep.py says how one level is
measured), in this process or, past `per_process` streams, spread over client processes (spread.py)."""

from __future__ import annotations

import time

import httpx

from .prompts import PromptMaker
from .spread import run_spread_level
from .sweep import LevelResult, Progress, SweepResult, SweepSpec, calibrate, run_level


async def run_sweep(spec: SweepSpec, progress: Progress | None = None) -> SweepResult:
    """Calibrate the prompt, then measure every level in order; raises SweepError if nothing can be measured."""
    progress = progress or Progress()
    started = time.time()
    deadline = time.perf_counter() + spec.max_time
    levels = sorted(set(spec.levels))
    limits = httpx.Limits(max_connections=max(levels) + 8, max_keepalive_connections=max(levels) + 8)
    timeout = httpx.Timeout(spec.request_timeout, connect=min(10.0, spec.request_timeout))
    results: list[LevelResult] = []
    stopped = None
    # trust_env=False: a proxy from the environment would sit between the sweep and the backend it measures.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        words = await calibrate(client, spec)
        prompts = PromptMaker(words, spec.seed)
        for i, c in enumerate(levels):
            if time.perf_counter() >= deadline:
                stopped = f"the sweep's time limit ({spec.max_time:g} s) ran out before c={c}"
                break
            where = f"[{i + 1}/{len(levels)}]"
            if spec.processes(c) > 1:
                result = await run_spread_level(client, spec, c, words, progress, where, deadline)
            else:
                result = await run_level(client, spec, c, prompts, progress, where, deadline)
            results.append(result)
            if result.errors and spec.stop_on_errors and c != levels[-1]:
                stopped = f"stopped after c={c}: {result.errors} requests failed ({'; '.join(result.error_examples)})"
                break
    return SweepResult(spec, words, results, stopped, started, time.time())
