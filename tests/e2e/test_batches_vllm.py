"""The Batch API through the real openai SDK against the shared real CPU vLLM servers: a chat batch and an
embeddings batch run to completion with every line answered once, a batch is cancelled, and a batch is resumed
by a gateway started again after the first one stopped mid-batch (SQLite store and files kept on disk)."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from tests.e2e.conftest import gateway_process, ready_pooling_server
from tests.e2e.vllm_procs import free_port

DEADLINE = 240  # seconds for a few tens of short lines on two loaded CPU cores


@pytest.fixture(scope="module")
def batch_policy(vllm_servers, tmp_path_factory, request):
    pool = ready_pooling_server(request.config, tmp_path_factory)
    work = tmp_path_factory.mktemp("batch-gateway")
    policy = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "health": {"interval": 1, "backoff_initial": 0.5, "backoff_max": 2},
        "timeouts": {"connect": 2, "read": 120},
        "models": [
            {"name": "alpha", "served_name": "tiny-a", "backends": [{"url": vllm_servers["a"].base_url}]},
            {"name": "pool", "served_name": "tiny-pool", "backends": [{"url": pool.base_url}]},
        ],
        "batch": {"files_dir": str(work / "files"), "poll_seconds": 0.2, "claim_seconds": 10, "concurrency": 2},
    }
    return policy, work


def chat_lines(count: int, prefix: str, max_tokens: int = 8) -> bytes:
    return b"".join(json.dumps({"custom_id": f"{prefix}-{n}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "alpha", "max_tokens": max_tokens, "temperature": 0,
                                         "messages": [{"role": "user", "content": f"count to {n}"}]}}).encode()
                    + b"\n" for n in range(count))


def submitted(sdk: openai.OpenAI, data: bytes, endpoint: str = "/v1/chat/completions"):
    uploaded = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def wait_for(sdk: openai.OpenAI, batch_id: str, until, what: str):
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id}: {what} not within {DEADLINE} s (now {batch.status})")


def ended(batch) -> bool:
    return batch.status in ("completed", "failed", "cancelled", "expired")


def answered_once(sdk: openai.OpenAI, batch, ids: list[str]) -> list[dict]:
    out = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(ids)
    assert all(o["response"]["status_code"] == 200 for o in out)
    return out


def test_chat_and_embeddings_batches_on_real_vllm(batch_policy):
    policy, work = batch_policy
    with gateway_process(policy, work) as gw:
        sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=gw.key, max_retries=2, timeout=60)
        chat = submitted(sdk, chat_lines(6, "c"))
        embed = submitted(sdk, b"".join(json.dumps({"custom_id": f"e-{n}", "method": "POST", "url": "/v1/embeddings",
                                                    "body": {"model": "pool", "input": f"text {n}"}}).encode() + b"\n"
                                        for n in range(4)), "/v1/embeddings")
        chat_done = wait_for(sdk, chat.id, ended, "the chat batch ends")
        assert chat_done.status == "completed" and chat_done.request_counts.completed == 6
        out = answered_once(sdk, chat_done, [f"c-{n}" for n in range(6)])
        assert all(o["response"]["body"]["model"] == "alpha" and o["response"]["body"]["choices"] for o in out)
        embed_done = wait_for(sdk, embed.id, ended, "the embeddings batch ends")
        assert embed_done.status == "completed" and embed_done.request_counts.completed == 4
        vectors = answered_once(sdk, embed_done, [f"e-{n}" for n in range(4)])
        assert all(len(o["response"]["body"]["data"][0]["embedding"]) > 8 for o in vectors)


def test_cancel_and_resume_after_a_restart_on_real_vllm(batch_policy):
    policy, work = batch_policy
    with gateway_process(policy, work) as gw:
        key = gw.key
        sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=2, timeout=60)
        cancelled = submitted(sdk, chat_lines(30, "x", max_tokens=48))
        wait_for(sdk, cancelled.id, lambda b: b.request_counts.completed >= 1, "a first answer")
        assert sdk.batches.cancel(cancelled.id).status == "cancelling"
        done = wait_for(sdk, cancelled.id, ended, "the cancelled batch ends")
        assert done.status == "cancelled" and 1 <= done.request_counts.completed < 30

        resumed = submitted(sdk, chat_lines(40, "r", max_tokens=24))
        seen = wait_for(sdk, resumed.id, lambda b: b.request_counts.completed >= 2, "some answers")
        assert seen.request_counts.completed < 40
    # the gateway stopped mid-batch (SIGTERM: lines in flight finished); one started again on the same store
    with gateway_process(policy, work) as again:
        sdk = openai.OpenAI(base_url=f"{again.url}/v1", api_key=key, max_retries=2, timeout=60)
        done = wait_for(sdk, resumed.id, ended, "the resumed batch ends")
        assert done.status == "completed" and done.request_counts.completed == 40
        answered_once(sdk, done, [f"r-{n}" for n in range(40)])
        # this gateway ran some of its lines (it resumes at once: by the time its key is issued and the first
        # retrieve goes out, a fast vLLM may have finished the batch, so "not done yet" is no evidence)
        assert again.metric("llm_gateway_requests_total", model="alpha", status="200") >= 1
