"""The tracer of gateway/tracing.py (read that first): a trace per call, written when the call is finished."""

from __future__ import annotations

import logging
import random
import re
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import orjson
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, set_span_in_context

from gateway import otlp_wire as wire
from gateway.span_export import Encoded, SpanPipe
from gateway.tracing import client_context, passthrough
from policies.config import Tracing as TracingConfig
from policies.metrics import GatewayMetrics
from policies.variant_signals import sse_events

log = logging.getLogger("gateway.tracing")

OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings"}
QUEUED = 0.001  # seconds of queue wait that earn the queue its own span (shorter: only the attribute)
SAMPLED, NOT_SAMPLED = TraceFlags(TraceFlags.SAMPLED), TraceFlags(TraceFlags.DEFAULT)
# attributes whose values differ on every call: encoded as they come (the others through otlp_wire's cache)
UNIQUE = ("llm_gateway.request_id", "gen_ai.response.id", "llm_gateway.queue.wait_s", "gen_ai.input.messages",
          "gen_ai.output.messages")
FINISH_REASON = re.compile(rb'"finish_reason":"([A-Za-z_]{1,32})"')


class CallTrace:
    """The ids of one call's trace, fixed before anything is sent, and its upstream attempts."""

    __slots__ = ("trace_id", "parent", "span_id", "sampled", "state", "attempts", "tap")

    def __init__(self, trace_id: int, parent: int, sampled: bool, state: str) -> None:
        self.trace_id, self.parent, self.sampled, self.state = trace_id, parent, sampled, state
        self.span_id = random.getrandbits(64) or 1
        self.attempts: list[tuple[int, Any, float, int, float | None]] = []  # span id, replica, sent, in flight, limit
        self.tap: Any = None


