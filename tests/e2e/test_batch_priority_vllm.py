"""A batch line's own vLLM `priority` on a real CPU vLLM that schedules by priority (`--scheduling-policy priority`,
`--max-num-seqs 1`, so it runs one request at a time and picks the next by priority): a key with client_priority
sends a batch line at `priority: -100`; the gateway keeps it within the batch class's range, so vLLM serves the
interactive requests waiting beside it first, the one that arrived after it too."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import alone_on_core0, gateway_process
from tests.e2e.vllm_procs import VLLMServer, free_port

DEADLINE = 240  # seconds: a few hundred tokens, one request at a time, on a loaded CPU core
LONG = 450  # tokens of each interactive request queued before the batch line (the model's length is 512)


@pytest.fixture(scope="module")
def priority_vllm(tmp_path_factory):
    """A vLLM that schedules by priority, one sequence at a time, alone on core 0."""
    with alone_on_core0(tmp_path_factory, "tiny-prio", ("--scheduling-policy", "priority", "--max-num-seqs", "1")) \
            as server:
        yield server


def waiting(server: VLLMServer) -> float:
    return server.metric("vllm:num_requests_waiting")


def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.sweep  # a vLLM of its own alone on core 0: runs with the sweeps, before the shared servers start
def test_a_batch_lines_own_priority_never_goes_ahead_of_interactive_work(priority_vllm, tmp_path: Path):
    policy = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "health": {"interval": 1, "backoff_initial": 0.5, "backoff_max": 2},
        "timeouts": {"connect": 2, "read": DEADLINE},
        "models": [{"name": "prio", "served_name": "tiny-prio",
                    "backends": [{"url": priority_vllm.base_url, "cap": 8, "scheduling_policy": "priority"}]}],
        "batch": {"files_dir": str(tmp_path / "files"), "poll_seconds": 0.1},
    }
    with gateway_process(policy, tmp_path) as gw:
        created = httpx.post(f"{gw.url}/admin/keys", json={"name": "picks", "client_priority": True},
                             headers={"authorization": f"Bearer {gw.admin_token()}"}, timeout=30)
        assert created.status_code in (200, 201), created.text
        key = created.json()["key"]
        done: dict[str, float] = {}

        def chat(name: str, tokens: int) -> None:
            r = httpx.post(f"{gw.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                           json={"model": "prio", "max_tokens": tokens, "ignore_eos": True,
                                 "messages": [{"role": "user", "content": name}]}, timeout=DEADLINE)
            assert r.status_code == 200, r.text
            done[name] = time.monotonic()

        threads = []
        for n in range(3):  # one runs, two wait in vLLM's queue at the interactive class's priority
            threads.append(threading.Thread(target=chat, args=(f"long {n}", LONG)))
            threads[-1].start()
        until(lambda: waiting(priority_vllm) >= 2, 60, "vLLM never queued the interactive requests")
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=60) as sdk:
            line = {"custom_id": "urgent?", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "prio", "max_tokens": 8, "ignore_eos": True, "priority": -100,
                             "messages": [{"role": "user", "content": "batch line"}]}}
            uploaded = sdk.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")),
                                        purpose="batch")
            batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
            until(lambda: waiting(priority_vllm) >= 3, 60, "the batch line never reached vLLM's queue")
            assert len(done) < 2, "the interactive requests ended before the batch line queued: inconclusive"
            threads.append(threading.Thread(target=chat, args=("short", 8)))  # arrives after the batch line
            threads[-1].start()
            deadline = time.monotonic() + DEADLINE
            while (batch := sdk.batches.retrieve(batch.id)).status != "completed":
                assert time.monotonic() < deadline and batch.status in ("validating", "in_progress", "finalizing")
                time.sleep(0.05)
            batch_done = time.monotonic()
            out = json.loads(sdk.files.content(batch.output_file_id).text)
        for thread in threads:
            thread.join(DEADLINE)
    assert out["response"]["status_code"] == 200, out
    assert set(done) == {"long 0", "long 1", "long 2", "short"}, done
    # vLLM served every interactive request before the line, the one that arrived after it too
    assert batch_done > max(done.values()), (batch_done, done)
