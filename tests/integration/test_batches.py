"""The Batch API through the real openai SDK against one gateway over the vLLM simulator: files uploaded and
checked line by line, batches run in the background in the batch class, their output and error files in OpenAI's
shapes, cancelled, listed and paged; every file and batch its key's alone."""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import openai
import pytest

from tools.simulator import SimConfig, create_app
from policies.budget import period_bounds
from policies.keys import KeyBudget, KeyRecord, hash_key, key_id_of, new_key, new_key_id
from tests.integration.test_overflow import issue, standin  # noqa: F401 (a fixture)
from tests.integration.test_overflow import policy as overflow_policy
from tests.support.gateway import AUTH, TEST_KEY, one_model, running_gateway
from tests.support.rented_standin import read_log
from tests.support.servers import serve_app

FAST = SimConfig(model="served-m", step_base_ms=2, step_ms_per_seq=0)
SLOW = SimConfig(model="served-m", step_base_ms=40, step_ms_per_seq=0)
DEADLINE = 60  # seconds a batch of a few lines may take on a loaded 2-core machine


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(n: int, model: str = "m", **body) -> dict:
    return {"custom_id": f"req-{n}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"say {n}"}], "max_tokens": 3, **body}}


def nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def embed_line(n: int) -> dict:
    return {"custom_id": f"emb-{n}", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "m", "input": f"text {n}"}}


def policy(backend: str, tmp_path, **batch) -> dict:
    return one_model(backend, batch={"files_dir": str(tmp_path / "files"), "poll_seconds": 0.1, **batch})


def one_slot(backend: str, tmp_path, concurrency: int) -> dict:
    """One backend with a cap of 1: the batch's other lines wait for its slot in the batch class."""
    return {"models": [{"name": "m", "served_name": "served-m", "backends": [{"url": backend, "cap": 1}]}],
            "batch": {"files_dir": str(tmp_path / "files"), "poll_seconds": 0.1, "concurrency": concurrency}}


