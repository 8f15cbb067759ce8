"""The replicas-needed signal against a real CPU vLLM: on a ramp from zero through six times one replica's cap and
back, it asks for a second replica before vLLM's own waiting count rises (vLLM alone, on the same ramp, first
queues past its batch limit; behind the gateway's cap it never does), and falls back to 0.

On the sweeps' server (conftest.capped_vllm: `--max-num-seqs 8`, its batch limit, above the knee as vLLM's default
256 is above an H200's; priority scheduling, which serves requests that name no priority in arrival order), with
the gateway capping it at 2. Marked `sweep`: it loads the server alone, before the shared servers start.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import CAPPED_ARGS
from tests.integration.test_policy_reload import until
from tests.integration.test_scaling_signal_gateway import Ramp, first, read_all, sample_ramp
from tests.support.gateway import AUTH, running_gateway
from tests.support.probes import metric_sum

CAP, BATCH = 2, 8
LEVELS = [0, 1, CAP, 2 * CAP, 6 * CAP, 2 * CAP, 0]
STEP = 4.0


@pytest.mark.sweep
async def test_the_signal_leads_a_real_vllms_waiting_count(capped_vllm):
    assert CAPPED_ARGS[-2:] == ("--max-num-seqs", str(BATCH))
    await ramp_both(capped_vllm.base_url, capped_vllm.served_model_name)


async def ramp_both(vllm: str, served: str) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        async def waiting() -> float:
            return metric_sum((await http.get(f"{vllm}/metrics")).text, "vllm:num_requests_waiting")

        alone = Ramp(http, vllm, served)
        direct = await sample_ramp(alone, lambda: read_all(waiting=waiting), LEVELS, STEP)
        policy = {"models": [{"name": "m", "served_name": served, "backends": [{"url": vllm, "cap": CAP}],
                              "autoscaling": {"headroom": 0.1, "smoothing_seconds": 1}}],
                  "health": {"interval": 1}, "timeouts": {"read": 120}}
        async with running_gateway(policy) as gw:
            ramp = Ramp(http, gw.url, "m", AUTH)

            async def both() -> dict:
                return {"waiting": await waiting(), "needed": gw.state.scaling.view("m")["needed"]}

            through = await sample_ramp(ramp, both, LEVELS, STEP)
            await until(lambda: gw.state.scaling.view("m")["needed"] == 0, 30)
    assert not alone.failures and not ramp.failures, (alone.failures[:3], ramp.failures[:3])
    vllm_waits = first(direct, lambda s: s["waiting"] > 0)
    signal_two = first(through, lambda s: s["needed"] >= 2)
    behind = max(s["waiting"] for _, _, s in through)
    print(f"\nreal vLLM (--max-num-seqs {BATCH}), cap {CAP}, ramp {LEVELS} x {STEP} s: the signal said 2 replicas at"
          f" {signal_two}; vLLM alone first waited at {vllm_waits}; behind the gateway vLLM's waiting peaked at"
          f" {behind}; the signal peaked at {max(s['needed'] for _, _, s in through)}; requests {alone.done} direct,"
          f" {ramp.done} through")
    assert signal_two is not None and signal_two[1] <= 2 * CAP
    assert vllm_waits is not None and vllm_waits[1] > 2 * CAP
    assert signal_two[0] < vllm_waits[0]
    assert behind == 0
