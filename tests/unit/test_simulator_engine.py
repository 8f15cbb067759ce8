"""The simulator's continuous-batching engine on its own: batch cap, FIFO queue, aborts, the knee."""

from __future__ import annotations

import asyncio
import time

import pytest

from tools.simulator import SimConfig
from tools.simulator.engine import Engine, GenRequest
from tools.simulator.protocol import tokenize

FAST = dict(step_base_ms=2.0, step_ms_per_seq=0.0, prefill_base_ms=0.0, prefill_ms_per_token=0.0)


@pytest.fixture
async def make_engine():
    engines: list[Engine] = []

    def make(**overrides) -> Engine:
        engine = Engine(SimConfig(**{**FAST, **overrides}))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


def success(engine: Engine, reason: str) -> float:
    return engine.metrics.registry.get_sample_value(
        "vllm:request_success_total", {"engine": "0", "finished_reason": reason, "model_name": "sim"})


async def until(condition, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


async def finish_all(reqs: list[GenRequest], timeout: float = 5.0) -> None:
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in reqs)), timeout)


async def test_batch_cap_and_fifo_queue(make_engine):
    engine = make_engine(max_num_seqs=2)
    reqs = [engine.submit(tokenize(f"prompt number {i}"), 6, ignore_eos=True) for i in range(5)]
    assert engine.num_waiting == 5 and engine.num_running == 0
    await until(lambda: engine.steps >= 1)
    assert (engine.num_running, engine.num_waiting) == (2, 3)
    assert engine.kv_cache_usage() > 0

    max_running = 0
    while not all(r.finished for r in reqs):
        max_running = max(max_running, engine.num_running)
        await asyncio.sleep(0.0005)
    assert max_running == 2
    admitted = [r.admitted_at for r in reqs]
    assert admitted == sorted(admitted)  # first in, first admitted
    assert admitted[2] > admitted[1] and admitted[4] > admitted[3]
    assert [r.finish_reason for r in reqs] == ["length"] * 5
    assert all(r.output_tokens == 6 for r in reqs)
    assert (engine.num_running, engine.num_waiting, engine.kv_cache_usage()) == (0, 0, 0.0)
    assert success(engine, "length") == 5
    gen_tokens = engine.metrics.registry.get_sample_value(
        "vllm:generation_tokens_total", {"engine": "0", "model_name": "sim"})
    assert gen_tokens == 30


async def test_finish_reasons_and_deterministic_text(make_engine):
    engine = make_engine(natural_output_tokens=8)
    prompt = tokenize("tell me a story about batching")
    natural = engine.submit(prompt, 100)
    capped = engine.submit(prompt, 5, ignore_eos=True)
    long = engine.submit(prompt, 20, ignore_eos=True)
    await finish_all([natural, capped, long])
    assert (natural.finish_reason, natural.output_tokens) == ("stop", 8)
    assert natural.stop_reason is None
    assert (capped.finish_reason, capped.output_tokens) == ("length", 5)
    assert long.text.startswith(capped.text) and long.text.startswith(natural.text)  # same prompt, same text

    stop_word = long.text.split()[10]
    stopped = engine.submit(prompt, 20, ignore_eos=True, stop=["zzz", stop_word])
    other = engine.submit(tokenize("a different prompt entirely"), 20, ignore_eos=True)
    await finish_all([stopped, other])
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_word)
    assert stopped.text == long.text[:long.text.index(stop_word)]
    assert stop_word not in stopped.text
    assert other.text != long.text


async def test_abort_frees_the_slot_and_is_counted(make_engine):
    engine = make_engine(max_num_seqs=1)
    hog = engine.submit(tokenize("hold the only slot"), 1000, ignore_eos=True)
    queued = engine.submit(tokenize("wait behind it"), 3, ignore_eos=True)
    dropped = engine.submit(tokenize("give up while waiting"), 3, ignore_eos=True)
    await until(lambda: hog.output_tokens >= 2)
    assert (engine.num_running, engine.num_waiting) == (1, 2)

    dropped.abort()  # leaves the queue at once
    assert dropped.finish_reason == "abort" and engine.num_waiting == 1
    hog.abort()  # leaves the batch at once
    assert hog.finish_reason == "abort" and engine.num_running == 0
    assert success(engine, "abort") == 2

    await finish_all([queued], timeout=1.0)
    assert queued.finish_reason == "length"
    hog.abort()  # aborting a finished request changes nothing
    queued.abort()
    assert success(engine, "abort") == 2 and success(engine, "length") == 1


async def test_streaming_consumer_sees_every_piece(make_engine):
    engine = make_engine()
    req = engine.submit(tokenize("stream me"), 12, ignore_eos=True)
    pieces = [piece async for piece in req]
    assert len(pieces) == 12 and "".join(pieces) == req.text
    assert req.finish_reason == "length"


async def test_loop_sleeps_when_idle(make_engine):
    engine = make_engine()
    await finish_all([engine.submit(tokenize("one"), 3, ignore_eos=True)])
    steps = engine.steps
    await asyncio.sleep(0.05)
    assert engine.steps == steps