async def submitted(sdk: openai.AsyncOpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions"):
    uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return await sdk.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


async def batch_lines_wait(gw, count: int) -> None:
    deadline = time.monotonic() + DEADLINE
    while await gw.metric("llm_gateway_queue_depth", **{"class": "batch"}) < count:
        assert time.monotonic() < deadline, "batch lines never waited for the one slot"
        await asyncio.sleep(0.02)


async def other_key(gw) -> str:
    key = new_key(new_key_id())
    await gw.state.store.create_key(KeyRecord(id=key_id_of(key), name="other", created_at=time.time(),
                                              hash=hash_key(key)))
    return key


async def finished(sdk: openai.AsyncOpenAI, batch_id: str, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = await sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s")


@pytest.fixture
async def gateway(tmp_path):
    async with serve_app(create_app(FAST)) as backend, running_gateway(policy(backend, tmp_path)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk:
        yield gw, sdk


async def test_a_chat_batch_runs_every_line_once_with_outputs_in_openais_shape(gateway):
    gw, sdk = gateway
    lines = [chat_line(n) for n in range(12)] + [chat_line(99, max_tokens=-1)]  # the last one: the backend's 400
    uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata={"run": "1"})
    assert batch.status == "validating" and batch.request_counts.total == 13
    done = await finished(sdk, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (13, 12, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.metadata == {"run": "1"}
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{n}" for n in range(12))
    for o in out:
        assert o["response"]["status_code"] == 200 and o["error"] is None and o["id"].startswith("batch_req_")
        assert o["response"]["body"]["object"] == "chat.completion" and o["response"]["body"]["model"] == "m"
    errors = [json.loads(x) for x in (await sdk.files.content(done.error_file_id)).text.splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("req-99", 400)]
    assert errors[0]["response"]["body"]["error"]["param"] == "max_tokens"
    await gw.state.record_usage.flush()
    usage = await gw.state.store.usage(key_id_of(TEST_KEY))
    assert usage["m"]["requests"] == 12  # batch lines count in the key's usage as any call (the 400 never left)
    report = await gw.state.report(3600)  # the own-or-rent report: batch work is a class of its own
    assert report["models"]["m"]["batch"]["requests"] == 12 and report["models"]["m"]["owned"]["requests"] == 12
    assert report["keys"][key_id_of(TEST_KEY)]["batch_requests"] == 12
    output_file = await sdk.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"


async def test_an_embeddings_batch_and_paging(gateway):
    _, sdk = gateway
    uploaded = await sdk.files.create(file=("e.jsonl", io.BytesIO(jsonl([embed_line(n) for n in range(5)]))),
                                      purpose="batch")
    ids = []
    for _ in range(3):
        ids.append((await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                             completion_window="24h")).id)
    for batch_id in ids:
        done = await finished(sdk, batch_id)
        assert done.status == "completed" and done.request_counts.completed == 5 and done.error_file_id is None
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()]
    assert {o["response"]["body"]["object"] for o in out} == {"list"}
    first = await sdk.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = await sdk.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == ids[:1] and not rest.has_more
    assert [b.id async for b in sdk.batches.list(limit=1)] == ids[::-1]  # the SDK's own paging


async def test_cancel_stops_a_running_batch(tmp_path):
    async with serve_app(create_app(SLOW)) as backend, \
            running_gateway(policy(backend, tmp_path, concurrency=2)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk:
        lines = [chat_line(n, max_tokens=10) for n in range(40)]
        uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        deadline = time.monotonic() + DEADLINE
        while (await sdk.batches.retrieve(batch.id)).request_counts.completed < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        cancelling = await sdk.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done = await finished(sdk, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        assert 2 <= done.request_counts.completed < 40
        out = (await sdk.files.content(done.output_file_id)).text.splitlines()
        assert len(out) == done.request_counts.completed
        assert (await sdk.batches.cancel(batch.id)).status == "cancelled"


def upload(http: httpx.AsyncClient, data: bytes, purpose: str = "batch", name: str = "in.jsonl"):
    return http.post("/v1/files", files={"file": (name, data)}, data={"purpose": purpose})


BAD_FILES = [  # (file, the line named, the error code)
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n{not json\n',
     2, "invalid_json"),
    (jsonl([chat_line(1), {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}]), 2, "missing_field"),
    (jsonl([{"method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}]), 1, "missing_field"),
    (jsonl([chat_line(1), chat_line(2), chat_line(1)]), 3, "duplicate_custom_id"),
    (jsonl([{**chat_line(1), "url": "/v1/responses"}]), 1, "invalid_url"),
    (jsonl([{**chat_line(1), "method": "GET"}]), 1, "invalid_method"),
    (jsonl([chat_line(1), embed_line(2)]), 2, "mismatched_url"),
    (jsonl([chat_line(1), chat_line(2, model="m-alias")]), 2, "mismatched_model"),
    (jsonl([chat_line(1, model="nope")]), 1, "model_not_allowed"),
    (jsonl([chat_line(1, stream=True)]), 1, "invalid_batch_line"),
    (jsonl([chat_line(1), [1, 2]]), 2, "invalid_json"),
    (jsonl([chat_line(1), chat_line(2, tools=nested(300))]), 2, "json_too_deep"),  # forwarded, a 500
    (b'{"a": ' * 1100 + b"1" + b"}" * 1100 + b"\n", 1, "json_too_deep"),  # past orjson's own bound
]


@pytest.mark.parametrize("data,line,code", BAD_FILES)
async def test_a_bad_input_file_is_a_400_naming_its_line(gateway, data, line, code):
    gw, _ = gateway
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=20) as http:
        r = await upload(http, data)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == code and error["message"].startswith(f"line {line}: "), error
        assert (await http.get("/v1/files")).json()["data"] == []  # nothing was kept


async def test_other_bad_requests_are_4xx_in_openais_shape(tmp_path):
    async with serve_app(create_app(FAST)) as backend, \
            running_gateway(policy(backend, tmp_path, max_file_bytes=2048, max_queued_lines_per_key=5)) as gw, \
            httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=20) as http:
        assert (await upload(http, b"x" * 70_000)).status_code == 413
        assert (await upload(http, jsonl([chat_line(1)]), purpose="fine-tune")).json()["error"]["param"] == "purpose"
        assert (await upload(http, b"")).json()["error"]["code"] == "empty_file"
        assert (await http.post("/v1/files", content=b"{}", headers={"content-type": "application/json"})
                ).json()["error"]["code"] == "invalid_content_type"
        assert (await http.post("/v1/files", files={"file": ("a", b"x")})).json()["error"]["param"] == "purpose"
        four = (await upload(http, jsonl([chat_line(n) for n in range(4)]))).json()["id"]
        cases = [({"input_file_id": four, "endpoint": "/v1/embeddings", "completion_window": "24h"},
                  "mismatched_endpoint", 400),
                 ({"input_file_id": four, "endpoint": "/v1/chat/completions", "completion_window": "1h"}, None, 400),
                 ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
                  "file_not_found", 404),
                 ({"input_file_id": four, "endpoint": "/v1/responses", "completion_window": "24h"},
                  "invalid_endpoint", 400)]
        for body, code, status in cases:
            r = await http.post("/v1/batches", json=body)
            assert r.status_code == status and r.json()["error"]["code"] == code, (body, r.text)
        assert (await http.post("/v1/batches", content=b"{nope")).json()["error"]["code"] == "invalid_json"
        six = (await upload(http, jsonl([chat_line(n) for n in range(6)]))).json()["id"]
        r = await http.post("/v1/batches", json={"input_file_id": six, "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "queued_lines_limit_reached"
        assert (await http.get("/v1/batches?limit=0")).status_code == 400
        assert (await http.get("/v1/batches?bogus=1")).status_code == 400
        assert (await http.get("/v1/files/../../etc/passwd")).status_code == 404


async def test_files_and_batches_are_their_keys_alone(gateway):
    gw, sdk = gateway
    theirs = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=await other_key(gw), max_retries=0, timeout=20)
    mine = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(1)]))), purpose="batch")
    batch = await sdk.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    async with httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
        other = {"authorization": f"Bearer {theirs.api_key}"}
        for method, path in [("GET", "/v1/files/{f}"), ("GET", "/v1/files/{f}/content"), ("DELETE", "/v1/files/{f}"),
                             ("GET", "/v1/batches/{b}"), ("POST", "/v1/batches/{b}/cancel")]:
            seen = await http.request(method, path.format(f=mine.id, b=batch.id), headers=other)
            unknown = await http.request(method, path.format(f="file-" + "0" * 24, b="batch_" + "0" * 24),
                                         headers=other)
            assert seen.status_code == unknown.status_code == 404
            assert seen.json()["error"]["code"] == unknown.json()["error"]["code"]
        r = await http.post("/v1/batches", headers=other, json={"input_file_id": mine.id, "completion_window": "24h",
                                                                "endpoint": "/v1/chat/completions"})
        assert r.status_code == 404
        assert (await http.get("/v1/files", headers=other)).json()["data"] == []
        assert (await http.get("/v1/batches", headers=other)).json()["data"] == []
        assert (await http.get("/v1/files")).status_code == 401
    await finished(sdk, batch.id)
    assert [f.id async for f in sdk.files.list()][-1] == mine.id
    assert [f.id async for f in sdk.files.list(order="asc", purpose="batch")] == [mine.id]
    assert (await sdk.files.delete(mine.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await sdk.files.retrieve(mine.id)
    await theirs.close()


async def test_lines_wait_in_the_batch_class_and_interactive_calls_go_first(tmp_path):
    async with serve_app(create_app(SLOW)) as backend, running_gateway(one_slot(backend, tmp_path, 4)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=60) as sdk:
        batch = await submitted(sdk, [chat_line(n, max_tokens=8) for n in range(12)])
        await batch_lines_wait(gw, 2)
        waits = []
        for n in range(3):  # each arrives while batch lines wait: it takes the next free slot
            raw = await sdk.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": f"now {n}"}], max_tokens=2)
            waits.append(float(raw.headers["x-gateway-queue-ms"]) / 1000)
        done = await finished(sdk, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 12
        batch_waited = await gw.metric("llm_gateway_queue_wait_seconds_sum", **{"class": "batch"})
        batch_lines = await gw.metric("llm_gateway_queue_wait_seconds_count", **{"class": "batch"})
        assert batch_lines >= 10  # the lines were admitted in the batch class
        assert max(waits) < batch_waited / batch_lines, (waits, batch_waited / batch_lines)


async def test_a_batch_past_its_window_expires_keeping_what_was_answered(tmp_path):
    async with serve_app(create_app(SLOW)) as backend, \
            running_gateway(policy(backend, tmp_path, concurrency=1, completion_window_seconds=2)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk:
        lines = [chat_line(n, max_tokens=10) for n in range(60)]
        uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        assert batch.expires_at - batch.created_at == 2
        done = await finished(sdk, batch.id)
        assert done.status == "expired" and done.expired_at and done.request_counts.completed < 60
        if done.request_counts.completed:  # on a slow machine the window may close before the first answer
            out = (await sdk.files.content(done.output_file_id)).text.splitlines()
            assert len(out) == done.request_counts.completed


async def test_one_process_runs_at_most_max_in_flight_lines_of_all_its_batches(tmp_path):
    async with serve_app(create_app(SLOW)) as backend, \
            running_gateway(policy(backend, tmp_path, concurrency=4, max_in_flight=3)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk:
        uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(n, max_tokens=6)
                                                                              for n in range(10)]))), purpose="batch")
        ids = [(await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")).id for _ in range(2)]
        most = 0.0
        deadline = time.monotonic() + DEADLINE
        while [(await sdk.batches.retrieve(i)).status for i in ids] != ["completed"] * 2:
            assert time.monotonic() < deadline
            most = max(most, await gw.metric("llm_gateway_backend_in_flight_requests"))
            await asyncio.sleep(0.02)
        assert most == 3  # two batches of 4 each, held to 3 by the process's bound


async def test_a_keys_token_budget_counts_its_batch_lines(gateway):
    gw, _ = gateway
    key = new_key(new_key_id())
    budget = KeyBudget(max_tokens_per_period=10**6, period="day")
    await gw.state.store.create_key(KeyRecord(id=key_id_of(key), name="budgeted", created_at=time.time(),
                                              hash=hash_key(key), budget=budget))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=20) as sdk:
        uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(n) for n in range(5)]))),
                                          purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        done = await finished(sdk, batch.id)
        assert done.status == "completed"
        out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()]
    used = sum(o["response"]["body"]["usage"]["total_tokens"] for o in out)
    start, end = period_bounds("day", time.time())
    _, tokens = await gw.state.budgets.status(key_id_of(key), start, end)
    assert used > 0 and tokens == used


