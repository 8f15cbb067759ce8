"""Three gateway processes on one real Redis in front of one real CPU vLLM (`--max-num-seqs 8`, cap 8).

At 24 concurrent streams spread over the three, vLLM's own num_requests_running + num_requests_waiting,
sampled from its /metrics 5 ms after each answer, never exceeds 8, and the throughput is at least 95% of one
gateway's at the same offered load (`make bench-caps`; 80% in `make test`, see FLEET_MIN). Then one gateway is killed
mid-run: its leases leave Redis within the lease bound and the two left fill the backend to its cap again.

Marked `sweep`: it saturates a vLLM of its own (`capped_vllm`, shared with the knee and batch fill tests) and
runs before the shared servers start. Phases alternate (one, three, three, one) so that the machine's drift
in speed falls on both sides alike.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import signal
import time

import httpx
import openai
import pytest
import redis

from tests.support.cluster import cluster

CAP, STREAMS, LEASE = 8, 24, 3.0
# Three gateways' throughput against one's: `make bench-caps` holds it to the issue's 95%; in `make test` a
# looser bound still catches a broken hand-off between gateways (a slot left idle per request costs far more)
# without failing CI on a machine whose speed drifts between the phases.
FLEET_MIN = float(os.environ.get("CAPS_FLEET_MIN", "0.8"))
WARMUP, MEASURE = 2.0, 8.0


GAUGE = re.compile(rb"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


def sample_vllm(url: str, stop, out) -> None:
    """In a process of its own (the load's event loop must not slow it down): vLLM's running + waiting, asked
    5 ms after each answer until `stop`; sends (peak, samples, median interval in s) to `out`."""
    peak, stamps = 0.0, []
    with httpx.Client(timeout=5) as http:
        while not stop.is_set():
            body = http.get(f"{url}/metrics").content
            stamps.append(time.monotonic())
            peak = max(peak, sum(float(v) for v in GAUGE.findall(body)))
            time.sleep(0.005)
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    out.send((peak, len(stamps), gaps[len(gaps) // 2] if gaps else 0.0))


class Phase:
    def __init__(self) -> None:
        self.tokens = 0
        self.peak = 0.0
        self.samples = 0
        self.interval = 0.0  # median time between two samples of vLLM's gauges
        self.errors: list[str] = []


async def closed_loop(urls: list[str], key: str, vllm_url: str, seconds: float, phase: Phase,
                      during=None) -> None:
    """STREAMS workers, worker i on urls[i % len]; counts the tokens of streams that end in the window."""
    start = time.monotonic()
    t0, t1 = start + WARMUP, start + WARMUP + seconds
    clients = [openai.AsyncOpenAI(base_url=f"{u}/v1", api_key=key, max_retries=0, timeout=600) for u in urls]

    async def worker(i: int) -> None:
        client, n = clients[i % len(clients)], 0
        while time.monotonic() < t1:
            n += 1
            tokens = 0
            try:
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"{i}-{n} tell me a story"}], max_tokens=32,
                    stream=True, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        tokens += 1
            except openai.APIError as exc:
                if during is None or i % len(clients) != 2:  # the killed gateway's workers may fail
                    phase.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return  # a gateway killed under it: this worker is done
            if t0 <= time.monotonic() <= t1:
                phase.tokens += tokens

    stop, (receive, send) = multiprocessing.Event(), multiprocessing.Pipe(duplex=False)
    sampler = multiprocessing.Process(target=sample_vllm, args=(vllm_url, stop, send), daemon=True)
    sampler.start()
    try:
        tasks = [asyncio.create_task(worker(i)) for i in range(STREAMS)]
        if during is not None:
            tasks.append(asyncio.create_task(during(start)))
        await asyncio.gather(*tasks)
    finally:
        stop.set()
        phase.peak, phase.samples, phase.interval = receive.recv()
        sampler.join(10)
        for client in clients:
            await client.close()


def leases(c, pid: int | None = None) -> int:
    """Live leases of the backend in Redis; only those of the gateway process `pid`, when given."""
    client = redis.Redis.from_url(c.redis.url, decode_responses=True)
    try:
        members = client.zrangebyscore("llmgw:cap:{m-0}", f"({time.time()}", "+inf")
    finally:
        client.close()
    return sum(1 for m in members if pid is None or f":{pid}:" in m)


@pytest.mark.sweep
def test_three_gateways_hold_one_cap_on_a_real_vllm(capped_vllm, tmp_path):
    with cluster(tmp_path, replicas=3, upstream=capped_vllm.base_url,
                 backend={"cap": CAP, "served_name": "tiny-knee"}, caps={"lease_seconds": LEASE},
                 model={"queue": {"max_wait": 600}}, timeouts={"read": 300}) as c:
        # a generous wait bound: on a crowded machine vLLM may take minutes to serve the queue's share
        key = c.issue_key()
        one, three = [Phase(), Phase()], [Phase(), Phase()]
        for phase, urls in ((one[0], c.urls[:1]), (three[0], c.urls), (three[1], c.urls), (one[1], c.urls[:1])):
            asyncio.run(closed_loop(urls, key, capped_vllm.base_url, MEASURE, phase))
        for phase in one + three:
            assert not phase.errors, phase.errors[:3]
            # asked 5 ms after each answer (a 16 ms median interval on a quiet machine); vLLM (engine and API
            # server in one process here) answers between engine steps, which is also when its gauges change,
            # so on a busy core the interval is the step time
            assert phase.interval <= 0.25
        single, fleet = sum(p.tokens for p in one), sum(p.tokens for p in three)
        peak = max(p.peak for p in three)
        print(f"\none gateway: {single / (2 * MEASURE):.0f} tok/s, three: {fleet / (2 * MEASURE):.0f} tok/s "
              f"({fleet / single:.1%}); vLLM running + waiting peak {peak:.0f} with three, "
              f"{max(p.peak for p in one):.0f} with one; sampled every "
              f"{max(p.interval for p in one + three) * 1000:.0f} ms (median, worst phase)")
        assert peak <= CAP  # vLLM's own count: the three together never sent more than the cap
        assert max(p.peak for p in one) <= CAP
        assert fleet >= FLEET_MIN * single, f"three gateways {fleet / single:.1%} of one (bound {FLEET_MIN:.0%})"

        victim = c.gateways[2]
        timing: dict[str, float] = {}

        async def kill_then_watch(start: float) -> None:
            while time.monotonic() < start + WARMUP + 2:
                await asyncio.sleep(0.05)
            held_by = time.monotonic() + 10  # on a starved machine it may hold none at one instant: wait for one
            while leases(c, victim.pid) == 0:
                assert time.monotonic() < held_by, "the gateway to kill never held a slot"
                await asyncio.sleep(0.01)
            victim.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            while leases(c, victim.pid):
                assert time.monotonic() - killed < LEASE + 10, "a dead gateway's leases stayed"
                await asyncio.sleep(0.05)
            timing["back"] = time.monotonic() - killed

        after = Phase()
        asyncio.run(closed_loop(c.urls, key, capped_vllm.base_url, MEASURE, after, during=kill_then_watch))
        print(f"killed gateway's leases gone {timing['back']:.2f} s after the kill (lease {LEASE:g} s)")
        assert timing["back"] <= LEASE + 1  # one lease, and a renewal's worth of slack
        assert after.peak <= CAP and not after.errors, after.errors[:3]
