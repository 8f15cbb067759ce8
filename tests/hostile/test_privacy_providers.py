"""Privacy, hostile pass: a rented provider that quotes back the Authorization it received never hands the
gateway's provider key to a client, a log line or a span.

Providers quote what they were sent: in a 4xx or 5xx error message, in an error inside a 200 answer, in a streamed
error event, in a response header. The gateway relayed all of it but the 401 and 403 answers, so the provider key
reached the client in 14 of 16 ways. Here a provider on a raw socket answers each way (the key raw, after
`Bearer `, JSON-escaped as `\\/` or `\\uXXXX`, percent-encoded; cut between two reads of a stream), behind a real
gateway that rents every call to it, with tracing on and the model's content in its spans. The client still gets
an error in OpenAI's shape where there was one, with the quote replaced by a marker; the key is in no answer,
header, log record or exported span, in any of its spellings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from urllib.parse import quote, unquote

import httpx
import orjson

from policies.keys import KeyRecord, hash_key, new_key, new_key_id
from tests.support.gateway import running_gateway
from tests.support.otlp_receiver import Receiver
from tests.support.probes import eventually
from tests.support.servers import free_port, read_request, serve_raw

MARKER = "[redacted]"


def spellings(text: str) -> str:
    """`text` with every JSON string escape and percent-encoding undone, so a key spelled any way shows raw."""
    text = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m[1], 16)), text)
    return unquote(text.replace("\\/", "/").replace('\\"', '"'))


def json_error(status: bytes, body: dict | bytes, content_type: bytes = b"application/json",
               extra: bytes = b"") -> bytes:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return (b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n%s\r\n%s"
            % (status, content_type, len(raw), extra, raw))


def openai_error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def chunked_head(content_type: bytes = b"text/event-stream") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            % content_type)


def piece(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def chunk_event(text: str) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "model": "rented-model",
                                     "choices": [{"index": 0, "delta": {"content": text}}]}) + b"\n\n"


class QuotingProvider:
    """Answers each request the way its first message (or, for the Responses API, its `input`) names, quoting
    the Authorization header it got. `stream_split` sends a stream whose error event has the key cut in two
    HTTP chunks, the second only once the client has read the first event (`release`), so the gateway has
    surely read the first half alone."""

    def __init__(self) -> None:
        self.port = 0
        self.release = asyncio.Event()
        self.seen_authorization: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path, headers, body = await read_request(reader)
        auth = headers.get(b"authorization", b"").decode()
        self.seen_authorization.append(auth)
        mode = body["input"] if path.endswith(b"/responses") else body["messages"][0]["content"]
        await self.answer(mode, auth, writer)

    async def answer(self, mode: str, auth: str, w: asyncio.StreamWriter) -> None:
        key = auth.removeprefix("Bearer ")
        said = f"Incorrect API key provided: {auth}"
        if mode in ("status_400", "status_429", "status_500", "responses_400"):
            status = {"status_400": b"400 Bad Request", "status_429": b"429 Too Many Requests",
                      "status_500": b"500 Internal Server Error", "responses_400": b"400 Bad Request"}[mode]
            w.write(json_error(status, openai_error(said)))
        elif mode in ("status_401", "status_403"):
            w.write(json_error(b"401 Unauthorized" if mode == "status_401" else b"403 Forbidden",
                               openai_error(said, "authentication_error")))
        elif mode == "status_404":
            w.write(json_error(b"404 Not Found", {"detail": f"no model for the caller {auth}"}))
        elif mode == "status_422":
            w.write(json_error(b"422 Unprocessable Entity", {"detail": [
                {"loc": ["header", "authorization"], "msg": "value is not a valid key", "input": auth}]}))
        elif mode == "status_503":
            w.write(json_error(b"503 Service Unavailable", f"<html><body>overloaded; request by {auth}</body></html>"
                               .encode(), b"text/html"))
        elif mode == "text_plain":
            w.write(json_error(b"400 Bad Request", f"bad credentials: {auth}".encode(), b"text/plain"))
        elif mode == "slash_escaped":  # as PHP's json_encode writes it: every "/" as "\/"
            w.write(json_error(b"400 Bad Request", b'{"error":{"message":"refused: Bearer %s","type":"x"}}'
                               % key.replace("/", "\\/").encode()))
        elif mode == "unicode_escaped":  # every character of the key as \uXXXX
            escaped = "".join(f"\\u{ord(c):04x}" for c in key)
            w.write(json_error(b"400 Bad Request", b'{"error":{"message":"refused: %s","type":"x"}}' % escaped.encode()))
        elif mode == "percent_encoded":
            w.write(json_error(b"400 Bad Request", openai_error(f"see https://status.example/?key={quote(key, safe='')}")))
        elif mode == "error_in_200":
            w.write(json_error(b"200 OK", openai_error(said, "server_error")))
        elif mode == "content_echo":  # a "model" that repeats its request headers in its answer
            w.write(json_error(b"200 OK", {"id": "x", "object": "chat.completion", "model": "rented-model",
                                           "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                               "role": "assistant", "content": f"your headers: {auth}"}}],
                                           "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}))
        elif mode == "in_headers":
            w.write(json_error(b"200 OK", {"id": "x", "object": "chat.completion", "model": "rented-model",
                                           "choices": []},
                               b"application/json; caller=%s" % key.encode(),
                               b"x-echo-authorization: %s\r\n" % auth.encode()))
        elif mode == "stream_error_event":
            w.write(chunked_head(b"text/event-stream; caller=%s" % key.encode()))
            w.write(piece(chunk_event("hi")))
            w.write(piece(b"data: " + orjson.dumps(openai_error(said, "server_error")) + b"\n\n"))
            w.write(piece(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif mode == "stream_split":
            event = b"data: " + orjson.dumps(openai_error(said, "server_error")) + b"\n\n"
            cut = event.index(key.encode()) + len(key) // 2
            w.write(chunked_head())
            w.write(piece(chunk_event("hi") + event[:cut]))
            await w.drain()
            await asyncio.wait_for(self.release.wait(), 30)
            w.write(piece(event[cut:] + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif mode == "stream_status_500":  # a stream asked for, an error answered
            w.write(json_error(b"500 Internal Server Error", openai_error(said, "server_error")))
        else:
            raise AssertionError(f"unknown mode {mode}")


# mode -> (the status the client gets, whether the answer is an OpenAI error object, whether it streams)
CASES = {
    "status_400": (400, True, False), "status_401": (502, True, False), "status_403": (502, True, False),
    "status_404": (404, True, False), "status_422": (422, True, False), "status_429": (429, True, False),
    "status_500": (502, True, False), "status_503": (502, True, False), "text_plain": (400, True, False),
    "slash_escaped": (400, True, False), "unicode_escaped": (400, True, False),
    "percent_encoded": (400, True, False), "error_in_200": (200, True, False), "content_echo": (200, False, False),
    "in_headers": (200, False, False), "stream_error_event": (200, False, True), "stream_split": (200, False, True),
    "stream_status_500": (502, True, True), "responses_400": (400, True, False),
}


@contextlib.asynccontextmanager
async def quoting_provider() -> AsyncIterator[QuotingProvider]:
    upstream = QuotingProvider()
    async with serve_raw(upstream.handle) as upstream.port:
        yield upstream


def policy(port: int, collector: str) -> dict:
    return {
        "providers": [{"name": "quoting", "base_url": f"http://127.0.0.1:{port}/v1", "api_key_env": "QUOTING_KEY",
                       "models": {"m": "rented-model"}, "allow_private_address": True,
                       "price_per_million_tokens": {"input": 1.0, "output": 2.0}}],
        "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{free_port()}"}],  # nothing listens
                    "overflow": {"provider": "quoting", "when_unavailable": True}}],
        "health": {"interval": 0.2, "backoff_initial": 30, "backoff_max": 30},
        "tracing": {"enabled": True, "endpoint": collector, "schedule_delay": 0.2, "content_models": ["m"]},
    }


SERVER = 2  # opentelemetry-proto's Span.SpanKind


async def send(http: httpx.AsyncClient, url: str, key: str, mode: str, release: asyncio.Event) -> tuple[int, str, str]:
    """The client's whole view of one call: its status, headers (as text) and body."""
    auth = {"authorization": f"Bearer {key}", "x-request-id": f"quote-{mode}"}
    _, _, streams = CASES[mode]
    if mode == "responses_400":
        r = await http.post(f"{url}/v1/responses", json={"model": "m", "input": mode}, headers=auth)
        return r.status_code, str(r.headers.multi_items()), r.text
    body = {"model": "m", "messages": [{"role": "user", "content": mode}], "stream": streams}
    if not streams:
        r = await http.post(f"{url}/v1/chat/completions", json=body, headers=auth)
        return r.status_code, str(r.headers.multi_items()), r.text
    got = b""
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth) as r:
        async for data in r.aiter_bytes():
            got += data
            if b"\n\n" in got:
                release.set()  # the first event is through: the provider may send the rest of its stream
    return r.status_code, str(r.headers.multi_items()), got.decode()


