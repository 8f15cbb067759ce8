"""Traces of every call (OpenTelemetry, GenAI semantic conventions), and the W3C trace context passed upstream.

Two moments touch a call. When it is sent upstream (`sending`), the proxy asks for the headers that carry the
trace on: the client's `traceparent` continued with a span id of the gateway's own (its upstream span), so
the client's agent trace, the gateway's spans and vLLM's own OpenTelemetry spans are one trace. With tracing
off the client's `traceparent` and `tracestate` pass through unchanged. When the call is finished (`finished`,
an observer of the proxy), it is set aside; every few dozen calls (or 50 ms after the first) the spans of
those set aside are built after the fact from the calls' perf_counter timestamps, with the ids chosen earlier,
written as OTLP protobuf (gateway/call_spans.py, gateway/otlp_wire.py) and handed to the export queue
(gateway/span_export.py): nothing of the SDK runs while the request is in flight.

One trace per request:
  `{operation} {model}` (SERVER): the whole call, GenAI attributes (operation, request and response model,
      token usage, finish reasons, server address) and the gateway's own (`llm_gateway.*`: key id, never the
      key; backend; served_by; queue wait; retries; the replica's in-flight count and limit at admission)
    `llm_gateway.queue` (INTERNAL): only when the call waited for a backend slot (at least `QUEUED`)
    `{operation} {served model}` (CLIENT), one per upstream attempt: server address and port, an event at
      the first streamed token; an attempt that was retried elsewhere ends in error
Prompt and completion text (`gen_ai.input.messages`, `gen_ai.output.messages`) only for the models the
policy names in `tracing.content_models`.

This module is what every gateway loads (the trace context passed through, the trace id for the access log);
the tracer itself, with the OpenTelemetry SDK, is gateway/tracer.py, imported only when tracing is on.
"""

from __future__ import annotations

import re
from typing import Any

from policies.config import Tracing as TracingConfig
from policies.metrics import GatewayMetrics

# W3C Trace Context, version 00: a trace id and a parent id not all zeros, flags; later versions may append
TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
TRACESTATE_MAX = 512  # W3C: a propagator may drop a longer one


def client_context(headers: Any) -> tuple[str, int, int, bool, str] | None:
    """The client's valid traceparent as (header, trace id, parent span id, sampled, tracestate), else None."""
    header = headers.get("traceparent")
    if not header:
        return None
    match = TRACEPARENT.match(header)
    if match is None or match[1] == "ff" or (match[1] == "00" and match[5]):
        return None
    trace_id, parent = int(match[2], 16), int(match[3], 16)
    if not trace_id or not parent:
        return None
    state = headers.get("tracestate") or ""
    if len(state) > TRACESTATE_MAX or "\r" in state or "\n" in state:
        state = ""
    return header, trace_id, parent, bool(int(match[4], 16) & 1), state


def passthrough(headers: Any) -> bytes:
    """With tracing off: the client's trace context headers, unchanged, for the upstream request."""
    found = client_context(headers)
    if found is None:
        return b""
    header, _, _, _, state = found
    out = b"traceparent: %s\r\n" % header.encode("latin-1")
    return out + b"tracestate: %s\r\n" % state.encode("latin-1") if state else out


def trace_id_of(call: Any) -> str:
    """The call's trace id as 32 hex digits (for the access log), or "" when it has none."""
    if call.trace is not None:
        return f"{call.trace.trace_id:032x}"
    found = client_context(call.headers)
    return f"{found[1]:032x}" if found else ""


class Off:
    """Tracing disabled: only the client's trace context is passed on."""

    enabled = False

    def sending(self, call: Any, replica: Any) -> bytes:
        return passthrough(call.headers)

    def finished(self, call: Any) -> None:
        pass

    def close(self) -> None:
        pass


def tracing_for(config: TracingConfig, metrics: GatewayMetrics):
    """The policy's tracing: the SDK is loaded only when it is on."""
    if not config.enabled:
        return Off()
    from gateway.tracer import Tracer

    return Tracer(config, metrics)
