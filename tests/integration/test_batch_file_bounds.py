"""The Batch API's files bounded per key and expiring, through the real openai SDK against one gateway over the
vLLM simulator, on the embedded SQLite store and on a real redis-server: an upload past the key's file count or
bytes is a 400 naming the bound with nothing left on the volume, another key's files never count against it, a
batch's outputs are kept past the bound, `expires_after` sets `expires_at` (a batch's `output_expires_after`
its outputs'), and the runner's sweep deletes an expired file (record and bytes) but keeps the input of a batch
still running until it ends. An upload is taken as it arrives, never held whole, and one cut off, refused or
past its size leaves nothing on the volume. Time passing is stood in for by rewriting a file's `expires_at` in
the store: OpenAI's shortest expiry is an hour."""

from __future__ import annotations

import asyncio
import hashlib
import io
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from tools.simulator import create_app
from policies.keys import key_id_of
from tests.integration.test_batches import DEADLINE, FAST, SLOW, chat_line, finished, jsonl, other_key
from tests.support.gateway import TEST_KEY, one_model, running_gateway
from tests.support.redis_fixtures import redis_prefix, redis_server, redis_standalone  # noqa: F401
from tests.support.servers import serve_app

MiB = 1024 * 1024


def on_disk(tmp_path: Path) -> list[str]:
    """The files on the volume (temporary ones too: a refused upload must leave none)."""
    folder = tmp_path / "files"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture(params=["sqlite", "redis"])
def store(request) -> dict:
    if request.param == "sqlite":
        return {}
    server, prefix = request.getfixturevalue("redis_server"), request.getfixturevalue("redis_prefix")
    return {"store": {"kind": "redis", "url": server.url, "prefix": prefix}}


def gateway_policy(backend: str, tmp_path: Path, store: dict, **batch) -> dict:
    return one_model(backend, batch={"files_dir": str(tmp_path / "files"), "poll_seconds": 0.1, **batch}, **store)


