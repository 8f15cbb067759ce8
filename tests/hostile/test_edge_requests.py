"""The edge, hostile pass: what a request's head says about its caller is settled before anything else is taken.

An attacker's checklist, each item against a real `llm-gateway serve` process (or an in-process gateway where the
item is about the request path alone):
- a body sent without a valid key is never read: the 401 comes from the head, at once, and 200 connections each
  pushing a megabyte and stalling leave the process's memory where it was;
- two credential headers (Authorization twice, X-Api-Key twice) are refused with a 401 that names the header, in
  the route's own error shape, whatever the two values are;
- an X-Request-Id that looks like a key is replaced, so it never reaches the access log, a trace or a backend;
- the routes the gateway answers itself (files, batches) count against the key's requests per minute.
"""

from __future__ import annotations

import io
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from policies.keys import KeyRecord, hash_key, key_id_of, new_key, new_key_id
from policies.keys import KeyLimits
from tests.integration.test_hostile_clients import Gateway, body_of, memory_kib, status_of
from tests.support.gateway import one_model, running_gateway
from tests.support.recorder import Recorder
from tests.support.servers import serve_app

MiB = 1 << 20
CHAT = b"/v1/chat/completions"


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = Gateway(tmp_path_factory.mktemp("edge-requests"), {"body_timeout": 60, "header_timeout": 30}, nofile=False)
    yield g
    g.stop()
    log = g.log.read_text(errors="replace")
    assert g.key not in log and g.key[:20] not in log, "an API key reached the gateway's log"
    assert "Traceback" not in log, log[-3000:]


def head(path: bytes, length: int, key: str | None = None, extra: bytes = b"") -> bytes:
    auth = b"authorization: Bearer %s\r\n" % key.encode() if key else b""
    return (b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s%s\r\n"
            % (path, length, auth, extra))


@pytest.mark.parametrize("key", [None, "sk-0123456789abcdef-" + "A" * 43], ids=["missing", "unknown"])
def test_a_body_without_a_valid_key_is_refused_from_the_head_before_it_is_sent(gw, key):
    with gw.connect() as sock:
        sock.sendall(head(CHAT, 50 * MiB, key) + b"{" + b" " * (64 << 10))  # 50 MiB announced, 64 KiB sent
        started = time.monotonic()
        raw = read_answer_head(sock, 10)
    assert status_of(raw) == 401, raw[:300]
    assert time.monotonic() - started < 5  # the client never had to send the rest
    assert body_of(raw)["error"]["code"] == "invalid_api_key"


def read_answer_head(sock: socket.socket, timeout: float) -> bytes:
    """The answer's head and body, as far as Content-Length says (the connection may stay open)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(65536)
            if not chunk:
                return got
            got += chunk
        head_part, _, rest = got.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head_part.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return head_part + b"\r\n\r\n" + rest
    except (TimeoutError, ConnectionResetError):
        return got


def test_unauthenticated_bodies_hold_no_memory(gw):
    """200 connections each announce 8 MiB, send 1 MiB without a key and stall: the process does not hold them."""
    before = memory_kib(gw.proc.pid, "VmRSS")
    chunk = b" " * MiB

    def stall(_: int) -> int:
        sock = gw.connect()
        try:
            sock.sendall(head(CHAT, 8 * MiB) + b"{")
            sock.settimeout(10)
            try:
                sock.sendall(chunk)
            except (TimeoutError, OSError):
                pass  # the gateway stopped reading: all the better
            return status_of(read_answer_head(sock, 10))
        finally:
            stalled.append(sock)

    stalled: list[socket.socket] = []
    try:
        with ThreadPoolExecutor(32) as pool:
            statuses = list(pool.map(stall, range(200)))
        grown = (memory_kib(gw.proc.pid, "VmRSS") - before) / 1024
        gw.good_call()  # the door is still open for a client with a key
    finally:
        for sock in stalled:
            sock.close()
    assert statuses.count(401) == 200, statuses
    assert grown < 64, f"the gateway grew by {grown:.0f} MiB for 200 MiB of unauthenticated bodies"


@pytest.mark.parametrize("path,header,shape", [
    (CHAT, b"authorization", "openai"),
    (b"/v1/messages", b"x-api-key", "anthropic"),
    (b"/v1/messages", b"authorization", "anthropic"),
])
@pytest.mark.parametrize("same", [True, False], ids=["same-key", "two-keys"])
def test_a_credential_header_sent_twice_is_a_401_naming_it(gw, path, header, shape, same):
    other = gw.key if same else new_key(new_key_id())
    value = (lambda k: b"Bearer " + k.encode()) if header == b"authorization" else (lambda k: k.encode())
    body = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}'
    extra = b"%s: %s\r\n%s: %s\r\n" % (header, value(gw.key), header, value(other))
    with gw.connect() as sock:
        sock.sendall(head(path, len(body), extra=extra) + body)
        raw = read_answer_head(sock, 10)
    assert status_of(raw) == 401, raw[:300]
    answer = body_of(raw)
    if shape == "anthropic":
        assert answer["type"] == "error" and answer["error"]["type"] == "authentication_error", answer
    message = answer["error"]["message"]
    assert header.decode() in message and "more than once" in message
    assert gw.key not in raw.decode(errors="replace")


def test_a_request_id_that_looks_like_a_key_is_never_taken(gw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for given in (gw.key, "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln", "sk-proj-" + "Ab1" * 12):
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30,
                       headers={"authorization": f"Bearer {gw.key}", "x-request-id": given})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] != given and len(r.headers["x-request-id"]) >= 16
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30,
                   headers={"authorization": f"Bearer {gw.key}", "x-request-id": "order-4711:attempt-2"})
    assert r.headers["x-request-id"] == "order-4711:attempt-2"  # a plain id is still the client's own
    # the fixture's teardown reads the whole log: the key (sent as a request id above) is not in it


async def test_files_and_batches_count_against_the_keys_requests_per_minute(tmp_path):
    key_id = new_key_id()
    key = new_key(key_id)
    async with serve_app(Recorder()) as backend, \
            running_gateway(one_model(backend, batch={"files_dir": str(tmp_path / "files")})) as gw:
        await gw.state.store.create_key(KeyRecord(id=key_id, name="slow", created_at=time.time(), hash=hash_key(key),
                                                  limits=KeyLimits(requests_per_minute=3)))
        assert key_id_of(key) == key_id
        sdk = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
        line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'
        made = await sdk.files.create(file=("a.jsonl", io.BytesIO(line)), purpose="batch")
        await sdk.files.list()
        await sdk.batches.list()
        with pytest.raises(openai.RateLimitError) as refused:  # the fourth request of the minute
            await sdk.files.create(file=("b.jsonl", io.BytesIO(line * 1000)), purpose="batch")
        assert refused.value.body["code"] == "rate_limit_exceeded"
        assert int(refused.value.response.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            await sdk.files.list()
        async with httpx.AsyncClient() as http:  # the model list stays free: a client asks it at start
            r = await http.get(f"{gw.url}/v1/models", headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
        stored = list((tmp_path / "files").iterdir())
        assert [p.name for p in stored] == [made.id]  # the refused upload left nothing behind
