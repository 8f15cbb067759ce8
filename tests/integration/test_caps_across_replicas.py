"""Three gateway processes on one real Redis share ONE cap per backend: the backend itself never sees more,
a killed gateway's slots come back within the lease, and aborted streams leave no slot behind."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import pytest
import redis

from tests.support.cluster import cluster
from tests.support.probes import metric_sum

CAP, LEASE = 4, 3.0


def body(tokens: int, n: int = 0) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True}


def slots_held(c) -> int:
    """Leases of the backend in Redis now, as every gateway counts them."""
    client = redis.Redis.from_url(c.redis.url)
    try:
        return client.zcount("llmgw:cap:{m-0}", f"({time.time()}", "+inf")
    finally:
        client.close()


async def backend_load(http: httpx.AsyncClient, url: str) -> float:
    text = (await http.get(f"{url}/metrics")).text
    return metric_sum(text, "vllm:num_requests_running") + metric_sum(text, "vllm:num_requests_waiting")


async def stream(http: httpx.AsyncClient, url: str, key: str, tokens: int, n: int = 0) -> int:
    """One whole stream; its status, after reading every event."""
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body(tokens, n),
                           headers={"authorization": f"Bearer {key}"}) as r:
        async for _ in r.aiter_lines():
            pass
        return r.status_code


@pytest.fixture
def three(tmp_path):
    with cluster(tmp_path, replicas=3, slow=True, backend={"cap": CAP}, caps={"lease_seconds": LEASE}) as c:
        yield c


def test_the_backend_never_sees_more_than_its_cap_and_a_dead_gateways_slots_come_back(three):
    c = three
    key = c.issue_key()

    async def load() -> tuple[float, list[int]]:
        peak = 0.0
        done = asyncio.Event()
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            async def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, await backend_load(http, c.backend_url))
                    await asyncio.sleep(0.005)

            sampler = asyncio.create_task(sample())
            # 12 streams at once, 4 to each gateway, twice over: 3x the cap is offered all the time
            codes = await asyncio.gather(*(stream(http, c.urls[i % 3], key, 15, i) for i in range(24)))
            done.set()
            await sampler
        return peak, codes

    peak, codes = asyncio.run(load())
    assert codes == [200] * 24
    assert peak == CAP  # reached, never exceeded (one process alone would have sent up to 3x)
    # leases go back off the request path, batched, after each stream's last bytes: wait for them, but only a
    # third of the lease, so a lease never given back (renewed, or not yet run out) still counts here
    deadline = time.monotonic() + LEASE / 3
    while slots_held(c) and time.monotonic() < deadline:  # bounded: LEASE / 3
        time.sleep(0.02)
    assert slots_held(c) == 0

    async def hold_then_kill() -> float:
        async with httpx.AsyncClient(timeout=60) as http:
            long = [asyncio.create_task(stream(http, c.urls[0], key, 2000, i)) for i in range(CAP)]
            deadline = time.monotonic() + 20
            while slots_held(c) < CAP:
                assert time.monotonic() < deadline, "the streams never took the slots"
                await asyncio.sleep(0.05)
            c.gateways[0].send_signal(signal.SIGKILL)  # no goodbye: its leases must run out by themselves
            killed = time.monotonic()
            await asyncio.gather(*long, return_exceptions=True)
            while slots_held(c) > 0:
                assert time.monotonic() - killed < LEASE + 5, "a dead gateway's slots did not come back"
                await asyncio.sleep(0.05)
            back = time.monotonic() - killed
            assert await stream(http, c.urls[1], key, 5) == 200  # and the others may use them
        return back

    assert asyncio.run(hold_then_kill()) <= LEASE + 5  # within one lease, plus the slack of a loaded machine


def test_a_thousand_streams_aborted_at_random_leave_no_slot_held(tmp_path):
    with cluster(tmp_path, replicas=3, backend={"cap": 8}, caps={"lease_seconds": 60},
                 sim_args=("--step-base-ms", "2", "--step-ms-per-seq", "0")) as c:
        key = c.issue_key()
        rng = random.Random(14)

        async def aborted(http: httpx.AsyncClient, i: int) -> None:
            url, lines = c.urls[i % 3], rng.randrange(0, 12)
            if rng.random() < 0.3:  # given up before any answer: often while queued for a slot
                with pytest.raises((TimeoutError, asyncio.TimeoutError)):
                    async with asyncio.timeout(rng.uniform(0.0, 0.05)):
                        await stream(http, url, key, 200, i)
                return
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body(200, i),
                                   headers={"authorization": f"Bearer {key}"}) as r:
                seen = 0
                async for _ in r.aiter_lines():
                    seen += 1
                    if seen >= lines:
                        break  # leaving the block closes the connection mid-stream

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=48)) as http:
                for start in range(0, 1000, 48):
                    await asyncio.gather(*(aborted(http, i) for i in range(start, min(start + 48, 1000))))

        asyncio.run(run())
        deadline = time.monotonic() + 20
        while slots_held(c) or any(metric_sum(httpx.get(f"{u}/metrics").text, "llm_gateway_in_flight") for u in c.urls):
            assert time.monotonic() < deadline, f"slots still held after the streams ended: {slots_held(c)}"
            time.sleep(0.1)
        texts = [httpx.get(f"{u}/metrics").text for u in c.urls]
        assert sum(metric_sum(t, "llm_gateway_queue_depth") for t in texts) == 0
        assert "Traceback" not in c.log_text()


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
def test_while_redis_is_down_caps_follow_on_store_failure_loudly(tmp_path, mode):
    with cluster(tmp_path, replicas=2, backend={"cap": 2}, auth={"cache_seconds": 60},
                 rate_limits={"on_store_failure": {"concurrency": mode}}) as c:
        key = c.issue_key()

        async def one(url: str) -> int:
            async with httpx.AsyncClient(timeout=30) as http:
                return await stream(http, url, key, 3)

        assert [asyncio.run(one(u)) for u in c.urls] == [200, 200]  # the key is in both replicas' caches
        c.redis.stop()
        codes = [asyncio.run(one(u)) for u in c.urls for _ in range(2)]
        texts = [httpx.get(f"{u}/metrics").text for u in c.urls]
        failures = sum(metric_sum(t, "llm_gateway_cap_store_failures_total", mode=mode) for t in texts)
        assert failures == 4  # every admission without the fleet's count is counted
        if mode == "fail_open":
            assert codes == [200] * 4
            assert c.log_text().count("fail open, counted in this process only") == 2  # once per replica
        else:
            assert codes == [503] * 4
        c.redis.start()
        deadline = time.monotonic() + 15
        while [asyncio.run(one(u)) for u in c.urls] != [200, 200]:
            assert time.monotonic() < deadline, "no recovery after Redis returned"
            time.sleep(0.2)
        assert "Traceback" not in c.log_text()
