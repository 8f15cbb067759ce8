"""A batch line gives its slot back the moment interactive work needs it (policies/preemption.py): on the vLLM
simulator behind a real gateway, a backend of cap 2 with no reserve (`queue.reserve: 0`) and a batch whose slow
lines fill both slots, an interactive call is admitted within a fraction of a line's time: the youngest line is
stopped (its upstream request aborted), runs again once the slot is free, and is answered exactly once, in full;
`llm_gateway_batch_preemptions_total` counts it; the same with the caps counted in a real redis-server. With
`batch.preempt: false` the same call waits for a line to end."""

from __future__ import annotations

import io
import json

import httpx
import openai
import pytest
from openai.types import Batch

from tools.simulator import SimConfig, create_app
from tests.integration.test_batch_reserve import Counting, finished, until
from tests.support.gateway import TEST_KEY, running_gateway
from tests.support.probes import metric_sum
from tests.support.redis_fixtures import redis_prefix, redis_server, redis_standalone  # noqa: F401
from tests.support.servers import serve_app

# a batch line answers in 60 steps of 40 ms (2.4 s): a call that waits for one to end waits most of that
SIM = SimConfig(model="served-m", step_base_ms=40, step_ms_per_seq=0)
LINE_TOKENS = 60
LINES = 4
AT_ONCE = 0.5  # seconds: a preempted line's slot is free within a few ms, yet a loaded machine's loop may stall


def lines(count: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "m", "max_tokens": LINE_TOKENS, "ignore_eos": True,
                                         "messages": [{"role": "user", "content": f"batch line {n}"}]}}).encode()
                    + b"\n" for n in range(count))


async def submitted(sdk: openai.AsyncOpenAI, count: int) -> Batch:
    uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(lines(count))), purpose="batch")
    return await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")


def policy(backend: str, tmp_path, preempt: bool) -> dict:
    return {"models": [{"name": "m", "served_name": "served-m", "queue": {"reserve": 0},
                        "backends": [{"url": backend, "cap": 2}]}],
            "health": {"interval": 0.2, "backoff_initial": 0.2, "backoff_max": 1},
            "batch": {"files_dir": str(tmp_path / "files"), "poll_seconds": 0.1, "concurrency": 2,
                      "max_in_flight": 2, "preempt": preempt}}


async def preempting(tmp_path, preempt: bool, **extra) -> None:
    """The batch fills both slots, one interactive call comes; every line is answered once, in full."""
    backend = Counting(create_app(SIM))
    async with serve_app(backend) as url, running_gateway({**policy(url, tmp_path, preempt), **extra}) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=60) as sdk:
        batch = await submitted(sdk, LINES)
        await until(lambda: backend.now["batch"] == 2, 30, "the batch never filled both slots")
        raw = await sdk.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "now"}], max_tokens=2)
        waited = float(raw.headers["x-gateway-queue-ms"]) / 1000
        assert raw.parse().choices[0].message.content  # answered in full
        done = await finished(sdk, batch.id)
        output = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()] \
            if done.output_file_id else []
        async with httpx.AsyncClient(timeout=30) as http:
            metrics = (await http.get(f"{gw.url}/metrics")).text
            engine = (await http.get(f"{url}/metrics")).text
    preempted = metric_sum(metrics, "llm_gateway_batch_preemptions_total", model="m")
    aborted = metric_sum(engine, "vllm:request_success_total", finished_reason="abort")
    # every line answered once, in full: a preempted one ran again, never into the error file
    assert done.status == "completed" and done.request_counts.completed == LINES and \
        done.request_counts.failed == 0 and done.error_file_id is None, done
    assert sorted(o["custom_id"] for o in output) == [f"line-{n}" for n in range(LINES)]
    assert all(o["response"]["status_code"] == 200 and
               o["response"]["body"]["usage"]["completion_tokens"] == LINE_TOKENS for o in output), output
    if preempt:
        assert waited < AT_ONCE, waited  # a line's slot, not its end
        assert preempted == 1  # one waiting request, one line stopped
        assert aborted == 1  # its upstream connection closed: the engine aborted the request
    else:
        assert waited > AT_ONCE, waited  # it waited for a line to end (~2.4 s)
        assert preempted == 0 and aborted == 0
    assert backend.peak["batch"] == 2 and backend.now["batch"] == 0


@pytest.mark.parametrize("preempt", [True, False], ids=["preempt", "no-preempt"])
async def test_an_interactive_call_takes_a_batch_lines_slot_at_once_and_the_line_is_answered_once(tmp_path, preempt):
    await preempting(tmp_path, preempt)


async def test_with_caps_counted_in_redis_the_lines_slot_goes_to_the_waiting_call(tmp_path, redis_server,  # noqa: F811
                                                                                 redis_prefix):  # noqa: F811
    """The slot's lease goes back to Redis and to the claim first in line there: the waiting interactive call's."""
    await preempting(tmp_path, True, store={"kind": "redis", "url": redis_server.url, "prefix": redis_prefix})
