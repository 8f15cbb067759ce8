"""A batch shared by two `llm-gateway serve` processes on one real redis-server over the vLLM simulator: both run
its lines, one is killed mid-batch (its claimed lines go to the other once their claims expire), and a gateway
stopped mid-batch and started again resumes where it stopped. Every line is answered exactly once; after a
graceful restart the backend saw every line exactly once too."""

from __future__ import annotations

import io
import json
import subprocess
import time

import httpx
import openai
import pytest

from tests.support.cluster import CLI, cluster
from tests.support.probes import metric_sum, wait_http_ok
from tests.support.servers import free_port, stop_processes

DEADLINE = 120  # seconds for a batch of tens of lines on a loaded 2-core machine


def jsonl(count: int, prefix: str) -> bytes:
    return b"".join(json.dumps({"custom_id": f"{prefix}-{n}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "m", "messages": [{"role": "user", "content": f"line {n}"}],
                                         "max_tokens": 12}}).encode() + b"\n" for n in range(count))


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s")


def backend_successes(url: str) -> float:
    return metric_sum(httpx.get(f"{url}/metrics", timeout=10).text, "vllm:request_success_total")


def lines_sent(url: str) -> float:
    return metric_sum(httpx.get(f"{url}/metrics", timeout=10).text, "llm_gateway_requests_total",
                      endpoint="chat/completions")


def exactly_once(sdk: openai.OpenAI, batch, count: int, prefix: str) -> None:
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (count, count,
                                                                                                        0)
    out = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"{prefix}-{n}" for n in range(count))
    assert all(o["response"]["status_code"] == 200 for o in out)


def submitted(sdk: openai.OpenAI, count: int, prefix: str):
    uploaded = sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(count, prefix))), purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def done(sdk: openai.OpenAI, batch_id: str):
    return wait_for(lambda: (b := sdk.batches.retrieve(batch_id)).status not in (
        "validating", "in_progress", "finalizing") and b, DEADLINE, f"batch {batch_id} ends")


@pytest.fixture
def pair(tmp_path):
    batch = {"files_dir": str(tmp_path / "files"), "claim_seconds": 3, "poll_seconds": 0.2, "concurrency": 4}
    with cluster(tmp_path, replicas=2, slow=True, batch=batch, server={"drain_seconds": 0.2}) as c:
        yield c


def test_two_replicas_share_a_batch_and_a_killed_ones_lines_are_run_by_the_other(pair):
    one, two = pair.urls
    sdk = openai.OpenAI(base_url=f"{one}/v1", api_key=pair.issue_key(name="batch"), max_retries=2, timeout=30)
    batch = submitted(sdk, 80, "k")
    wait_for(lambda: lines_sent(one) >= 2 and lines_sent(two) >= 2, DEADLINE, "both replicas run lines")
    assert sdk.batches.retrieve(batch.id).status == "in_progress"
    pair.gateways[1].kill()  # no goodbye: its claims expire (claim_seconds) and the other replica takes them
    pair.gateways[1].wait(10)
    exactly_once(sdk, done(sdk, batch.id), 80, "k")


def test_a_gateway_stopped_mid_batch_resumes_it_when_started_again(pair, tmp_path):
    one = pair.urls[0]
    key = pair.issue_key(name="restart")
    sdk = openai.OpenAI(base_url=f"{one}/v1", api_key=key, max_retries=2, timeout=30)
    before = backend_successes(pair.backend_url)
    batch = submitted(sdk, 60, "r")
    wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 6, DEADLINE, "lines answered")
    for proc in pair.gateways:  # both stopped gracefully: lines in flight finish, nothing more is claimed
        proc.terminate()
    for proc in pair.gateways:  # lines in flight get their grace, then the drain its bound: slow on a loaded machine
        try:
            assert proc.wait(90) == 0
        except subprocess.TimeoutExpired:
            pytest.fail(f"a gateway did not exit within 90 s of SIGTERM; the logs end:\n{pair.log_text()[-6000:]}")
    stopped = backend_successes(pair.backend_url) - before
    assert 6 <= stopped < 60, pair.log_text()[-6000:]
    port = free_port()
    with open(tmp_path / "restarted.log", "wb") as log:
        restarted = subprocess.Popen([CLI, "serve", "--config", str(pair.config), "--port", str(port)],
                                     env=pair.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/ready", restarted, 90, "the restarted gateway")
        again = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2, timeout=30)
        exactly_once(again, done(again, batch.id), 60, "r")
        ran = backend_successes(pair.backend_url) - before
        assert ran == 60, (ran, pair.log_text()[-6000:])  # no line ran twice, none was lost (a shutdown step cut
        # short, gateway/http/shutdown.py, is logged there)
    finally:
        stop_processes([restarted])
