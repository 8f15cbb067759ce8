"""Money, hostile pass: a stream's usage is metered however the provider frames its events, and counted once.

The SSE grammar lets an upstream send the same events in many shapes: the prompt's tokens and the output's in
separate usage events, `id:` and `event:` lines before `data:`, one JSON object over several `data:` lines
(joined with "\\n"), comment lines, CRLF or CR line ends. The relay read only one shape (one `data:` line, usage
in the last usage event), so a provider in any other shape was metered at an estimate or at half its usage, and a
budgeted key overspent its budget (2.1x in a burst). Here a provider on a raw socket answers each shape, through
a real gateway to it as a rented provider and as an owned backend: the ledger holds exactly what the provider
reported (a running total on every chunk and a repeated usage counted once, separate counts all kept), the client
gets the events as sent (LF line ends, the model renamed), and a budgeted key spends at most one call past its
budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import httpx
import orjson
import pytest

from policies.budget import period_bounds
from policies.keys import KeyBudget, KeyRecord, hash_key, new_key, new_key_id
from policies.ledger.sums import COMPLETION, COST, ESTIMATED, PROMPT, REQUESTS
from tests.support.gateway import running_gateway
from tests.support.probes import eventually
from tests.support.servers import free_port, read_request, serve_raw

PROMPT_TOKENS, COMPLETION_TOKENS = 300, 40  # what the provider reports for every call (within the call's bounds)
PROMPT_TEXT = "x" * 400  # 400 bytes: the budget reserves at most ~400 prompt tokens, more than the 300 reported
MAX_TOKENS = COMPLETION_TOKENS
PRICE_IN, PRICE_OUT = 1.0, 2.0  # per million tokens
CALL_COST = (PROMPT_TOKENS * PRICE_IN + COMPLETION_TOKENS * PRICE_OUT) / 1e6
BUDGET = 1.5 * CALL_COST  # two calls spend it
CALLS = 6


def chunk(model: str, content: str | None, usage: dict | None = None, finish: str | None = None) -> bytes:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]
    event = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": choices}
    if usage is not None:
        event["usage"] = usage
    return orjson.dumps(event)


def data(payload: bytes) -> bytes:
    return b"data: " + payload


TOTAL = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS,
         "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS}


def separate(model: str) -> list[bytes]:
    """The prompt's tokens in one usage event, the output's in another."""
    return [data(chunk(model, "ok")), data(chunk(model, "!", finish="stop")),
            data(chunk(model, None, {"prompt_tokens": PROMPT_TOKENS})),
            data(chunk(model, None, {"completion_tokens": COMPLETION_TOKENS,
                                     "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS}))]


def fields_first(model: str) -> list[bytes]:
    """`id:` and `event:` lines before every `data:` line."""
    return [b"id: 1\nevent: message\n" + data(chunk(model, "ok", finish="stop")),
            b"id: 2\nevent: message\nretry: 3000\n" + data(chunk(model, None, TOTAL))]


def multiline(model: str) -> list[bytes]:
    """The usage event's JSON over four `data:` lines (the grammar joins them with "\\n", JSON whitespace)."""
    return [data(chunk(model, "ok", finish="stop")),
            b'data: {"id":"chatcmpl-s","object":"chat.completion.chunk","model":' + orjson.dumps(model) + b',\n'
            b'data: "choices":[],\n'
            b'data:"usage":\n'
            b'data: {"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}'
            % (PROMPT_TOKENS, COMPLETION_TOKENS, PROMPT_TOKENS + COMPLETION_TOKENS)]


def commented(model: str) -> list[bytes]:
    """A keep-alive comment as an event of its own, and one before the usage event's `data:` line."""
    return [b": keep-alive", data(chunk(model, "ok", finish="stop")), b": usage next\n" + data(chunk(model, None, TOTAL))]


def running_total(model: str) -> list[bytes]:
    """Usage on every chunk, a running total (vLLM's continuous usage stats), and the final usage sent twice."""
    steps = [10, 20, 30, COMPLETION_TOKENS]
    events = [data(chunk(model, "ok", {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n,
                                       "total_tokens": PROMPT_TOKENS + n})) for n in steps]
    return events + [data(chunk(model, None, TOTAL))] * 2


def response_frame(kind: str, model: str, usage: dict | None) -> bytes:
    response = {"id": "resp_x", "object": "response", "model": model, "status": "completed", "output": [],
                "usage": usage}
    return orjson.dumps({"type": kind, "sequence_number": 1, "response": response})


