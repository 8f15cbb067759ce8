"""Three gateway processes on one real Redis enforce ONE limit, exactly; a Redis outage follows the policy."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
import redis

from tests.support.cluster import cluster

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "ignore_eos": True}


async def burst(urls: list[str], key: str, count: int, body: dict = BODY) -> list[int]:
    """`count` requests at once, spread round-robin over the replicas; their status codes."""
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {key}"}, timeout=30,
                                 limits=httpx.Limits(max_connections=count)) as http:
        replies = await asyncio.gather(*(http.post(f"{urls[i % len(urls)]}/v1/chat/completions", json=body)
                                         for i in range(count)))
    return [r.status_code for r in replies]


def slots_held(c, key: str) -> int:
    """The concurrency slots of `key` that Redis holds now (its rate limiter's in-flight set; a lease that ran
    out stays in it until an admission of the key sweeps it, so only a release empties it)."""
    client = redis.Redis(port=c.redis.port)
    try:
        return client.zcard(f"llmgw:rl:{{key:{key.split('-')[1]}}}:inflight")
    finally:
        client.close()


@pytest.fixture
def three(tmp_path):
    # slow backend: each request takes ~2 s, so nothing is released while a burst is being admitted
    with cluster(tmp_path, replicas=3, slow=True, auth={"cache_seconds": 30}) as c:
        yield c


def test_request_token_and_concurrency_limits_are_global_and_exact(three):
    rpm_key = three.issue_key(limits={"requests_per_minute": 10})
    codes = asyncio.run(burst(three.urls, rpm_key, 30))
    assert codes.count(200) == 10 and codes.count(429) == 20

    # each request reserves 100 output + 5 prompt tokens: 1,000 tokens admit 9 (945), not a 10th (1,050)
    tpm_key = three.issue_key(limits={"tokens_per_minute": 1000})
    codes = asyncio.run(burst(three.urls, tpm_key, 24))
    assert codes.count(200) == 9 and codes.count(429) == 15

    conc_key = three.issue_key(limits={"max_concurrent": 4})
    codes = asyncio.run(burst(three.urls, conc_key, 12))
    assert codes.count(200) == 4 and codes.count(429) == 8
    # and the slots came back: each replica releases off the request path, after its answer is sent, so the
    # next burst may reach one replica before another's release reached Redis
    deadline = time.monotonic() + 10
    while slots_held(three, conc_key):  # bounded: the deadline
        assert time.monotonic() < deadline, f"{slots_held(three, conc_key)} slots still held 10 s after the burst"
        time.sleep(0.05)
    assert asyncio.run(burst(three.urls, conc_key, 4)) == [200] * 4


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
def test_redis_outage_follows_the_configured_mode(tmp_path, mode):
    modes = {"requests": mode, "tokens": mode, "concurrency": mode}
    with cluster(tmp_path, replicas=2, auth={"cache_seconds": 60},
                 rate_limits={"on_store_failure": modes}) as c:
        key = c.issue_key(limits={"requests_per_minute": 1000, "max_concurrent": 50})
        assert asyncio.run(burst(c.urls, key, 4)) == [200] * 4  # also puts the key in both replicas' caches
        c.redis.stop()
        codes = asyncio.run(burst(c.urls, key, 6))
        if mode == "fail_open":
            assert codes == [200] * 6
        else:
            assert codes == [503] * 6
            r = httpx.post(f"{c.urls[0]}/v1/chat/completions", json=BODY,
                           headers={"authorization": f"Bearer {key}"}, timeout=10)
            assert r.json()["error"]["code"] == "store_unavailable"
        assert all(httpx.get(f"{u}/health").status_code == 200 for u in c.urls)
        c.redis.start()
        deadline = time.monotonic() + 10
        while asyncio.run(burst(c.urls, key, 2)) != [200, 200]:
            assert time.monotonic() < deadline, "no recovery after Redis returned"
            time.sleep(0.2)
        logs = c.log_text()
        assert "Traceback" not in logs
        if mode == "fail_open":
            # each replica logs the admissions the store could not record, at most a line a second
            assert 2 <= logs.count("counted in this process only (fail_open)") <= 6
        metrics = "".join(httpx.get(f"{u}/metrics").text for u in c.urls)
        outcome = "fail_open" if mode == "fail_open" else "fail_closed"
        counted = re.findall(rf'llm_gateway_store_unavailable_total{{outcome="{outcome}",step="rate_limit"}} (\S+)',
                             metrics)
        assert sum(float(v) for v in counted) >= 6  # one per admission the store could not record
