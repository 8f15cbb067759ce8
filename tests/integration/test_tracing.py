"""Traces, with real processes: `llm-gateway serve` over the simulator, exporting over OTLP/HTTP to a local
receiver that decodes the real protobuf (tests/support/otlp_receiver.py); the client is the openai SDK.

What must hold (gateway/tracing/__init__.py): one SERVER span per call with the GenAI and gateway attributes, continuing
a client's traceparent; a CLIENT span per upstream attempt (first-token event on streams); a queue span for a
call that waited; no key, admin secret or collector header value in any span; the export headers come from
the environment. With the collector down every request still succeeds and the loss is counted and logged once.
Plus, in-process: the traceparent the backend receives (the gateway's upstream span, or with tracing off the
client's own, unchanged).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.support.gateway import AUTH, one_model, running_gateway
from tests.support.otlp_receiver import Receiver
from tests.support.probes import metric_sum, wait_http_ok
from tests.support.recorder import Recorder
from tests.support.servers import free_port, serve_app

CLI = str(Path(sys.executable).with_name("llm-gateway"))
TRACE_ID, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"
SERVER, CLIENT = 2, 3  # opentelemetry-proto's Span.SpanKind


@pytest.fixture(scope="module")
def simulator():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tools.simulator", "--port", str(port), "--model", "m",
                             "--log-level", "warning", "--step-base-ms", "10", "--step-ms-per-seq", "0"])
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc, 60, "the simulator")
        yield port
    finally:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def gateway(tmp_path: Path, sim_port: int, tracing: dict, env: dict):
    """A `llm-gateway serve` process (backend cap 1, JSON access log) and a key: yields (url, key, key id, log)."""
    secret = secrets.token_urlsafe(32)
    port = free_port()
    config = tmp_path / "policy.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": str(tmp_path / "keys.db")},
        "tracing": tracing,
        "access_log": {"format": "json"},
        "models": [{"name": "m", "queue": {"max_wait": 120},
                    "backends": [{"url": f"http://127.0.0.1:{sim_port}", "cap": 1}]}],
    }))
    log_path = tmp_path / "gateway.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([CLI, "serve", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret, **env})
    try:
        wait_http_ok(f"{url}/ready", proc, 60, "the gateway")
        token = mint_token(Admin(), 600, secret=secret)
        r = httpx.post(f"{url}/admin/keys", json={"name": "traces"}, headers={"authorization": f"Bearer {token}"},
                       timeout=30)
        r.raise_for_status()
        yield url, r.json()["key"], r.json()["record"]["id"], log_path, (secret, token)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}], **kw)


def test_spans_of_chat_stream_error_and_queued_call(tmp_path, simulator):
    collector_token = "collector-" + secrets.token_hex(12)
    tracing = {"enabled": True, "headers_from_env": {"authorization": "TEST_OTLP_AUTH"}, "schedule_delay": 0.1,
               "sampling_ratio": 1.0}
    with Receiver() as receiver, gateway(tmp_path, simulator, {**tracing, "endpoint": receiver.url},
                                         {"TEST_OTLP_AUTH": f"Bearer {collector_token}"}) as (url, key, key_id, log,
                                                                                               admin):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)

        # plain chat, continuing the client's trace
        answer = chat(client, max_tokens=8, extra_headers={"traceparent": TRACEPARENT})
        assert answer.choices[0].message.content
        root = receiver.wait_for(lambda s: s.kind == SERVER and s.trace_id == TRACE_ID)[0]
        assert root.name == "chat m" and root.parent_span_id == PARENT
        a = root.attributes
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
        assert a["gen_ai.response.model"] == answer.model
        assert a["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens > 0
        assert a["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens > 0
        assert a["gen_ai.response.finish_reasons"] == (answer.choices[0].finish_reason,)
        assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.response.id"] == answer.id
        assert (a["server.address"], a["server.port"]) == ("127.0.0.1", simulator)
        assert a["llm_gateway.key_id"] == key_id and a["llm_gateway.backend"] == "m-0"
        assert a["llm_gateway.served_by"] == "owned" and a["llm_gateway.retries"] == 0
        assert a["llm_gateway.admission.limit"] == 1 and a["llm_gateway.admission.in_flight"] == 1
        assert a["http.response.status_code"] == 200 and "error.type" not in a
        assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a  # content is opt-in
        assert root.resource["service.name"] == "llm-gateway"
        upstream = receiver.wait_for(lambda s: s.kind == CLIENT and s.parent_span_id == root.span_id)[0]
        assert upstream.trace_id == TRACE_ID and upstream.name == "chat m"
        assert root.start <= upstream.start <= upstream.end <= root.end

        # a stream: the first token is an event of the upstream span
        pieces = list(chat(client, max_tokens=6, stream=True, stream_options={"include_usage": True}))
        stream_root = receiver.wait_for(lambda s: s.kind == SERVER and s.attributes.get("llm_gateway.stream"))[0]
        assert stream_root.trace_id != TRACE_ID and stream_root.parent_span_id == ""  # a trace of its own
        assert stream_root.attributes["gen_ai.usage.output_tokens"] == pieces[-1].usage.completion_tokens
        assert stream_root.attributes["gen_ai.response.finish_reasons"] == ("length",)
        stream_up = receiver.wait_for(lambda s: s.kind == CLIENT and s.parent_span_id == stream_root.span_id)[0]
        assert stream_up.events == ["gen_ai.first_token"]

        # an error: an unknown model, refused before any backend
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        failed = receiver.wait_for(lambda s: s.kind == SERVER and s.attributes["http.response.status_code"] == 404)
        assert failed[0].attributes["error.type"] and "llm_gateway.backend" not in failed[0].attributes
        assert not [s for s in receiver.spans if s.parent_span_id == failed[0].span_id]

        # a queued call: the backend's cap is 1 and a long stream holds it (300 tokens, ~3 s: the queued call must
        # reach the gateway before it ends, and a stalled thread on a slow machine can take most of a second)
        first_chunk = threading.Event()

        def hold() -> None:
            for _ in chat(client, max_tokens=300, stream=True, extra_body={"ignore_eos": True}):
                first_chunk.set()

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert first_chunk.wait(60)
        chat(client, max_tokens=4, extra_headers={"x-request-id": "queued-1"})
        holder.join(60)
        queued = receiver.wait_for(lambda s: s.attributes.get("llm_gateway.request_id") == "queued-1")[0]
        assert queued.attributes["llm_gateway.queue.wait_s"] > 0.01
        wait = receiver.wait_for(lambda s: s.name == "llm_gateway.queue" and s.parent_span_id == queued.span_id)[0]
        assert wait.end - wait.start > 10_000_000

        # the collector got the header from the environment; no secret is in any span
        assert receiver.headers[0]["authorization"] == f"Bearer {collector_token}"
        raw = b"".join(receiver.bodies)
        for secret in (key, *admin, collector_token):
            assert secret.encode() not in raw
        text = log.read_text()
        assert collector_token not in text and key not in text
    access = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert any(line["trace_id"] == TRACE_ID and line["status"] == 200 for line in access), text[-2000:]


def test_collector_down_fails_no_request(tmp_path, simulator):
    tracing = {"enabled": True, "endpoint": f"http://127.0.0.1:{free_port()}/v1/traces", "schedule_delay": 0.1,
               "export_timeout": 1}
    with gateway(tmp_path, simulator, tracing, {}) as (url, key, _, log, _admin):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        for i in range(12):
            if i % 2:
                assert list(chat(client, max_tokens=3, stream=True))
            else:
                assert chat(client, max_tokens=3).choices
        deadline_checks = 0
        while metric_sum(httpx.get(f"{url}/metrics").text, "llm_gateway_trace_spans_dropped_total") == 0:
            deadline_checks += 1
            assert deadline_checks < 600, "no dropped span was counted"
            threading.Event().wait(0.1)
    text = log.read_text()
    assert text.count("spans not delivered") == 1, text[-3000:]  # rate-limited: one line a minute
    assert "Traceback" not in text, text[-3000:]


async def test_traceparent_reaches_the_backend():
    """Tracing off: the client's traceparent and tracestate, unchanged. On: the same trace, the gateway's
    upstream span as the parent."""
    rec = Recorder()
    headers = {**AUTH, "traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with Receiver() as receiver:
        async with httpx.AsyncClient(timeout=30) as http:
            async with serve_app(rec) as up, running_gateway(one_model(up)) as gw:
                assert (await http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers)).status_code == 200
                sent = rec.requests[-1]["headers"]
                assert (sent["traceparent"], sent["tracestate"]) == (TRACEPARENT, "vendor=1")
                r = await http.post(f"{gw.url}/v1/chat/completions", json=body, headers=AUTH)
                assert r.status_code == 200 and "traceparent" not in rec.requests[-1]["headers"]

            async with serve_app(rec) as up, running_gateway(
                    one_model(up, tracing={"enabled": True, "endpoint": receiver.url, "schedule_delay": 0.1})) as gw:
                assert (await http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers)).status_code == 200
                sent = rec.requests[-1]["headers"]
                version, trace_id, span_id, flags = sent["traceparent"].split("-")
                assert (version, trace_id, flags) == ("00", TRACE_ID, "01") and span_id != PARENT
                assert sent["tracestate"] == "vendor=1"
                # off the event loop: the gateway in this process writes its spans on it (gateway/tracing/tracer.py)
                upstream = (await asyncio.to_thread(receiver.wait_for, lambda s: s.kind == CLIENT))[0]
                assert upstream.span_id == span_id and upstream.trace_id == TRACE_ID


async def test_prompt_and_completion_text_only_for_the_models_named():
    rec = Recorder()
    prompt = [{"role": "user", "content": "the plan for the launch"}]
    with Receiver() as receiver:
        async with httpx.AsyncClient(timeout=30, headers=AUTH) as http, serve_app(rec) as up:
            policy = {"models": [{"name": name, "backends": [{"url": up}]} for name in ("m", "other")],
                      "tracing": {"enabled": True, "endpoint": receiver.url, "schedule_delay": 0.1,
                                  "content_models": ["m"]}}
            async with running_gateway(policy) as gw:
                for model in ("m", "other"):
                    for stream in (False, True):
                        r = await http.post(f"{gw.url}/v1/chat/completions",
                                            json={"model": model, "messages": prompt, "stream": stream})
                        assert r.status_code == 200
                named = await asyncio.to_thread(receiver.wait_for, lambda s: s.kind == SERVER and s.name == "chat m",
                                                count=2)
                others = await asyncio.to_thread(receiver.wait_for,
                                                 lambda s: s.kind == SERVER and s.name == "chat other", count=2)
    for root in named:  # the recorder answers "abc", whole or as the stream "a", "b", "c"
        assert "the plan for the launch" in root.attributes["gen_ai.input.messages"]
        assert "abc" in root.attributes["gen_ai.output.messages"]
    for other in others:
        assert "gen_ai.input.messages" not in other.attributes and "gen_ai.output.messages" not in other.attributes