async def test_a_provider_quoting_its_key_back_never_shows_it(monkeypatch, caplog):
    provider_key = f"rk-{secrets.token_urlsafe(24)}/pr+iv=="  # "/", "+" and "=": its escaped spellings differ
    secret = provider_key[3:]
    monkeypatch.setenv("QUOTING_KEY", provider_key)
    caplog.set_level(logging.DEBUG)
    key_id = new_key_id()
    key = new_key(key_id)
    with Receiver() as collector:
        async with quoting_provider() as upstream, running_gateway(policy(upstream.port, collector.url)) as gw, \
                httpx.AsyncClient(timeout=30) as http:
            await gw.state.store.create_key(KeyRecord(id=key_id, name="renter", created_at=time.time(),
                                                      hash=hash_key(key), data_policy="allow_rented"))
            leaked, unclear = [], []
            for mode, (status, error_shaped, _) in CASES.items():
                got_status, headers, body = await send(http, gw.url, key, mode, upstream.release)
                seen = f"{headers} {body}"
                if secret in spellings(seen) or secret[:12] in seen:
                    leaked.append(mode)
                if got_status != status:
                    unclear.append(f"{mode}: HTTP {got_status}, not {status}")
                elif error_shaped:
                    error = orjson.loads(body).get("error")
                    if not (isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]
                            and isinstance(error.get("type"), str)):
                        unclear.append(f"{mode}: no OpenAI error object in {body[:200]}")
                if mode not in ("status_401", "status_403") and MARKER not in seen:
                    unclear.append(f"{mode}: the quote did not arrive marked as {MARKER}")
            assert upstream.seen_authorization == [f"Bearer {provider_key}"] * len(CASES)  # it was really sent
            assert not leaked, f"the provider key reached the client in {len(leaked)} of {len(CASES)} ways: {leaked}"
            assert not unclear, unclear

            async def exported() -> bool:  # a server span for every call (the content ones carry their text)
                with collector.lock:
                    return len([s for s in collector.spans if s.kind == SERVER]) >= len(CASES)

            await eventually(exported, timeout=30)
            spans = b"".join(collector.bodies).decode("latin-1")
            assert "quote-content_echo" in spans and secret not in spellings(spans), "the key is in a span"
    logged = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert "quote-status_400" in logged, "the access log was not captured"
    assert secret not in spellings(logged), "the provider key is in the gateway's log"
