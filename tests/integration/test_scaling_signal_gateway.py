"""The replicas-needed signal through real gateways on the simulator: on a load ramp from zero through twice one
replica's knee and back it rises before vLLM's own waiting count does (which, behind a cap at the knee, never
rises at all), and falls back to 0; two gateways on one Redis both report the fleet's demand."""

from __future__ import annotations

import asyncio
import time

import httpx

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from tests.integration.test_policy_reload import until
from tests.support.gateway import AUTH, running_gateway
from tests.support.probes import metric_sum
from tests.support.redis_fixtures import redis_prefix, redis_server, redis_standalone  # noqa: F401
from tests.support.servers import serve_app

KNEE = 8  # the gateway's cap: the knee a sweep would have measured
# vLLM's batch limit above the knee, as its default (256) is above an H200's knee (64-128): its queue forms
# only past it. 16-token answers of ~0.2 s.
SIM = SimConfig(model="served", max_num_seqs=32, step_base_ms=10)
RAMP = [0, 4, KNEE, 2 * KNEE, 5 * KNEE, 2 * KNEE, 0]  # offered concurrency, one level per STEP seconds
STEP = 2.5


class Ramp:
    """Closed-loop streaming clients, as many as the current level: extra ones stop after their request."""

    def __init__(self, http: httpx.AsyncClient, url: str, model: str, headers: dict | None = None) -> None:
        self.http, self.url, self.model, self.headers = http, url, model, headers or {}
        self.level, self.workers, self.failures, self.done = 0, [], [], 0

    async def worker(self, index: int) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                "stream": True}
        for _ in range(10_000):  # bounded even if the test forgets to stop it
            if index >= self.level:
                return
            try:
                async with self.http.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                                            headers=self.headers) as r:
                    await r.aread()
                if r.status_code != 200:
                    self.failures.append(r.status_code)
                self.done += 1
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))

    def set(self, level: int) -> None:
        self.workers = [w for w in self.workers if not w.done()]
        running = len(self.workers)
        self.level = level
        self.workers += [asyncio.create_task(self.worker(i)) for i in range(running, level)]

    async def stop(self) -> None:
        self.level = 0
        await asyncio.gather(*self.workers)


async def sample_ramp(ramp: Ramp, sample, levels=RAMP, step=STEP) -> list[tuple[float, int, dict]]:
    """Run the ramp's `levels`, `step` seconds each; every 0.1 s record (seconds since start, the level,
    `sample()`)."""
    samples, start = [], time.monotonic()
    for level in levels:
        ramp.set(level)
        until_next = time.monotonic() + step
        while time.monotonic() < until_next:
            samples.append((time.monotonic() - start, level, await sample()))
            await asyncio.sleep(0.1)
    await ramp.stop()
    return samples


def first(samples, predicate) -> tuple[float, int] | None:
    return next(((t, level) for t, level, s in samples if predicate(s)), None)


async def test_on_a_ramp_the_signal_rises_before_vllms_waiting_count_and_falls_back():
    async with serve_app(simulator(SIM)) as sim, httpx.AsyncClient(timeout=60) as http:
        async def waiting() -> float:
            return metric_sum((await http.get(f"{sim}/metrics")).text, "vllm:num_requests_waiting")

        # vLLM alone, as an autoscaler on its waiting count sees it
        direct = await sample_ramp(Ramp(http, f"{sim}", "served"), lambda: read_all(waiting=waiting))
        policy = {"models": [{"name": "m", "served_name": "served", "backends": [{"url": sim, "cap": KNEE}],
                              "autoscaling": {"headroom": 0.1, "smoothing_seconds": 1}}],
                  "health": {"interval": 0.5}}
        async with running_gateway(policy) as gw:
            ramp = Ramp(http, gw.url, "m", AUTH)

            async def both() -> dict:
                return {"waiting": await waiting(), "needed": gw.state.scaling.view("m")["needed"]}

            through = await sample_ramp(ramp, both)
            assert not ramp.failures, ramp.failures[:5]
            await until(lambda: gw.state.scaling.view("m")["needed"] == 0, 20)  # and back: 0 once the demand is gone
    vllm_waits = first(direct, lambda s: s["waiting"] > 0)
    signal_two = first(through, lambda s: s["needed"] >= 2)
    peak = max(s["needed"] for _, _, s in through)
    print(f"\nramp {RAMP} x {STEP} s: the signal said 2 replicas at {signal_two}; vLLM alone first waited at"
          f" {vllm_waits}; behind the gateway vLLM's waiting peaked at {max(s['waiting'] for _, _, s in through)};"
          f" the signal peaked at {peak}")
    assert signal_two is not None and signal_two[1] <= 2 * KNEE  # it asks for a second replica by 2x the knee
    assert vllm_waits is not None and vllm_waits[1] > 2 * KNEE  # vLLM alone waits only past its batch limit
    assert signal_two[0] < vllm_waits[0]  # the lead
    assert max(s["waiting"] for _, _, s in through) == 0  # behind a cap at the knee its waiting never rises
    assert peak >= 5  # 40 offered at a cap of 8 with 10% headroom


async def read_all(**named) -> dict:
    return {name: await probe() for name, probe in named.items()}


async def test_two_gateways_on_one_redis_both_report_the_fleets_demand(redis_server, redis_prefix):  # noqa: F811
    async with serve_app(simulator(SimConfig(model="served", step_base_ms=50))) as sim, \
            httpx.AsyncClient(timeout=60) as http:
        policy = {"store": {"kind": "redis", "url": redis_server.url, "prefix": redis_prefix},
                  "models": [{"name": "m", "served_name": "served", "backends": [{"url": sim, "cap": 2}],
                              "autoscaling": {"headroom": 0, "smoothing_seconds": 0}}],
                  "health": {"interval": 0.5}}
        async with running_gateway(policy) as a, running_gateway(policy, issue_test_key=False) as b:
            ramps = [Ramp(http, g.url, "m", AUTH) for g in (a, b)]
            for ramp in ramps:
                ramp.set(3)  # 6 in all at a fleet cap of 2: 2 in flight, 4 queued, 3 replicas needed
            try:
                deadline = time.monotonic() + 20
                while True:
                    views = [(await http.get(f"{g.url}/scaling")).json() for g in (a, b)]
                    if all(v["models"]["m"]["demand"] == 6 for v in views):
                        break
                    assert time.monotonic() < deadline, views
                    await asyncio.sleep(0.2)
            finally:
                for ramp in ramps:
                    await ramp.stop()
            for ramp in ramps:
                assert not ramp.failures, ramp.failures[:5]
    for view in views:
        assert view["fleet"] is True and view["models"]["m"]["needed"] == 3
        assert view["models"]["m"]["in_flight"] + view["models"]["m"]["queued"] == 3  # each its own share