@pytest.mark.parametrize("allow_rented", [False, True])
async def test_lines_stay_on_owned_replicas_unless_the_policy_allows_renting(standin, tmp_path, allow_rented):  # noqa: F811
    rented_url, log, _ = standin
    slow = SimConfig(model="served-m", step_base_ms=20, step_ms_per_seq=0)
    async with serve_app(create_app(slow)) as owned:
        renting = overflow_policy(owned, rented_url)  # the batch class spills at once (rent_first) where allowed
        renting["batch"] = {"files_dir": str(tmp_path / "files"), "poll_seconds": 0.1, "allow_rented": allow_rented}
        async with running_gateway(renting) as gw:
            key = await issue(gw, "allow_rented")
            async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30) as sdk:
                data = jsonl([chat_line(n, max_tokens=20) for n in range(8)])
                uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
                batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h")
                done = await finished(sdk, batch.id)
                assert done.status == "completed" and done.request_counts.completed == 8
    rented = read_log(log)
    assert (len(rented) > 0) is allow_rented, rented


async def test_cancel_stops_lines_in_flight_and_waiting_for_a_slot_at_once(tmp_path):
    async with serve_app(create_app(SLOW)) as backend, running_gateway(one_slot(backend, tmp_path, 3)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30) as sdk:
        batch = await submitted(sdk, [chat_line(n, max_tokens=400) for n in range(6)])  # long: one holds the slot
        await batch_lines_wait(gw, 2)
        cancelled_at = time.monotonic()
        await sdk.batches.cancel(batch.id)
        done = await finished(sdk, batch.id)
        assert time.monotonic() - cancelled_at < 8
        assert done.status == "cancelled" and done.request_counts.completed == 0  # none was let finish
        assert done.output_file_id is None and done.error_file_id is None
        assert await gw.metric("llm_gateway_backend_in_flight_requests") == 0
