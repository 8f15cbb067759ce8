"""Own or rent, answered from real traffic: a known workload through a real gateway, then its report.

The owned backend is a simulator (20 ms a token) capped at 2 in flight with a declared hourly price and power
draw; the rented provider is the stand-in process. The test keeps its own counts (tokens from each reply,
owned or rented from the reply's header, busy time as the union of its own owned requests' intervals) and
the report must agree with them within 2%; a restarted gateway on the same file reports the same.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from pathlib import Path

import httpx
import pytest

from tools.simulator import SimConfig, create_app
from gateway.admin.auth import mint_token
from policies.config import Admin
from policies.keys import KeyBudget
from tests.integration.test_overflow import issue, standin  # noqa: F401 - the stand-in provider fixture
from tests.support.cluster import cluster
from tests.support.gateway import running_gateway
from tests.support.rented_standin import read_log
from tests.support.servers import serve_app

CLI = str(Path(sys.executable).with_name("llm-gateway"))
SLOW = SimConfig(model="served-m", step_base_ms=20, step_ms_per_seq=0)
SECRET = "r" * 40
PER_HOUR, POWER_KW, KWH = 36.0, 0.5, 0.2  # 36.1 an hour: 0.01003 a second
PROMPT_PRICE, COMPLETION_PRICE = 1.0, 2.0


def policy(owned: str, rented: str, db: Path) -> dict:
    return {
        "store": {"kind": "sqlite", "path": str(db)},
        "ledger": {"bucket_seconds": 1, "flush_seconds": 0.05, "power_price_per_kwh": KWH,
                   "report_every_seconds": 1},
        "providers": [{"name": "standin", "base_url": rented, "api_key_env": "STANDIN_KEY",
                       "models": {"m": "rented-model"}, "allow_private_address": True,
                       "price_per_million_tokens": {"input": PROMPT_PRICE, "output": COMPLETION_PRICE}}],
        "models": [{"name": "m", "served_name": "served-m",
                    "backends": [{"url": owned, "cap": 2, "name": "gpu-0",
                                  "cost": {"per_hour": PER_HOUR, "power_kw": POWER_KW}}],
                    "queue": {"max_depth": 100, "max_wait": 30},
                    "overflow": {"provider": "standin", "when_wait_exceeds": 0.2}}],
    }


def timed(app, spans: list[tuple[float, float]]):
    """The backend's app, noting when each completion request reached it and when its answer was sent."""
    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("/completions"):
            return await app(scope, receive, send)
        started = time.time()

        async def noting(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                spans.append((started, time.time()))

        return await app(scope, receive, noting)

    return wrapped


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


async def test_report_matches_the_workload_and_survives_a_restart(standin, monkeypatch, tmp_path):  # noqa: F811
    rented_url, _log, _ = standin
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer')}"}
    db = tmp_path / "gateway.db"
    owned_spans: list[tuple[float, float]] = []  # as the owned backend saw its requests
    client_spans: list[tuple[float, float]] = []  # as the client saw the owned ones
    counts = {"owned": [0, 0, 0], "rented": [0, 0, 0]}  # requests, prompt, completion

    async with serve_app(timed(create_app(SLOW), owned_spans)) as owned, \
            running_gateway(policy(owned, rented_url, db)) as gw, \
            httpx.AsyncClient(timeout=60) as http:
        renter, private = await issue(gw, "allow_rented"), await issue(gw, "private_only")

        async def send(key: str, max_tokens: int) -> None:
            started = time.time()
            r = await http.post(f"{gw.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                json={"model": "m", "messages": [{"role": "user", "content": "hello there"}],
                                      "max_tokens": max_tokens, "ignore_eos": True})
            assert r.status_code == 200, r.text
            where = r.headers["x-gateway-served-by"]
            usage = r.json()["usage"]
            counts[where][0] += 1
            counts[where][1] += usage["prompt_tokens"]
            counts[where][2] += usage["completion_tokens"]
            if where == "owned":
                client_spans.append((started, time.time()))

        since = math.floor(time.time())
        await asyncio.gather(*(send(renter, 80) for _ in range(4)))  # cap 2: two spill to the rented provider
        await asyncio.sleep(1.0)  # an idle second
        for _ in range(3):
            await send(private, 40)
        until = math.ceil(time.time()) + 1
        while time.time() < until:
            await asyncio.sleep(0.05)
        assert counts["owned"][0] >= 5 and counts["rented"][0] >= 1
        assert len(owned_spans) == len(client_spans) == counts["owned"][0]

        r = await http.get(f"{gw.url}/admin/report", params={"window": until - since, "until": until},
                           headers=viewer)
        assert r.status_code == 200, r.text
        report = r.json()
        m = report["models"]["m"]
        window = until - since
        assert report["window_seconds"] == window
        owned_tokens = counts["owned"][1] + counts["owned"][2]
        owned_cost = (PER_HOUR + POWER_KW * KWH) * window / 3600
        at_rented = (counts["owned"][1] * PROMPT_PRICE + counts["owned"][2] * COMPLETION_PRICE) / 1e6
        rented_cost = (counts["rented"][1] * PROMPT_PRICE + counts["rented"][2] * COMPLETION_PRICE) / 1e6
        assert m["owned"]["requests"] == counts["owned"][0] and m["rented"]["requests"] == counts["rented"][0]
        assert m["owned"]["prompt_tokens"] == counts["owned"][1]
        assert m["owned"]["completion_tokens"] == counts["owned"][2]
        assert m["owned_cost"] == pytest.approx(owned_cost, rel=0.02)
        assert m["owned_cost_per_million_tokens"] == pytest.approx(owned_cost / owned_tokens * 1e6, rel=0.02)
        assert m["owned_tokens_at_rented_price"] == pytest.approx(at_rented, rel=0.02)
        assert m["rented"]["cost"] == pytest.approx(rented_cost, rel=0.02)
        assert m["rent_all_cost"] == pytest.approx(at_rented + rented_cost, rel=0.02)
        assert m["utilisation"] == pytest.approx(union(owned_spans) / window, rel=0.02)
        busy_share = sum(b - a for a, b in owned_spans) / window  # the average in flight
        assert m["backends"][0]["average_in_flight"] == pytest.approx(busy_share, rel=0.02)
        assert m["backends"][0]["in_flight_vs_cap"] == pytest.approx(busy_share / 2, rel=0.02)
        assert 0 < m["utilisation"] < 1 and m["burstiness"] > 1
        # tiny traffic on an expensive GPU: renting wins, and the reason carries the numbers
        assert m["recommendation"]["verdict"].startswith("rent") and "utilisation" in m["recommendation"]["reason"]
        assert sum(p["requests"] for p in m["series"]) == counts["owned"][0] + counts["rented"][0]

        # the same figures for the dashboard (an hour's window, recomputed every second here): until a
        # recomputation after the last call (the last may have run just before it ended, on a slow machine)
        deadline = time.monotonic() + 10
        while True:  # bounded: the deadline
            gauge = await gw.metric("llm_gateway_rent_all_cost", model="m")
            if await gw.metric("llm_gateway_owned_cost_per_million_tokens", model="m") > 0 and \
                    gauge == pytest.approx(m["rent_all_cost"], rel=0.02):
                break
            assert time.monotonic() < deadline, f"the own-vs-rent gauges say {gauge}, not {m['rent_all_cost']}"
            await asyncio.sleep(0.1)

        # a viewer may read the report but nothing else changes; no token at all: 401
        assert (await http.get(f"{gw.url}/admin/report")).status_code == 401
        bad = await http.get(f"{gw.url}/admin/report", params={"window": 0}, headers=viewer)
        assert bad.status_code == 400 and "window" in bad.json()["error"]["message"]

    # a restarted gateway on the same file reads the same ledger
    async with serve_app(create_app(SLOW)) as owned, running_gateway(policy(owned, rented_url, db),
                                                                     issue_test_key=False) as gw, \
            httpx.AsyncClient(timeout=60) as http:
        r = await http.get(f"{gw.url}/admin/report", params={"window": until - since, "until": until},
                           headers=viewer)
        assert r.status_code == 200, r.text
        again = r.json()["models"]["m"]
        for field in ("owned", "rented", "owned_cost", "utilisation", "rent_all_cost", "burstiness"):
            assert again[field] == m[field], field

        # the CLI: a table for people, JSON for scripts, and the chart
        png = tmp_path / "own-or-rent.png"
        args = ["report", "--url", gw.url, "--token", viewer["authorization"].split()[1],
                "--window", str(until - since), "--until", str(until)]
        code, out, err = await cli(*args, "--png", str(png))
        assert code == 0, err
        assert "RECOMMENDATION" in out and "m: rent" in out and "gpu-0: busy" in out
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
        code, out, _ = await cli(*args, "--json")
        assert code == 0 and json.loads(out)["models"]["m"]["owned"] == m["owned"]