async def gone(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not await predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_an_upload_past_a_keys_bounds_is_a_400_naming_it_leaving_nothing(tmp_path, store):
    async with serve_app(create_app(FAST)) as backend, \
            running_gateway(gateway_policy(backend, tmp_path, store, max_files_per_key=2,
                                           max_bytes_per_key=1 * MiB)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk:
        small = jsonl([chat_line(1)])
        big = jsonl([chat_line(1, messages=[{"role": "user", "content": "x" * (600 * 1024)}])])
        first = await sdk.files.create(file=("a.jsonl", io.BytesIO(big)), purpose="batch")
        with pytest.raises(openai.BadRequestError) as refused:  # 600 KiB more would pass 1 MiB
            await sdk.files.create(file=("b.jsonl", io.BytesIO(big)), purpose="batch")
        error = refused.value.body
        assert error["code"] == "storage_limit_reached" and "batch.max_bytes_per_key (1048576)" in error["message"]
        assert on_disk(tmp_path) == [first.id]
        second = await sdk.files.create(file=("c.jsonl", io.BytesIO(small)), purpose="batch")
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.files.create(file=("d.jsonl", io.BytesIO(small)), purpose="batch")
        error = refused.value.body
        assert error["code"] == "file_count_limit_reached" and "batch.max_files_per_key (2)" in error["message"]
        assert error["param"] == "file" and "this key has 2 files" in error["message"]
        assert on_disk(tmp_path) == sorted([first.id, second.id])
        assert [f.id async for f in sdk.files.list()] == [second.id, first.id]
        async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=await other_key(gw), max_retries=0,
                                      timeout=20) as theirs:  # one key's files never count against another's
            for data in (big, small):  # as many files and bytes as this key holds
                await theirs.files.create(file=("e.jsonl", io.BytesIO(data)), purpose="batch")
            with pytest.raises(openai.NotFoundError):  # and another key's file answers as unknown, as before
                await theirs.files.retrieve(first.id)
        await sdk.files.delete(first.id)  # deleting makes room
        third = await sdk.files.create(file=("g.jsonl", io.BytesIO(big)), purpose="batch")
        assert third.id in on_disk(tmp_path) and first.id not in on_disk(tmp_path)
        assert await gw.state.batch_store.usage(key_id_of(TEST_KEY)) == (2, len(small) + len(big))


async def test_a_batchs_outputs_are_kept_past_the_bound_which_then_refuses_uploads(tmp_path, store):
    async with serve_app(create_app(FAST)) as backend, \
            running_gateway(gateway_policy(backend, tmp_path, store, max_files_per_key=2)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk:
        lines = [chat_line(n) for n in range(4)] + [chat_line(9, max_tokens=-1)]  # an error line too
        uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        done = await finished(sdk, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 4 and done.request_counts.failed == 1
        assert len((await sdk.files.content(done.output_file_id)).text.splitlines()) == 4
        assert len((await sdk.files.content(done.error_file_id)).text.splitlines()) == 1
        output = await sdk.files.retrieve(done.output_file_id)
        assert output.expires_at == output.created_at + 30 * 86400  # batch.output_retention_seconds
        assert (await gw.state.batch_store.usage(key_id_of(TEST_KEY))).files == 3
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.files.create(file=("more.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        assert refused.value.body["code"] == "file_count_limit_reached"


async def test_expires_after_sets_expires_at_and_anything_else_is_a_400_naming_it(tmp_path, store):
    async with serve_app(create_app(FAST)) as backend, \
            running_gateway(gateway_policy(backend, tmp_path, store, file_retention_seconds=7200)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk:
        data = jsonl([chat_line(1)])
        hour = await sdk.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch",
                                      expires_after={"anchor": "created_at", "seconds": 3600})
        assert hour.expires_at == hour.created_at + 3600
        assert (await sdk.files.retrieve(hour.id)).expires_at == hour.expires_at
        plain = await sdk.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
        assert plain.expires_at == plain.created_at + 7200  # batch.file_retention_seconds
        for asked, param in [({"anchor": "created_at", "seconds": 3599}, "expires_after[seconds]"),
                             ({"anchor": "created_at", "seconds": 2592001}, "expires_after[seconds]"),
                             ({"anchor": "last_active_at", "seconds": 3600}, "expires_after[anchor]")]:
            with pytest.raises(openai.BadRequestError) as refused:
                await sdk.files.create(file=("c.jsonl", io.BytesIO(data)), purpose="batch",
                                       expires_after=asked)  # type: ignore[arg-type]
            assert refused.value.body["param"] == param and refused.value.body["code"] == "invalid_expires_after"
        assert sorted(on_disk(tmp_path)) == sorted([hour.id, plain.id])


async def test_a_batchs_output_expires_after_sets_its_outputs_expiry_and_anything_else_is_a_400(tmp_path, store):
    async with serve_app(create_app(FAST)) as backend, \
            running_gateway(gateway_policy(backend, tmp_path, store)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk:
        lines = [chat_line(n) for n in range(2)] + [chat_line(9, max_tokens=-1)]
        uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        for asked, param in [({"anchor": "created_at", "seconds": 3599}, "output_expires_after[seconds]"),
                             ({"anchor": "created_at", "seconds": "3600"}, "output_expires_after[seconds]"),
                             ({"anchor": "created_at", "seconds": True}, "output_expires_after[seconds]"),
                             ({"anchor": "input_file", "seconds": 3600}, "output_expires_after[anchor]"),
                             ("an hour", "output_expires_after")]:
            with pytest.raises(openai.BadRequestError) as refused:
                await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h", output_expires_after=asked)  # type: ignore[arg-type]
            assert refused.value.body["param"] == param and refused.value.body["code"] == "invalid_expires_after"
        assert [b.id async for b in sdk.batches.list()] == []  # a refused batch is not made
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h",
                                         output_expires_after={"anchor": "created_at", "seconds": 7200})
        done = await finished(sdk, batch.id)
        assert done.status == "completed" and done.request_counts.failed == 1
        for file_id in (done.output_file_id, done.error_file_id):
            written = await sdk.files.retrieve(file_id)
            assert written.expires_at == written.created_at + 7200  # not output_retention_seconds (30 days)


async def test_the_sweep_deletes_an_expired_file_and_keeps_a_running_batchs_input(tmp_path, store):
    async with serve_app(create_app(SLOW)) as backend, \
            running_gateway(gateway_policy(backend, tmp_path, store, concurrency=1, sweep_seconds=0.2)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk:
        owner, batches = key_id_of(TEST_KEY), gw.state.batch_store

        async def swept(file_id: str) -> bool:  # its record and its bytes
            return file_id not in on_disk(tmp_path) and await batches.get_file(owner, file_id) is None

        idle = await sdk.files.create(file=("idle.jsonl", io.BytesIO(jsonl([chat_line(1)]))), purpose="batch")
        used = await sdk.files.create(file=("used.jsonl", io.BytesIO(jsonl([chat_line(n, max_tokens=10)
                                                                            for n in range(20)]))), purpose="batch")
        batch = await sdk.batches.create(input_file_id=used.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        for file_id in (idle.id, used.id):  # an hour passes: both expire
            record = await batches.get_file(owner, file_id)
            await batches.put_file({**record, "expires_at": int(time.time()) - 1})
        with pytest.raises(openai.NotFoundError):  # expired: unknown at once, before the sweep
            await sdk.files.retrieve(idle.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.files.content(used.id)
        assert [f.id async for f in sdk.files.list()] == []
        await gone(lambda: swept(idle.id), "the expired file goes")
        assert (await sdk.batches.retrieve(batch.id)).status in ("validating", "in_progress")
        assert used.id in on_disk(tmp_path) and await batches.get_file(owner, used.id) is not None  # kept
        done = await finished(sdk, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 20
        await gone(lambda: swept(used.id), "the input goes once its batch ended")
        assert await batches.usage(owner) == (1, (await sdk.files.retrieve(done.output_file_id)).bytes)



BOUNDARY = "form-b0undary"


async def streamed_form(lines: int, pad: int, hang_up_after: int | None = None) -> AsyncIterator[bytes]:
    """A batch upload's multipart body, sent 64 kB at a time as a client streaming from disk would (no length
    known up front); `hang_up_after`: raise after that many lines, so the client drops the connection."""
    yield (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
           f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
           "Content-Type: application/jsonl\r\n\r\n").encode()
    piece = []
    for n in range(lines):
        if hang_up_after is not None and n == hang_up_after:
            raise ConnectionResetError("the client went away")
        piece.append(jsonl([chat_line(n, messages=[{"role": "user", "content": "x" * pad}])]))
        if sum(map(len, piece)) >= 64 * 1024:
            yield b"".join(piece)
            piece = []
            await asyncio.sleep(0)
    yield b"".join(piece) + f"\r\n--{BOUNDARY}--\r\n".encode()


def upload_client(gw) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gw.url, timeout=60, headers={
        "authorization": f"Bearer {TEST_KEY}", "content-type": f"multipart/form-data; boundary={BOUNDARY}"})


async def test_an_upload_is_taken_as_it_arrives_never_held_whole(tmp_path, store):
    """24 MB of lines streamed in: the process's Python allocations stay within a few MB of what they were
    (read whole, the body, its copy in the form and the split lines were each the upload's size or more), and
    the file kept is the bytes sent, lines counted; streamed out again, the same."""
    async with serve_app(create_app(FAST)) as backend, \
            running_gateway(gateway_policy(backend, tmp_path, store)) as gw, upload_client(gw) as http:
        expected = b"".join([chunk async for chunk in streamed_form(12_000, 2_000)])
        file_part = expected[expected.index(b"\r\n\r\n", expected.index(b'name="file"')) + 4:
                             expected.rindex(f"\r\n--{BOUNDARY}--".encode())]
        tracemalloc.start()
        try:
            r = await http.post("/v1/files", content=streamed_form(12_000, 2_000))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert r.status_code == 200, r.text
        uploaded = r.json()
        assert uploaded["bytes"] == len(file_part) > 24_000_000
        assert peak < 8_000_000, peak
        assert (tmp_path / "files" / uploaded["id"]).read_bytes() == file_part
        assert on_disk(tmp_path) == [uploaded["id"]]  # no temporary file left beside it
        record = await gw.state.batch_store.get_file(key_id_of(TEST_KEY), uploaded["id"])
        assert record["_lines"] == 12_000
        digest, size = hashlib.sha256(), 0
        tracemalloc.start()
        try:  # and its content goes back out a piece at a time (read whole, it was the file's size at least)
            async with http.stream("GET", f"/v1/files/{uploaded['id']}/content") as r:
                assert r.status_code == 200 and r.headers["content-length"] == str(len(file_part))
                async for piece in r.aiter_raw():
                    digest.update(piece)
                    size += len(piece)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert size == len(file_part) and digest.digest() == hashlib.sha256(file_part).digest()
        assert peak < 8_000_000, peak


async def test_an_upload_cut_off_refused_or_past_its_size_leaves_nothing_on_the_volume(tmp_path, store):
    async with serve_app(create_app(FAST)) as backend, \
            running_gateway(gateway_policy(backend, tmp_path, store, max_file_bytes=2_000_000)) as gw, \
            upload_client(gw) as http:
        with pytest.raises(ConnectionResetError):  # the client hangs up halfway through its file
            await http.post("/v1/files", content=streamed_form(600, 2_000, hang_up_after=300))
        too_big = await http.post("/v1/files", content=streamed_form(2_000, 2_000))  # no length: cut at the limit
        assert too_big.status_code == 413 and too_big.json()["error"]["message"].startswith("the request body is")
        bad = b"".join([chunk async for chunk in streamed_form(50, 10)]).replace(b'"req-40"', b'"req-4"')
        duplicate = await http.post("/v1/files", content=bad)
        assert duplicate.status_code == 400 and duplicate.json()["error"]["code"] == "duplicate_custom_id"
        assert "line 41:" in duplicate.json()["error"]["message"]
        wrong = await http.post("/v1/files", content=b"".join([c async for c in streamed_form(5, 10)]).replace(
            b"\r\n\r\nbatch\r\n", b"\r\n\r\nfine-tune\r\n"))
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"
        await gone(lambda: asyncio.sleep(0, result=not on_disk(tmp_path)), "the volume left empty")
        assert await gw.state.batch_store.usage(key_id_of(TEST_KEY)) == (0, 0)