class Tracer:
    enabled = True

    def __init__(self, config: TracingConfig, metrics: GatewayMetrics) -> None:
        self.ratio = TraceIdRatioBased(config.sampling_ratio)
        self.sampler = ParentBased(self.ratio)  # a client's traceparent: its sampled flag decides
        resource = Resource.create({"service.name": config.service_name})  # + OTEL_RESOURCE_ATTRIBUTES
        self.content_models = frozenset(config.content_models)
        self.pipe = SpanPipe(config, metrics, wire.resource(resource.attributes), wire.scope("llm-gateway"))
        self.timeout = config.export_timeout
        self.addresses: dict[Any, tuple[str, int]] = {}
        self.upstream_attrs: dict[tuple[Any, str], bytes] = {}  # (replica, operation) -> encoded attributes

    def context(self, call: Any) -> CallTrace:
        trace = call.trace
        if trace is None:
            found = client_context(call.headers)
            if found is None:  # a new trace: TraceIdRatioBased's own test, without building a SamplingResult
                trace_id = random.getrandbits(128) or 1
                trace = CallTrace(trace_id, 0, trace_id & self.ratio.TRACE_ID_LIMIT < self.ratio.bound, "")
            else:
                _, trace_id, parent, sampled, state = found
                remote = SpanContext(trace_id, parent, True, SAMPLED if sampled else NOT_SAMPLED)
                decision = self.sampler.should_sample(set_span_in_context(NonRecordingSpan(remote)), trace_id,
                                                      call.endpoint, SpanKind.SERVER)
                trace = CallTrace(trace_id, parent, decision.decision.is_sampled(), state)
            call.trace = trace
        return trace

    def sending(self, call: Any, replica: Any) -> bytes:
        """The headers that carry the trace upstream; records the attempt for its span."""
        try:
            return self.attempt(call, replica)
        except Exception:  # a tracing bug must never fail a request: the call goes on untraced
            log.exception("tracing: could not start the trace of request %s", call.request_id)
            call.trace = CallTrace(1, 0, False, "")  # not sampled: nothing more is recorded for it
            return passthrough(call.headers)

    def attempt(self, call: Any, replica: Any) -> bytes:
        trace = self.context(call)
        span_id = random.getrandbits(64) or 1
        trace.attempts.append((span_id, replica, time.perf_counter(), replica.in_flight, replica.limit))
        if trace.sampled and call.stream and trace.tap is None:
            content = call.model in self.content_models
            if call.tap is None or (content and not isinstance(call.tap, list)):  # a variant's may be kept already
                call.tap = [] if content else deque(maxlen=2)  # every chunk, or the last two
            trace.tap = call.tap
        out = b"traceparent: 00-%032x-%016x-%s\r\n" % (trace.trace_id, span_id, b"01" if trace.sampled else b"00")
        return out + b"tracestate: %s\r\n" % trace.state.encode("latin-1") if trace.state else out

    def finished(self, call: Any) -> None:
        try:
            trace = self.context(call)
            if trace.sampled:
                self.pipe.put(self.spans(call, trace))
        except Exception:  # a tracing bug must never fail a request: this call's trace is lost
            log.exception("tracing: could not record the trace of request %s", call.request_id)

    def close(self) -> None:
        self.pipe.close(self.timeout)

    def spans(self, call: Any, trace: CallTrace) -> Encoded:
        offset = time.time_ns() - time.perf_counter_ns()
        end = time.perf_counter_ns() + offset

        def wall(perf: float) -> int:
            return int(perf * 1e9) + offset

        operation = OPERATIONS.get(call.endpoint, call.endpoint)
        model = call.model or (call.body.get("model") if isinstance(call.body.get("model"), str) else "")
        trace_id, root = trace.trace_id.to_bytes(16, "big"), trace.span_id
        repeated = self.call_attributes(call, trace, operation, model)
        unique = {key: repeated.pop(key) for key in UNIQUE if key in repeated}
        failed = wire.ERROR if call.status >= 500 else wire.UNSET
        spans = [wire.span(trace_id, root, trace.parent, f"{operation} {model}".strip(), wire.SERVER,
                           wall(call.arrived), end, unique, status=failed, trace_state=trace.state,
                           repeated=repeated)]
        if call.queue_wait >= QUEUED and trace.attempts:
            admitted = wall(trace.attempts[0][2])
            spans.append(wire.span(trace_id, random.getrandbits(64) or 1, root, "llm_gateway.queue", wire.INTERNAL,
                                   admitted - int(call.queue_wait * 1e9), admitted,
                                   {"llm_gateway.queue.wait_s": call.queue_wait}))
        last = len(trace.attempts) - 1
        for i, (span_id, replica, sent, in_flight, limit) in enumerate(trace.attempts):
            static = self.upstream_attrs.get((replica, operation))
            if static is None:
                host, port = self.address(replica)
                static = self.upstream_attrs[(replica, operation)] = wire.attributes(b"\x4a", {
                    "gen_ai.operation.name": operation, "gen_ai.request.model": replica.served_name,
                    "server.address": host, "server.port": port, "llm_gateway.backend": replica.name})
            attrs = {"llm_gateway.admission.in_flight": in_flight}
            if limit is not None:
                attrs["llm_gateway.admission.limit"] = int(limit)
            events: tuple = ()
            if i < last:  # only a connection that could not be made is retried elsewhere
                attrs["error.type"] = "connect"
                attempt_end = wall(trace.attempts[i + 1][2])
            else:
                attempt_end = end
                if call.first_token_at:
                    events = ((wall(call.first_token_at), "gen_ai.first_token"),)
            spans.append(wire.span(trace_id, span_id, root, f"{operation} {replica.served_name}", wire.CLIENT,
                                   wall(sent), attempt_end, {}, events, wire.ERROR if i < last else wire.UNSET,
                                   repeated=attrs, encoded=static))
        return Encoded(b"".join(spans), len(spans))

    def call_attributes(self, call: Any, trace: CallTrace, operation: str, model: str) -> dict[str, Any]:
        body = call.body if isinstance(call.body, dict) else {}
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "http.request.method": "POST",
            "url.path": f"/v1/{call.endpoint}",
            "http.response.status_code": call.status,
            "llm_gateway.request_id": call.request_id,
            "llm_gateway.stream": call.stream,
        }
        if model:
            attrs["gen_ai.request.model"] = model
        if call.variant is not None:
            attrs["llm_gateway.variant"] = call.variant
        for name in ("max_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed"):
            value = body.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                attrs[f"gen_ai.request.{name}"] = value
        if isinstance(body.get("max_completion_tokens"), int):
            attrs["gen_ai.request.max_tokens"] = body["max_completion_tokens"]
        if call.key is not None:
            attrs["llm_gateway.key_id"] = call.key.id
        if call.status >= 400:
            error = call.error if call.error is not None else None
            attrs["error.type"] = getattr(error, "code", None) or getattr(error, "type", None) or str(call.status)
        attrs["llm_gateway.queue.wait_s"] = call.queue_wait
        if trace.attempts:
            _, replica, _, in_flight, limit = trace.attempts[-1]
            host, port = self.address(replica)
            attrs["server.address"], attrs["server.port"] = host, port
            attrs["llm_gateway.backend"] = replica.name
            attrs["llm_gateway.served_by"] = "rented" if replica.rented else "owned"
            attrs["llm_gateway.retries"] = len(trace.attempts) - 1
            attrs["llm_gateway.admission.in_flight"] = in_flight
            if limit is not None:
                attrs["llm_gateway.admission.limit"] = int(limit)
        usage = call.usage if isinstance(call.usage, dict) else {}
        for ours, theirs in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
            if isinstance(usage.get(theirs), int):
                attrs[f"gen_ai.usage.{ours}"] = usage[theirs]
        response = call.response if isinstance(call.response, dict) else None
        reasons: list[str] = []
        if response is not None:
            if isinstance(response.get("id"), str):
                attrs["gen_ai.response.id"] = response["id"]
            if isinstance(response.get("model"), str):
                attrs["gen_ai.response.model"] = response["model"]
            choices = response.get("choices")
            if isinstance(choices, list):
                reasons = [c["finish_reason"] for c in choices
                           if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)]
        elif trace.tap:
            reasons = [m.decode() for m in FINISH_REASON.findall(b"".join(trace.tap))]
            if call.status < 400 and model:
                attrs["gen_ai.response.model"] = model
        if reasons:
            attrs["gen_ai.response.finish_reasons"] = tuple(reasons)
        if model in self.content_models:
            self.content(attrs, body, response, trace)
        return attrs

    @staticmethod
    def content(attrs: dict[str, Any], body: dict, response: dict | None, trace: CallTrace) -> None:
        """Prompt and completion text, for the models the policy names (tracing.content_models) only."""
        prompt = body.get("messages", body.get("prompt", body.get("input")))
        if prompt is not None:
            attrs["gen_ai.input.messages"] = orjson.dumps(prompt).decode()
        if response is not None and isinstance(response.get("choices"), list):
            outputs = [c.get("message", c.get("text")) for c in response["choices"] if isinstance(c, dict)]
            attrs["gen_ai.output.messages"] = orjson.dumps(outputs).decode()
        elif isinstance(trace.tap, list):
            attrs["gen_ai.output.messages"] = orjson.dumps([streamed_text(trace.tap)]).decode()

    def address(self, replica: Any) -> tuple[str, int]:
        found = self.addresses.get(replica)
        if found is None:
            parts = urlsplit(replica.url)
            found = self.addresses[replica] = (parts.hostname or "", parts.port or (443 if parts.scheme == "https"
                                                                                     else 80))
        return found


def streamed_text(chunks: list[bytes]) -> str:
    """The text of a streamed answer, from its SSE events (chat deltas or completion text)."""
    out = []
    for event in sse_events(chunks):
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") if isinstance(delta, dict) else None
            text = text if isinstance(text, str) else choice.get("text")
            if isinstance(text, str):
                out.append(text)
    return "".join(out)