async def test_a_stop_writes_what_the_ledger_had_not_flushed_yet(standin, monkeypatch, tmp_path):  # noqa: F811
    """With a flush interval longer than the test, only the shutdown's flush can have written the calls."""
    rented_url, _log, _ = standin
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer')}"}
    db = tmp_path / "gateway.db"
    async with serve_app(create_app(SLOW)) as owned:
        config = policy(owned, rented_url, db)
        config["ledger"].update(flush_seconds=60, report_every_seconds=3600)
        async with running_gateway(config) as gw, httpx.AsyncClient(timeout=60) as http:
            key = await issue(gw, "private_only")
            for _ in range(3):
                r = await http.post(f"{gw.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 3, "ignore_eos": True})
                assert r.status_code == 200, r.text
            assert await gw.state.ledger.read(0, time.time() + 60) == []  # nothing written yet
        async with running_gateway(config, issue_test_key=False) as gw, httpx.AsyncClient(timeout=60) as http:
            r = await http.get(f"{gw.url}/admin/report", params={"window": 600}, headers=viewer)
            assert r.status_code == 200, r.text
            assert r.json()["models"]["m"]["owned"]["requests"] == 3


def test_utilisation_with_three_replicas_counts_overlapping_calls_once(tmp_path):
    """Three `llm-gateway serve` replicas on one real Redis send one call each to the same backend at once:
    the backend was busy for the union of the three, not three times it."""
    ledger = {"bucket_seconds": 1, "flush_seconds": 0.05, "report_every_seconds": 3600}
    with cluster(tmp_path, replicas=3, slow=True, backend={"cap": 4, "cost": {"per_hour": 1.0}},
                 ledger=ledger) as c:
        key = c.issue_key()
        spans: dict[str, list[tuple[float, float]]] = {url: [] for url in c.urls}  # per replica

        async def send(url: str, http: httpx.AsyncClient) -> None:
            started = time.time()
            r = await http.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 30, "ignore_eos": True})
            assert r.status_code == 200, r.text
            spans[url].append((started, time.time()))

        async def workload() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                for _ in range(3):
                    await asyncio.gather(*(send(url, http) for url in c.urls))
                    await asyncio.sleep(0.3)

        since = math.floor(time.time())
        asyncio.run(workload())
        until = math.ceil(time.time()) + 1
        while time.time() < until:
            time.sleep(0.05)
        r = httpx.get(f"{c.urls[0]}/admin/report", params={"window": until - since, "until": until},
                      headers={"authorization": f"Bearer {c.admin_token}"}, timeout=30)
        assert r.status_code == 200, r.text
        m = r.json()["models"]["m"]
        window = until - since
        union_share = union([span for mine in spans.values() for span in mine]) / window
        summed = sum(union(mine) for mine in spans.values()) / window  # what adding each replica's busy time says
        assert m["owned"]["requests"] == 9 and summed > 2 * union_share
        # the gateway times each call from sending it to its end, inside the client's span of it, which adds the
        # gateway's own work before sending (the key, the limits and the cap on one Redis for three replicas): 0.46
        # against 0.48 on a quiet run, where the sums said 1.44; 0.37 against 0.60 on a 2-core machine running four
        # test files beside it. Counted once: never above the union, and nowhere near the sum.
        assert 0.5 * union_share <= m["utilisation"] <= 1.03 * union_share, (m["utilisation"], union_share, summed)


