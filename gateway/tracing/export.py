"""Getting finished spans to the collector without ever slowing or failing a request.

The SDK's BatchSpanProcessor holds finished calls' spans (already protobuf bytes, a few dozen calls' at a time:
gateway/tracing/tracer.py, gateway/tracing/spans.py) in a bounded queue and exports them in batches from its own thread
through the SDK's OTLP/HTTP exporter, whose HTTP client (headers, retries, timeout) sends the request built
from those bytes. Around them this module keeps its own count of calls waiting, so calls whose spans would
overflow the queue are dropped here and counted (`llm_gateway_trace_spans_dropped{reason="queue_full"}`), and
counts the spans of every failed export (`reason="export_failed"`). A collector that is
down costs an export thread that waits at most `export_timeout` per batch, those counts, and one log line a
minute at most: the exporter's own per-batch error lines are silenced, as they would repeat for every batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.trace import INVALID_SPAN_ID, SpanContext, TraceFlags

from gateway.tracing.wire import export_request
from policies.config import Tracing
from policies.metrics import GatewayMetrics

log = logging.getLogger("gateway.tracing")

LOG_EVERY = 60.0  # seconds between two lines about a collector that cannot be reached
QUIET = ("opentelemetry.exporter", "opentelemetry.sdk._shared_internal")  # their lines repeat per failed batch
# the processor only looks at this (it skips unsampled spans); every call handed over was sampled
SAMPLED = SpanContext(1, INVALID_SPAN_ID + 1, False, TraceFlags(TraceFlags.SAMPLED))


class Encoded:
    """Finished calls' spans as the processor queues them: their wire bytes, how many spans, how many calls."""

    __slots__ = ("wire", "count", "calls")
    context = SAMPLED

    def __init__(self, wire: bytes, count: int, calls: int) -> None:
        self.wire, self.count, self.calls = wire, count, calls


class SpanPipe:
    """`put(encoded)` from the event loop, up to `calls_per_put` calls' spans at a time; the export happens on
    the processor's thread. The queue's bound and the export batch are counted in calls, as the policy gives
    them."""

    def __init__(self, config: Tracing, metrics: GatewayMetrics, resource: bytes, scope: bytes,
                 calls_per_put: int) -> None:
        for name in QUIET:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.capacity = config.max_queue_size
        self.waiting = 0
        self.lock = threading.Lock()
        self.queue_full = metrics.spans_dropped.labels("queue_full")
        self.export_failed = metrics.spans_dropped.labels("export_failed")
        self.endpoint = config.endpoint
        self.logged_at = -LOG_EVERY
        self.failed_since_log = 0
        exporter = WireExporter(self, resource, scope, endpoint=config.endpoint, headers=config.headers(),
                                timeout=config.export_timeout)
        self.processor = BatchSpanProcessor(
            exporter, max_queue_size=config.max_queue_size,
            schedule_delay_millis=config.schedule_delay * 1000,
            max_export_batch_size=max(1, config.max_export_batch_size // calls_per_put),
            export_timeout_millis=config.export_timeout * 1000,
        )

    def put(self, encoded: Encoded) -> None:
        with self.lock:
            room = self.waiting + encoded.calls <= self.capacity
            if room:
                self.waiting += encoded.calls
        if room:
            # the SDK's batching carries our already encoded spans: it only queues, counts and hands them back
            self.processor.on_end(encoded)  # type: ignore[arg-type]
        else:
            self.queue_full.inc(encoded.count)
            self.failing(encoded.count, "the export queue is full")

    def exported(self, batch: Sequence[Encoded], ok: bool) -> None:
        """Called on the export thread after each batch."""
        with self.lock:
            self.waiting -= sum(e.calls for e in batch)
        if not ok:
            count = sum(e.count for e in batch)
            self.export_failed.inc(count)
            self.failing(count, "the collector could not be reached or refused the batch")

    def failing(self, count: int, why: str) -> None:
        self.failed_since_log += count
        now = time.monotonic()
        if now - self.logged_at >= LOG_EVERY:
            self.logged_at = now
            log.warning("tracing: %d spans not delivered to %s since the last report: %s (requests are not"
                        " affected; see llm_gateway_trace_spans_dropped)", self.failed_since_log, self.endpoint, why)
            self.failed_since_log = 0

    def close(self, timeout: float) -> None:
        """Export what is queued and stop the export thread, waiting at most `timeout` seconds: with the
        collector down the processor's own shutdown may wait for every queued batch to time out in turn, so it
        runs on a daemon thread that the process does not wait for."""
        closing = threading.Thread(target=self.processor.shutdown, name="tracing-shutdown", daemon=True)
        closing.start()
        closing.join(timeout)


class WireExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP exporter sending requests built from already encoded spans."""

    def __init__(self, pipe: SpanPipe, resource: bytes, scope: bytes, **options: Any) -> None:
        super().__init__(**options)
        self.pipe, self.resource, self.scope = pipe, resource, scope

    def export(self, batch: Sequence[Encoded]) -> SpanExportResult:  # type: ignore[override]  # what put() queued
        ok = False
        try:
            spans = [e.wire for e in batch]
            # the exporter's own HTTP client: its headers, timeout, retries with backoff
            ok = self._client.export(export_request(self.resource, self.scope, spans)).success
        except Exception:  # noqa: BLE001 - a failed export must not end the export thread
            ok = False
        finally:
            self.pipe.exported(batch, ok)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

