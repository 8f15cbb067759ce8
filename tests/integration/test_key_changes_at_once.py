"""A key change made on one gateway replica binds every replica as soon as the admin API answers: two
`llm-gateway serve` processes on one real redis-server, a slow simulated owned backend (cap 1) and a rented
stand-in that logs every call. The auth cache is kept for 30 s, so only the pub/sub invalidation can explain
a change seen sooner."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.test_overflow import standin  # noqa: F401 - the stand-in provider fixture
from tests.support.cluster import cluster
from tests.support.rented_standin import read_log

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 60}], "max_tokens": 10, "ignore_eos": True}


@pytest.fixture
def pair(tmp_path, standin):  # noqa: F811
    rented_url, log, _ = standin
    provider = {"name": "standin", "base_url": rented_url, "api_key_env": "STANDIN_KEY", "models": {"m": "r"},
                "allow_private_address": True, "price_per_million_tokens": {"input": 1.0, "output": 1.0}}
    with cluster(tmp_path, replicas=2, slow=True, providers=[provider], auth={"cache_seconds": 30},
                 model={"overflow": {"provider": "standin", "when_wait_exceeds": 0.05}},
                 backend={"cap": 1}) as c:
        yield c, log


async def renting_loop(url: str, key: str, stop: asyncio.Event, seen: list) -> None:
    """Workers on one replica keeping its owned backend full, so the rest spills while the key allows it."""
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {key}"}, timeout=60) as http:
        async def worker() -> None:
            for _ in range(500):  # bounded
                if stop.is_set():
                    return
                started = time.time()
                r = await http.post(f"{url}/v1/chat/completions", json=BODY)
                seen.append((started, r.status_code, r.headers.get("x-gateway-served-by")))

        await asyncio.gather(*(worker() for _ in range(4)))


async def downgrade_while_renting(c, key: str) -> tuple[float, list]:
    one, two = c.urls
    key_id = key.split("-")[1]
    admin = {"authorization": f"Bearer {c.admin_token}"}
    stop, seen = asyncio.Event(), []
    loop = asyncio.create_task(renting_loop(two, key, stop, seen))
    deadline = time.monotonic() + 60
    while sum(s[2] == "rented" for s in seen) < 3:  # replica two is renting for this key
        assert time.monotonic() < deadline and not loop.done(), seen
        await asyncio.sleep(0.05)
    async with httpx.AsyncClient(headers=admin, timeout=30) as http:
        r = await http.patch(f"{one}/admin/keys/{key_id}", json={"data_policy": "private_only"})
    answered = time.time()
    assert r.status_code == 200 and r.json()["data_policy"] == "private_only", r.text
    await asyncio.sleep(2.0)  # keep the loop going well after the answer
    stop.set()
    await asyncio.wait_for(loop, 120)
    return answered, seen


def test_downgrade_to_private_only_stops_renting_on_the_other_replica_once_answered(pair):
    c, log = pair
    key = c.issue_key(data_policy="allow_rented")
    answered, seen = asyncio.run(downgrade_while_renting(c, key))
    after = [s for s in seen if s[0] > answered]
    assert len(after) >= 4, seen  # the loop really ran after the answer
    assert all(code == 200 for _, code, _ in seen), seen
    assert [s for s in after if s[2] != "owned"] == [], after  # nothing started after the answer was rented
    rented = [s for s in seen if s[2] == "rented"]
    assert len(read_log(log)) == len(rented)  # the provider saw only those, all started before the answer


def test_revocation_is_401_on_the_other_replica_right_after_the_answer(pair):
    c, _ = pair
    one, two = c.urls
    key = c.issue_key()
    hdr = {"authorization": f"Bearer {key}"}
    small = {**BODY, "max_tokens": 1}
    assert httpx.post(f"{two}/v1/chat/completions", json=small, headers=hdr, timeout=30).status_code == 200
    r = httpx.post(f"{one}/admin/keys/{key.split('-')[1]}/revoke",
                   headers={"authorization": f"Bearer {c.admin_token}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{two}/v1/chat/completions", json=small, headers=hdr, timeout=30).status_code == 401
