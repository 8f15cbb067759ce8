"""A finished call's spans as OTLP protobuf bytes (gateway/tracing/tracer.py says what a trace holds and when this runs).

What repeats from call to call (the span names, the model, backend, key id, status, request parameters, finish
reasons...) is encoded once per distinct combination and looked up (bounded caches); only ids, times and
per-call values (request and response ids, queue wait, token counts, in-flight at admission) are written each
time.
"""

from __future__ import annotations

import random
from urllib.parse import urlsplit

import orjson

from collections import deque

from backends.replicas import Replica
from gateway.tracing import wire
from gateway.tracing.context import CallTrace
from gateway.fallbacks import FALLBACK_FROM, SERVED_MODEL
from policies.json_types import JSON, JSONObject, JSONView
from policies.pipeline import Call
from policies.variant_signals import FINISH_REASON, sse_events

QUEUED = 0.001  # seconds of queue wait that earn the queue its own span (shorter: only the attribute)
PARAMS = ("max_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed",
          "max_completion_tokens")  # the request's numbers that become gen_ai.request.* attributes
SHARED_MAX = 4096  # entries of each cache below (combinations of a server span's repeating attributes, replicas);
# then that cache starts over
FAILED = wire.status(wire.ERROR)
CONNECT_ERROR = wire.pair("error.type", "connect")
USAGE = (("gen_ai.usage.input_tokens", "prompt_tokens"), ("gen_ai.usage.output_tokens", "completion_tokens"))
OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings"}