RESPONSES_USAGE = {"input_tokens": PROMPT_TOKENS, "output_tokens": COMPLETION_TOKENS,
                   "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS}


def responses_multiline(model: str) -> list[bytes]:
    """The Responses API's frames, `response.completed` with an `id:` line and its JSON over two `data:` lines."""
    created = b"event: response.created\ndata: " + response_frame("response.created", model, None)
    done = response_frame("response.completed", model, RESPONSES_USAGE)
    cut = done.index(b'"usage"')
    return [created, b"id: 9\nevent: response.completed\ndata: " + done[:cut] + b"\ndata: " + done[cut:]]


def responses_typed(model: str) -> list[bytes]:
    """No `event:` lines: each frame's type only in its JSON (as the SDKs read it), a comment first."""
    return [b": stream opens", data(response_frame("response.created", model, None)),
            data(response_frame("response.completed", model, RESPONSES_USAGE))]


RESPONSES_SHAPES: dict[str, Callable[[str], list[bytes]]] = {
    "responses_multiline": responses_multiline, "responses_typed": responses_typed}


SHAPES: dict[str, Callable[[str], list[bytes]]] = {
    "separate": separate, "fields_first": fields_first, "multiline": multiline, "commented": commented,
    "running_total": running_total,
}
LINE_ENDS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


def stream_of(shape: str, model: str, line_end: bytes) -> bytes:
    events = RESPONSES_SHAPES[shape](model) if shape in RESPONSES_SHAPES else SHAPES[shape](model) + [b"data: [DONE]"]
    return b"".join(event + b"\n\n" for event in events).replace(b"\n", line_end)


class Provider:
    """An OpenAI-compatible upstream on a raw socket: GET /health is 200, /metrics 404, and a chat request is
    answered with the stream its first message names (`<shape> <line end>`), in chunked pieces of 23 bytes (so
    events, lines and CRLF pairs are cut between reads). It notes the request ids it served."""

    def __init__(self) -> None:
        self.served: list[str] = []
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path, headers, body = await read_request(reader)
        if path.endswith(b"/health"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
        elif not path.endswith((b"/chat/completions", b"/responses")):
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        else:
            self.served.append(headers.get(b"x-request-id", b"").decode())
            words = body["input"] if path.endswith(b"/responses") else body["messages"][0]["content"]
            shape, line_end = words.split()[:2]
            raw = stream_of(shape, body["model"], LINE_ENDS[line_end])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            for i in range(0, len(raw), 23):
                piece = raw[i:i + 23]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")


@contextlib.asynccontextmanager
async def provider() -> AsyncIterator[Provider]:
    upstream = Provider()
    async with serve_raw(upstream.handle) as upstream.port:
        yield upstream


def policy(port: int) -> dict:
    """`owned`: served by the provider as its owned backend; `rented`: its owned backend is down (nothing
    listens), so every call a key may rent goes to the provider as a rented one."""
    url = f"http://127.0.0.1:{port}"
    return {
        "providers": [{"name": "raw", "base_url": f"{url}/v1", "api_key_env": "RAW_PROVIDER_KEY",
                       "models": {"rented": "rented-model"}, "allow_private_address": True,
                       "price_per_million_tokens": {"input": PRICE_IN, "output": PRICE_OUT}}],
        "models": [{"name": "owned", "served_name": "served-owned", "backends": [{"url": url}]},
                   {"name": "rented", "served_name": "served-rented",
                    "backends": [{"url": f"http://127.0.0.1:{free_port()}"}],
                    "overflow": {"provider": "raw", "when_unavailable": True}}],
        "health": {"interval": 0.2, "backoff_initial": 30, "backoff_max": 30},
    }


async def issue(gw, budget: float | None = None) -> tuple[str, str]:
    key_id = new_key_id()
    key = new_key(key_id)
    await gw.state.store.create_key(KeyRecord(
        id=key_id, name=f"money-{key_id}", created_at=time.time(), hash=hash_key(key), data_policy="allow_rented",
        budget=KeyBudget(max_rented_spend=budget) if budget is not None else None))
    return key_id, key


async def ledger_totals(gw, key_id: str, requests: int) -> dict[str, float]:
    """The key's ledger sums, once its `requests` calls are in (a stream's call is accounted as it closes, which
    may be just after the client read its last byte)."""
    totals: dict[str, float] = {}

    async def counted() -> bool:
        totals.update(await read_totals(gw, key_id))
        return totals["requests"] >= requests

    await eventually(counted, timeout=20)
    return totals


async def read_totals(gw, key_id: str) -> dict[str, float]:
    await gw.state.record_ledger.flush()
    start, _ = period_bounds("month", time.time())
    rows = await gw.state.ledger.read(start, time.time() + 3600, key_id=key_id)
    names = {"requests": REQUESTS, "prompt": PROMPT, "completion": COMPLETION, "cost": COST, "estimated": ESTIMATED}
    return {name: sum(values[i] for _, values in rows) for name, i in names.items()}


async def stream(http: httpx.AsyncClient, url: str, key: str, model: str, words: str, request_id: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": f"{words} {PROMPT_TEXT}"}],
            "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    return await http.post(f"{url}/v1/chat/completions", json=body,
                           headers={"authorization": f"Bearer {key}", "x-request-id": request_id})


@pytest.fixture
def provider_key(monkeypatch):
    monkeypatch.setenv("RAW_PROVIDER_KEY", "rk-money-streams-0123456789abcdef")


@pytest.mark.parametrize("line_end", list(LINE_ENDS))
async def test_every_shape_is_metered_once_as_reported_and_relayed_as_sent(line_end, provider_key):
    async with provider() as upstream, running_gateway(policy(upstream.port)) as gw, \
            httpx.AsyncClient(timeout=30) as http:
        for model, served, kind in (("rented", "rented-model", "rented"), ("owned", "served-owned", "owned")):
            for shape in SHAPES:
                key_id, key = await issue(gw)
                r = await stream(http, gw.url, key, model, f"{shape} {line_end}", f"{kind}-{shape}-{line_end}")
                where = f"{shape} over {line_end} to the {kind} upstream"
                assert r.status_code == 200 and r.headers["x-gateway-served-by"] == kind, (where, r.text)
                sent = stream_of(shape, served, b"\n")  # as the provider sent it, with LF line ends
                renamed = sent.replace(b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(model))
                assert r.content == renamed, where  # every event, as sent, the usage ones too (they were asked for)
                totals = await ledger_totals(gw, key_id, 1)
                assert totals["requests"] == 1, where
                assert (totals["prompt"], totals["completion"]) == (PROMPT_TOKENS, COMPLETION_TOKENS), where
                assert totals["estimated"] == 0, where
                if kind == "rented":
                    assert totals["cost"] == pytest.approx(CALL_COST), where
        assert len(upstream.served) == 2 * len(SHAPES)


@pytest.mark.parametrize("line_end", ["lf", "crlf"])
async def test_responses_frames_are_metered_however_framed(line_end, provider_key):
    async with provider() as upstream, running_gateway(policy(upstream.port)) as gw, \
            httpx.AsyncClient(timeout=30) as http:
        for model, served, kind in (("rented", "rented-model", "rented"), ("owned", "served-owned", "owned")):
            for shape in RESPONSES_SHAPES:
                key_id, key = await issue(gw)
                r = await http.post(f"{gw.url}/v1/responses", json={
                    "model": model, "input": f"{shape} {line_end} {PROMPT_TEXT}", "max_output_tokens": MAX_TOKENS,
                    "stream": True}, headers={"authorization": f"Bearer {key}"})
                where = f"{shape} over {line_end} to the {kind} upstream"
                assert r.status_code == 200 and r.headers["x-gateway-served-by"] == kind, (where, r.text)
                sent = stream_of(shape, served, b"\n")
                assert r.content == sent.replace(b'"model":' + orjson.dumps(served),
                                                 b'"model":' + orjson.dumps(model)), where
                totals = await ledger_totals(gw, key_id, 1)
                assert (totals["prompt"], totals["completion"], totals["estimated"]) == (
                    PROMPT_TOKENS, COMPLETION_TOKENS, 0), where


# The shapes that escaped the meter (the running total was metered right all along); CR line ends too.
ESCAPING = [("separate", "lf"), ("fields_first", "lf"), ("multiline", "crlf"), ("commented", "lf"),
            ("running_total", "cr")]


async def test_a_budgeted_key_spends_at_most_one_call_past_its_budget_whatever_the_shape(provider_key):
    async with provider() as upstream, running_gateway(policy(upstream.port)) as gw, \
            httpx.AsyncClient(timeout=30) as http:
        for shape, line_end in ESCAPING:
            key_id, key = await issue(gw, budget=BUDGET)
            answered = 0
            for i in range(CALLS):  # one at a time: each call's cost is settled before the next one asks
                r = await stream(http, gw.url, key, "rented", f"{shape} {line_end}", f"budget-{shape}-{i}")
                if r.status_code == 200:
                    answered += 1
                else:
                    assert r.status_code == 503 and r.json()["error"]["code"] == "rented_budget_spent", r.text
            served = len([rid for rid in upstream.served if rid.startswith(f"budget-{shape}-")])
            provider_cost = served * CALL_COST  # what the provider bills for the calls it served
            assert served == answered >= 1, shape
            assert provider_cost <= BUDGET + CALL_COST * 1.0001, (shape, served)  # one call past it, no more
            totals = await ledger_totals(gw, key_id, served)
            assert totals["requests"] == served, shape
            assert totals["cost"] == pytest.approx(provider_cost), shape  # every call it served is recorded
            start, end = period_bounds("month", time.time())
            spent, _ = await gw.state.budgets.status(key_id, start, end)
            assert spent == pytest.approx(provider_cost), shape
