"""Traces of every call (OpenTelemetry, GenAI semantic conventions), and the W3C trace context passed upstream.

Two moments touch a call. When it is sent upstream (`sending`), the proxy asks for the headers that carry the
trace on: the client's `traceparent` continued with a span id of the gateway's own (its upstream span), so
the client's agent trace, the gateway's spans and vLLM's own OpenTelemetry spans are one trace. With tracing
off the client's `traceparent` and `tracestate` pass through unchanged. When the call is finished (`finished`,
an observer of the proxy), it is set aside; every few dozen calls (or 50 ms after the first) the spans of
those set aside are built after the fact from the calls' perf_counter timestamps, with the ids chosen earlier,
written as OTLP protobuf (gateway/tracing/spans.py, gateway/tracing/wire.py) and handed to the export queue
(gateway/tracing/export.py): nothing of the SDK runs while the request is in flight.

One trace per request:
  `{operation} {model}` (SERVER): the whole call, GenAI attributes (operation, request and response model,
      token usage, finish reasons, server address) and the gateway's own (`llm_gateway.*`: key id, never the
      key; backend; served_by; queue wait; retries; the replica's in-flight count and limit at admission)
    `llm_gateway.queue` (INTERNAL): only when the call waited for a backend slot (at least `QUEUED`)
    `{operation} {served model}` (CLIENT), one per upstream attempt: server address and port, an event at
      the first streamed token; an attempt that was retried elsewhere ends in error
Prompt and completion text (`gen_ai.input.messages`, `gen_ai.output.messages`) only for the models the
policy names in `tracing.content_models`.

This module is what every gateway loads (with gateway/tracing/context.py: the trace context passed through, the
trace id for the access log); the tracer itself, with the OpenTelemetry SDK, is gateway/tracing/tracer.py, imported
only when tracing is on.
"""

from __future__ import annotations

from typing import Protocol

from backends.replicas import Replica
from gateway.tracing.context import passthrough
from policies.config import Tracing as TracingConfig
from policies.finished import Finished
from policies.metrics import GatewayMetrics
from policies.pipeline import Call


class Tracing(Protocol):
    """Off, or the tracer (gateway/tracing/tracer.py); an observer of finished calls (policies/finished.py)."""

    name: str
    enabled: bool

    def sending(self, call: Call, replica: Replica) -> bytes:
        """The header lines that carry the trace to `replica`."""

    def observe(self, record: Finished) -> None:
        """The call is over: its spans are written."""

    def close(self) -> None:
        """Serving has stopped: export what is left."""


class Off:
    """Tracing disabled: only the client's trace context is passed on."""

    name = "tracing"
    enabled = False

    def sending(self, call: Call, replica: Replica) -> bytes:
        return passthrough(call.request.headers)

    def observe(self, record: Finished) -> None:
        pass

    def close(self) -> None:
        pass


def tracing_for(config: TracingConfig, metrics: GatewayMetrics) -> Tracing:
    """The policy's tracing: the SDK is loaded only when it is on."""
    if not config.enabled:
        return Off()
    from gateway.tracing.tracer import Tracer

    return Tracer(config, metrics)