class SpanWriter:
    """Writes finished calls' spans; `content_models`: the models whose prompt and completion text go in."""

    def __init__(self, content_models: frozenset[str]) -> None:
        self.content_models = content_models
        self.addresses: dict[Replica, tuple[str, int]] = {}
        self.upstream_parts: dict[tuple[Replica, str], bytes] = {}  # (replica, operation) -> name, kind, attributes
        self.shared_parts: dict[tuple[object, ...], bytes] = {}  # what they are made of -> a server span's name, kind, attributes

    def spans(self, call: Call, trace: CallTrace, offset: int) -> bytes:
        """The call's spans (a CallTrace of gateway/tracing/tracer.py); `offset`: ns since the epoch at perf_counter 0."""
        end = int(trace.end * 1e9) + offset
        operation = OPERATIONS.get(call.request.route, call.request.route)
        body = call.body
        given = body.get("model")
        model: str = call.model or (given if isinstance(given, str) else "")
        trace_id, root, attempts = trace.trace_id.to_bytes(16, "big"), trace.span_id, trace.attempts
        response = call.response if isinstance(call.response, dict) else None
        parts = [wire.span_head(trace_id, root, trace.parent, trace.state),
                 self.shared(call, trace, operation, model, body, response),
                 wire.times(int(call.request.arrived * 1e9) + offset, end),
                 wire.string_attribute("llm_gateway.request_id", call.request.id),
                 wire.double_attribute("llm_gateway.queue.wait_s", call.queue_wait)]
        if attempts:
            _, _, _, in_flight, limit = attempts[-1]
            parts.append(wire.pair("llm_gateway.admission.in_flight", in_flight))
            if limit is not None:
                parts.append(wire.pair("llm_gateway.admission.limit", int(limit)))
        usage = call.usage
        if isinstance(usage, dict):
            for ours, theirs in USAGE:
                count = usage.get(theirs)
                if count.__class__ is int:
                    parts.append(wire.pair(ours, count))
        response_id = response.get("id") if response is not None else None
        if isinstance(response_id, str):
            parts.append(wire.string_attribute("gen_ai.response.id", response_id))
        variant = getattr(call, "variant", None)  # the model's variant that served it (policies/variants.py)
        if variant is not None:
            parts.append(wire.string_attribute("llm_gateway.variant", variant))
        said = getattr(call, "response_headers", None) or {}
        fell_back = said.get(FALLBACK_FROM)  # a fallback chain's step served it (gateway/fallbacks.py)
        if fell_back is not None:
            parts.append(wire.string_attribute("llm_gateway.fallback_from", fell_back))
            parts.append(wire.string_attribute("llm_gateway.served_model", said[SERVED_MODEL]))
        adapter = getattr(call, "adapter", None)  # the LoRA adapter vLLM served it with (backends/lora.py)
        if adapter is not None:
            parts.append(wire.string_attribute("llm_gateway.lora_adapter", adapter.lora_name))
        if model in self.content_models:
            parts.append(wire.attributes(b"\x4a", content(body, response, trace.tap)))
        if call.status >= 500:
            parts.append(FAILED)
        spans = [wire.wrap(parts)]
        if call.queue_wait >= QUEUED and attempts:
            admitted = int(attempts[0][2] * 1e9) + offset
            spans.append(wire.span(trace_id, random.getrandbits(64) or 1, root, "llm_gateway.queue", wire.INTERNAL,
                                   admitted - int(call.queue_wait * 1e9), admitted,
                                   {"llm_gateway.queue.wait_s": call.queue_wait}))
        parent = root.to_bytes(8, "big")
        last = len(attempts) - 1
        for i, (span_id, replica, sent, in_flight, limit) in enumerate(attempts):
            parts = [b"\x0a\x10", trace_id, b"\x12\x08", span_id.to_bytes(8, "big"), b"\x22\x08", parent,
                     self.upstream(replica, operation), wire.pair("llm_gateway.admission.in_flight", in_flight)]
            if limit is not None:
                parts.append(wire.pair("llm_gateway.admission.limit", int(limit)))
            if i < last:  # only a connection that could not be made is retried elsewhere
                parts += (wire.times(int(sent * 1e9) + offset, int(attempts[i + 1][2] * 1e9) + offset),
                          CONNECT_ERROR, FAILED)
            else:
                parts.append(wire.times(int(sent * 1e9) + offset, end))
                if call.first_token_at:
                    parts.append(wire.event(int(call.first_token_at * 1e9) + offset, "gen_ai.first_token"))
            spans.append(wire.wrap(parts))
        trace.count = len(spans)
        return b"".join(spans)

    def upstream(self, replica: Replica, operation: str) -> bytes:
        """The name, kind and fixed attributes of an upstream span to `replica`, encoded once."""
        found = self.upstream_parts.get((replica, operation))
        if found is None:
            if len(self.upstream_parts) >= SHARED_MAX:  # replicas come and go (discovery): a bound all the same
                self.upstream_parts.clear()
            host, port = self.address(replica)
            found = self.upstream_parts[(replica, operation)] = wire.name_and_kind(
                f"{operation} {replica.served_name}", wire.CLIENT) + wire.attributes(b"\x4a", {
                    "gen_ai.operation.name": operation, "gen_ai.request.model": replica.served_name,
                    "server.address": host, "server.port": port, "llm_gateway.backend": replica.name})
        return found

    def shared(self, call: Call, trace: CallTrace, operation: str, model: str, body: JSONView,
               response: JSONObject | None) -> bytes:
        """The server span's name, kind and the attributes that repeat from call to call, encoded once for each
        combination of what they are made of."""
        params = tuple(v if v.__class__ is int or v.__class__ is float else None for v in map(body.get, PARAMS))
        error = None
        if call.status >= 400:
            error = getattr(call.error, "code", None) or getattr(call.error, "type", None) or str(call.status)
        attempts = trace.attempts
        response_model: JSON = None
        reasons: tuple[str, ...] = ()
        if response is not None:
            response_model = response.get("model")
            choices = response.get("choices")
            if isinstance(choices, list):
                reasons = tuple(reason for reason in (c.get("finish_reason") for c in choices if isinstance(c, dict))
                                if isinstance(reason, str))
        elif trace.tap:
            reasons = tuple(m.decode() for m in FINISH_REASON.findall(b"".join(trace.tap)))
            if call.status < 400 and model:
                response_model = model
        key = (operation, call.request.route, model, call.status, call.stream,
               call.key.id if call.key is not None else None, error, attempts[-1][1] if attempts else None,
               len(attempts), params, response_model, reasons)
        try:
            found = self.shared_parts.get(key)
        except TypeError:  # an error code or response model that cannot be a key: encoded for this call only
            return self.encode_shared(*key)
        if found is None:
            if len(self.shared_parts) >= SHARED_MAX:
                self.shared_parts.clear()
            found = self.shared_parts[key] = self.encode_shared(*key)
        return found

    def encode_shared(self, operation: str, endpoint: str, model: str, status: int, stream: bool,
                      key_id: str | None, error: object, replica: Replica | None, attempts: int,
                      params: tuple[JSON, ...], response_model: JSON, reasons: tuple[str, ...]) -> bytes:
        attrs: dict[str, object] = {
            "gen_ai.operation.name": operation,
            "http.request.method": "POST",
            "url.path": f"/v1/{endpoint}",
            "http.response.status_code": status,
            "llm_gateway.stream": stream,
        }
        if model:
            attrs["gen_ai.request.model"] = model
        for name, value in zip(PARAMS, params):
            if name == "max_completion_tokens":  # the newer name, recorded under the convention's
                if value.__class__ is int:
                    attrs["gen_ai.request.max_tokens"] = value
            elif value is not None:
                attrs[f"gen_ai.request.{name}"] = value
        if key_id is not None:
            attrs["llm_gateway.key_id"] = key_id
        if error is not None:
            attrs["error.type"] = error
        if replica is not None:
            attrs["server.address"], attrs["server.port"] = self.address(replica)
            attrs["llm_gateway.backend"] = replica.name
            attrs["llm_gateway.served_by"] = "rented" if replica.rented else "owned"
            attrs["llm_gateway.retries"] = attempts - 1
        if isinstance(response_model, str):
            attrs["gen_ai.response.model"] = response_model
        if reasons:
            attrs["gen_ai.response.finish_reasons"] = reasons
        return wire.name_and_kind(f"{operation} {model}".strip(), wire.SERVER) + wire.attributes(b"\x4a", attrs)

    def address(self, replica: Replica) -> tuple[str, int]:
        found = self.addresses.get(replica)
        if found is None:
            if len(self.addresses) >= SHARED_MAX:
                self.addresses.clear()
            parts = urlsplit(replica.url)
            found = self.addresses[replica] = (parts.hostname or "", parts.port or (443 if parts.scheme == "https"
                                                                                     else 80))
        return found


def content(body: JSONView, response: JSONObject | None, tap: list[bytes] | deque[bytes] | None) -> dict[str, str]:
    """Prompt and completion text, for the models the policy names (tracing.content_models) only."""
    attrs = {}
    prompt = body.get("messages", body.get("prompt", body.get("input")))
    if prompt is not None:
        attrs["gen_ai.input.messages"] = orjson.dumps(prompt).decode()
    choices = response.get("choices") if response is not None else None
    if isinstance(choices, list):
        outputs = [c.get("message", c.get("text")) for c in choices if isinstance(c, dict)]
        attrs["gen_ai.output.messages"] = orjson.dumps(outputs).decode()
    elif isinstance(tap, list):
        attrs["gen_ai.output.messages"] = orjson.dumps([streamed_text(tap)]).decode()
    return attrs


def streamed_text(chunks: list[bytes]) -> str:
    """The text of a streamed answer, from its SSE events (chat deltas or completion text)."""
    out = []
    for event in sse_events(chunks):
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
            text = text if isinstance(text, str) else choice.get("text")
            if isinstance(text, str):
                out.append(text)
    return "".join(out)