async def test_prefix_cache_skips_prefill(make_engine):
    # 200 ms of prefill uncached against ~10 ms cached: the bound below then holds through a stall of ~50 ms
    # (the test process losing the CPU) while the cached request runs, not only one of ~10 ms
    engine = make_engine(prefill_ms_per_token=0.2)
    prompt = tokenize("x" * 4000)  # 1000 tokens: 200 ms of prefill when uncached
    first = engine.submit(prompt, 1)
    await finish_all([first])
    second = engine.submit(prompt, 1)
    await finish_all([second])
    assert first.cached_tokens == 0 and second.cached_tokens >= 960
    ttft = [r.first_token_at - r.arrival for r in (first, second)]
    assert ttft[1] < ttft[0] / 3
    hits = engine.metrics.registry.get_sample_value("vllm:prefix_cache_hits_total",
                                                    {"engine": "0", "model_name": "sim"})
    assert hits == second.cached_tokens


async def run_closed_batch(engine: Engine, concurrency: int, tokens: int) -> tuple[float, float, float]:
    """Submit `concurrency` requests at once; return (output tok/s, mean TTFT, mean inter-token latency)."""
    start = time.monotonic()
    reqs = [engine.submit(tokenize(f"knee {concurrency} {i}"), tokens, ignore_eos=True) for i in range(concurrency)]
    await finish_all(reqs)
    elapsed = time.monotonic() - start
    ttft = sum(r.first_token_at - r.arrival for r in reqs) / len(reqs)
    itl = sum((r.last_token_at - r.first_token_at) / (tokens - 1) for r in reqs) / len(reqs)
    return concurrency * tokens / elapsed, ttft, itl


async def best_of(runs: int, engine: Engine, concurrency: int, tokens: int) -> tuple[float, float, float]:
    """run_closed_batch `runs` times: the highest throughput and the lowest latencies seen. The engine's steps are
    timed sleeps, so a run is only ever slowed by the machine (the process losing the CPU), never sped up: the
    least disturbed run is the closest to the engine's own figures."""
    results = [await run_closed_batch(engine, concurrency, tokens) for _ in range(runs)]
    return max(r[0] for r in results), min(r[1] for r in results), min(r[2] for r in results)


@pytest.mark.serial  # judges the engine's throughput on the machine's cores: make test runs it alone
async def test_throughput_flattens_and_ttft_grows_past_the_cap(make_engine):
    # Step = 4 ms + 1 ms per running sequence, cap 4: ideal 200 tok/s at 1, 500 at 4, still 500 at 8,
    # where half the requests wait a whole generation for a slot.
    engine = make_engine(max_num_seqs=4, step_base_ms=4.0, step_ms_per_seq=1.0)
    # 48 tokens (~0.25-0.5 s a batch): long enough that the test process losing the CPU for a few scheduler
    # slices on a busy machine moves a throughput by a few percent, not by the margins asserted below.
    thr1, _, _ = await run_closed_batch(engine, 1, 48)
    # a stall in the run at 4 would lower thr4 and raise ttft4, against every bound below (~100 ms in its ~0.4 s
    # breaks the second): its best of two. A stall in the other runs only moves them away from their bounds.
    thr4, ttft4, _ = await best_of(2, engine, 4, 48)
    thr8, ttft8, _ = await run_closed_batch(engine, 8, 48)
    assert thr4 > 1.8 * thr1, (thr1, thr4)
    assert thr8 < 1.25 * thr4, (thr4, thr8)
    assert ttft8 > 3 * ttft4, (ttft4, ttft8)


async def test_step_time_grows_with_the_batch(make_engine):
    # Below the cap a step costs 2 ms + 2 ms per sequence: 12 sequences get ~1.8x the throughput of one,
    # not 12x, and each of them sees its tokens ~6.5x further apart.
    engine = make_engine(max_num_seqs=64, step_base_ms=2.0, step_ms_per_seq=2.0)
    # 32 tokens: see the test above. A stall in the run of one (~0.13 s) would lower thr1 and raise itl1, against
    # the upper bound and the ITL ratio: its best of two. One in the run of 12 (~0.8 s) only counts against 1.3x.
    thr1, _, itl1 = await best_of(2, engine, 1, 32)
    thr12, _, itl12 = await run_closed_batch(engine, 12, 32)
    assert 1.3 * thr1 < thr12 < 6 * thr1, (thr1, thr12)
    assert itl12 > 3 * itl1, (itl1, itl12)


async def test_an_engine_failure_fails_requests_instead_of_hanging(make_engine, monkeypatch):
    engine = make_engine()

    def broken(now: float) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "_decode", broken)
    failed = engine.submit(tokenize("this step breaks"), 5)
    await finish_all([failed], timeout=1.0)
    assert failed.finish_reason == "error" and success(engine, "error") == 1
    assert (engine.num_running, engine.num_waiting) == (0, 0)

    monkeypatch.undo()  # the next request restarts the loop
    ok = engine.submit(tokenize("after the failure"), 3, ignore_eos=True)
    await finish_all([ok], timeout=1.0)
    assert ok.finish_reason == "length"