async def cli(*args: str) -> tuple[int, str, str]:
    """`llm-gateway ...` as a process, while this event loop keeps serving the gateway it talks to."""
    proc = await asyncio.create_subprocess_exec(CLI, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode, out.decode(), err.decode()


async def test_embedded_budget_stops_spilling_and_survives_a_restart(standin, tmp_path):  # noqa: F811
    """One gateway on SQLite: the budget's counters live in the process and start from the ledger."""
    rented_url, log, _ = standin
    db = tmp_path / "gateway.db"
    per_rented = (11 * PROMPT_PRICE + 5 * COMPLETION_PRICE) / 1e6  # what the stand-in reports, at its price
    budget = 2.5 * per_rented
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 60}], "max_tokens": 10, "ignore_eos": True}
    config = policy("", rented_url, db)
    config["models"][0]["overflow"]["when_wait_exceeds"] = 0.05
    config["models"][0]["backends"][0]["cap"] = 1

    async def burst(url: str, key: str) -> list[str]:
        async with httpx.AsyncClient(timeout=60) as http:
            replies = await asyncio.gather(*(http.post(f"{url}/v1/chat/completions", json=body,
                                                       headers={"authorization": f"Bearer {key}"})
                                             for _ in range(4)))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.headers["x-gateway-served-by"] for r in replies]

    async with serve_app(create_app(SLOW)) as owned:
        config["models"][0]["backends"][0]["url"] = owned
        async with running_gateway(config) as gw:
            key = await issue(gw, "allow_rented")
            record = await gw.state.store.get_key(key.split("-")[1])
            await gw.state.store.put_key(record.model_copy(update={"budget": KeyBudget(max_rented_spend=budget)}))
            rented = 0
            for _ in range(20):
                spilled = (await burst(gw.url, key)).count("rented")
                rented += spilled
                if spilled == 0 and rented * per_rented >= budget:
                    break
            assert budget <= rented * per_rented <= budget + per_rented
            assert len(read_log(log)) == rented
        async with running_gateway(config, issue_test_key=False) as gw:  # restarted: the spend is remembered
            assert await burst(gw.url, key) == ["owned"] * 4
            assert len(read_log(log)) == rented
