"""Killing the Redis primary under load: three gateway processes on a real Sentinel set (a primary, two replicas,
three sentinels) or a real Cluster (3 primaries + 3 replicas), the simulator as backend, steady bounded load on
a rate-limited key; SIGKILL the primary (in the Cluster, the one holding that key's rate-limit slot).

What must hold (docs/redis-ha.md says why these bounds):
- fail_open: requests keep being served; the backend never sees more than the limit allows over the run plus
  what each gateway may admit on its own during the failover window (a full local bucket and its refill);
- fail_closed: the only failures are 503s with Retry-After, all inside the window;
- both: within 10 s of the promotion no gateway reaches for the store in vain any more, no concurrency slot
  and no slot of the backend's cap (leases in Redis) is held once the load stops, and every key issued before
  the kill still authenticates on every gateway.

And (Sentinel, both modes): requests holding the backend's whole cap end while the primary is dead; the backend
is back at its full cap within FULL_WITHIN s of the promotion (their give-backs are sent again until the new
primary answers, not left to their leases), and no cap lease is left once the load stops.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time

import httpx
import pytest

from policies.keys import key_id_of
from tests.support.cluster import cluster
from tests.support.redis_ha import ClusterSet, SentinelSet, wait_for

RPM = 60  # the key's limit: a bucket of 60, refilled at 1 a second
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
WORKERS = 6  # requests in flight at once, spread over the gateways: bounded load
RECOVERY = 10.0  # seconds after the promotion
# A server silent this long is judged down (sentinels' down-after-milliseconds, the Cluster's node timeout). A
# busy 2-core machine stalls a live Redis for over a second at times (an AOF fsync behind other disk work):
# judged dead, it would be failed over while still serving, and what it took meanwhile lost (docs/redis-ha.md).
DOWN_AFTER_MS = 3000
CAP, CAP_LEASE = 4, 10  # the backend's cap, held in Redis across the gateways (policies/fleet_caps.py)


def unavailable_total(urls: list[str]) -> float:
    text = "".join(httpx.get(f"{u}/metrics", timeout=10).text for u in urls)
    return sum(float(v) for v in re.findall(r"llm_gateway_store_unavailable_total\{[^}]*\} (\S+)", text))


def served_at_backend(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)", text, re.M))


async def load(urls: list[str], key: str, stop: asyncio.Event, log: list[tuple[float, str, int, str]]):
    """WORKERS loops, each one request at a time round-robin over the gateways, until `stop` (or 90 s)."""
    deadline = time.monotonic() + 90

    async def worker(n: int) -> None:
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {key}"}, timeout=15) as http:
            i = n
            while not stop.is_set() and time.monotonic() < deadline:
                url = urls[i % len(urls)]
                i += 1
                try:
                    r = await http.post(f"{url}/v1/chat/completions", json=BODY)
                    log.append((time.monotonic(), url, r.status_code, r.headers.get("retry-after", "")))
                except httpx.HTTPError:
                    log.append((time.monotonic(), url, 0, ""))
                await asyncio.sleep(0.02)

    await asyncio.gather(*(worker(n) for n in range(WORKERS)))


def works(url: str, key: str) -> bool:
    r = httpx.post(f"{url}/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"}, timeout=15)
    return r.status_code in (200, 429)  # authenticated: served or rate-limited, not 401/503


@pytest.mark.parametrize("setup, mode", [(SentinelSet, "fail_open"), (SentinelSet, "fail_closed"),
                                         (ClusterSet, "fail_open"), (ClusterSet, "fail_closed")],
                         ids=["sentinel-open", "sentinel-closed", "cluster-open", "cluster-closed"])
def test_sigkill_of_the_primary_under_load(tmp_path, setup, mode):
    modes = {"requests": mode, "tokens": mode, "concurrency": mode}
    with cluster(tmp_path, replicas=3, redis_setup=functools.partial(setup, down_after_ms=DOWN_AFTER_MS),
                 auth={"cache_seconds": 2}, backend={"cap": CAP},
                 caps={"lease_seconds": CAP_LEASE},
                 rate_limits={"on_store_failure": modes, "lease_seconds": 120}) as c:
        servers: SentinelSet | ClusterSet = c.redis
        keys = [c.issue_key(name=f"k{i}") for i in range(4)]
        loaded = c.issue_key(limits={"requests_per_minute": RPM, "max_concurrent": 4})
        for url in c.urls:  # the loaded key in every gateway's cache; the others only in the store
            assert works(url, loaded)
        # the keys reached the replicas before the kill (replication is asynchronous)
        wait_for(servers.caught_up, 30, "replicas caught up")  # a loaded 2-core machine: generous
        bucket = f"llmgw:rl:{{key:{key_id_of(loaded)}}}:requests"
        backend = re.search(r"url: (http://\S+)", c.config.read_text()).group(1)
        served_before = served_at_backend(backend)
        looker = servers.client()

        async def run() -> tuple[list, float, float, float, float]:
            stop, log = asyncio.Event(), []
            task = asyncio.create_task(load(c.urls, loaded, stop, log))
            started = time.monotonic()
            # steady state first: the load has spent the key's bucket, admissions follow its refill (1 a second)
            while float(await asyncio.to_thread(looker.hget, bucket, "l") or RPM) >= 1:
                assert time.monotonic() - started < 60, "the load did not spend the key's bucket within 60 s"
                await asyncio.sleep(0.1)
            old = servers.primary(bucket)
            killed = time.monotonic()
            old.kill()
            while servers.primary(bucket).port == old.port:  # the set's verdict: promotion done
                assert time.monotonic() - killed < 30, "no promotion within 30 s"
                await asyncio.sleep(0.05)
            promoted = time.monotonic()
            await asyncio.sleep(RECOVERY)
            settled = await asyncio.to_thread(unavailable_total, c.urls)
            await asyncio.sleep(4)  # the load goes on: no gateway may miss the store any more
            stop.set()
            await task
            return log, started, killed, promoted, settled

        log, started, killed, promoted, settled = asyncio.run(run())
        ended = time.monotonic()
        # The bounds below hold for the one failover this test caused. A primary failed over while it still
        # served (judged down, not dead) takes writes that vanish when it is demoted: admissions forgotten,
        # releases forgotten. Say so, rather than as a count over the bound.
        assert servers.promotions() == 1, (
            f"{servers.promotions()} promotions, not the 1 this test caused: a live primary was judged down "
            f"(stalled over {DOWN_AFTER_MS} ms) and failed over while it served; the bounds do not hold then")
        assert unavailable_total(c.urls) == settled, "a gateway still could not reach the store 10 s after promotion"
        after = [entry for entry in log if entry[0] > promoted + RECOVERY]
        assert {url for _, url, _, _ in after} == set(c.urls) and {code for _, _, code, _ in after} <= {200, 429}

        window = [entry for entry in log if killed <= entry[0] <= promoted + RECOVERY]
        codes = [code for _, _, code, _ in log]
        if mode == "fail_open":
            assert {code for _, _, code, _ in window} <= {200, 429} and any(e[2] == 200 for e in window)
        else:
            assert set(codes) <= {200, 429, 503}
            refused = [e for e in log if e[2] == 503]
            assert all(killed <= t <= promoted + RECOVERY and int(retry) >= 1 for t, _, _, retry in refused)
        assert 0 not in codes  # no connection ever failed: the gateways stayed up

        # Counted where it matters, at the backend. The store-enforced bucket admits at most its capacity plus
        # its refill over the run; while the store is away, fail_open lets each gateway admit from its own full
        # bucket (and its refill) for the window. fail_closed admits nothing then. A killed primary's writes are
        # lost only when the kill falls between its reply and its write to the replicas (the same event-loop
        # turn; loopback delivers at once): microseconds, at an admission a second, so none is counted here.
        served = served_at_backend(backend) - served_before
        run_seconds, window_seconds = ended - started, promoted + RECOVERY - killed
        allowed = RPM + RPM * run_seconds / 60
        if mode == "fail_open":
            allowed += len(c.urls) * (RPM + RPM * window_seconds / 60)
        timeline = {}
        for t, _, code, _ in log:
            timeline.setdefault(round(t - killed), []).append(code)
        per_second = {s: (cs.count(200), cs.count(503)) for s, cs in sorted(timeline.items())}
        assert codes.count(200) <= served <= allowed, (served, allowed, codes.count(200), per_second)

        # no concurrency slot stays held once the load has stopped (releases retry until the new primary answers,
        # within 35 s of a 120 s lease), and no slot of the backend's cap (a give-back the store missed is sent
        # again until it answers; the wait allows for one the old primary took and never replicated, a lease
        # that runs out: CAP_LEASE)
        primary = servers.client()
        inflight = f"llmgw:rl:{{key:{key_id_of(loaded)}}}:inflight"  # an empty set is no key at all
        wait_for(lambda: primary.zcount(inflight, f"({time.time()}", "+inf") == 0, 35,
                 "every concurrency slot given back")
        wait_for(lambda: primary.zcount("llmgw:cap:{m-0}", f"({time.time()}", "+inf") == 0, CAP_LEASE + 15,
                 "every cap slot of the backend given back")

        for key in [*keys, loaded]:
            for url in c.urls:
                assert works(url, key), "a key issued before the kill no longer authenticates"
        assert "Traceback" not in c.log_text()


FULL_WITHIN = 3.0  # seconds after the promotion is observed: the backend is back at its full cap by then
SUSTAINED = 2.0  # ... and stays there this long
SLOW_BODY = {**BODY, "max_tokens": 10}  # 10 steps of 20 ms: each request holds its slot ~0.2 s


def running_at_backend(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)", text, re.M))


def full_service_after(samples: list[tuple[float, float]], promoted: float, full: int) -> float | None:
    """Seconds from the promotion to the first moment from which, for SUSTAINED seconds, at least 60% of the
    backend's samples show `full` requests running (a slot handed from one request to the next may be seen
    empty for an instant)."""
    after = [(t, n) for t, n in samples if t >= promoted]
    for i, (start, _) in enumerate(after):
        window = [n for t, n in after[i:] if t <= start + SUSTAINED]
        if after[-1][0] >= start + SUSTAINED and sum(n >= full for n in window) >= 0.6 * len(window):
            return start - promoted
    return None


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
def test_cap_slots_given_back_during_the_outage_are_freed_once_the_new_primary_answers(tmp_path, mode):
    """Requests holding the backend's whole cap finish while the primary is dead: their give-backs fail. They
    are sent again until the promoted replica (which has the leases) answers, so the backend is at its full cap
    within FULL_WITHIN s of the promotion, not one lease (15 s, the default) later; and no slot stays held.
    The load pauses from the kill to the promotion: requests admitted in fail_open meanwhile would take over
    the stranded leases (a process's leases are not tied to one request) and hide them."""
    workers = 2 * CAP  # always someone waiting for a slot: the backend runs at its cap when it can
    # DOWN_AFTER_MS, not less: at 1 s the promoted replica, stalled by the other's resync on a loaded machine, was
    # judged down in turn (two promotions in one run)
    sentinels = functools.partial(SentinelSet, down_after_ms=DOWN_AFTER_MS)
    with cluster(tmp_path, replicas=2, slow=True, redis_setup=sentinels, backend={"cap": CAP},
                 rate_limits={"on_store_failure": {"concurrency": mode}}) as c:
        servers: SentinelSet = c.redis
        key = c.issue_key(name="load")
        for url in c.urls:
            assert works(url, key)
        wait_for(servers.caught_up, 30, "replicas caught up")  # a loaded 2-core machine: generous

        async def run() -> tuple[list[tuple[float, float]], list[float], list, float, float, float]:
            stop, go, log, samples = asyncio.Event(), asyncio.Event(), [], []
            read_by: list[float] = []
            go.set()

            async def worker(n: int) -> None:
                async with httpx.AsyncClient(headers={"authorization": f"Bearer {key}"}, timeout=30) as http:
                    while not stop.is_set():
                        await go.wait()
                        r = await http.post(f"{c.urls[n % len(c.urls)]}/v1/chat/completions", json=SLOW_BODY)
                        log.append((time.monotonic(), r.status_code))
                        if r.status_code != 200:
                            await asyncio.sleep(0.05)

            async def sample() -> None:
                while not stop.is_set():
                    started = time.monotonic()
                    running = await asyncio.to_thread(running_at_backend, c.backend_url)
                    samples.append((started, running))
                    read_by.append(time.monotonic())  # a reading still on its way at the kill is not "before" it
                    await asyncio.sleep(0.05)

            tasks = [asyncio.create_task(worker(n)) for n in range(workers)] + [asyncio.create_task(sample())]
            await asyncio.sleep(2)  # steady: the cap full, waiters queued
            old = servers.primary()
            go.clear()  # what is in flight ends while the primary is dead
            # a live primary stalled past the client's timeouts (a loaded machine) lets fail_open admit past the cap
            stalled = await asyncio.to_thread(unavailable_total, c.urls)
            killed = time.monotonic()
            old.kill()
            while servers.primary().port == old.port:
                assert time.monotonic() - killed < 30, "no promotion within 30 s"
                await asyncio.sleep(0.05)
            promoted = time.monotonic()
            go.set()
            await asyncio.sleep(FULL_WITHIN + SUSTAINED + 1)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return samples, read_by, log, stalled, killed, promoted

        samples, read_by, log, stalled, killed, promoted = asyncio.run(run())
        assert servers.promotions() == 1
        # a reading answered after the kill may count waiters that fail_open admitted past the cap (by design)
        before = [n for (t, n), done in zip(samples, read_by) if done < killed]
        assert CAP in before, before  # the load did fill the cap before the kill
        assert max(before) == CAP or (mode == "fail_open" and stalled), (before, stalled)  # and held it
        took = full_service_after(samples, promoted, CAP)
        timeline = [(round(t - promoted, 2), n) for t, n in samples if t >= killed]
        assert took is not None and took <= FULL_WITHIN, (took, timeline)
        assert {code for _, code in log} <= {200, 503}
        assert not [t for t, code in log if code == 503 and t > promoted + FULL_WITHIN]
        # and once the load stops, no lease is left in the store: every slot came back (none waits out a lease)
        primary = servers.client()
        wait_for(lambda: primary.zcount("llmgw:cap:{m-0}", f"({time.time()}", "+inf") == 0, 3,
                 "every cap slot of the backend given back")
        assert "Traceback" not in c.log_text()
