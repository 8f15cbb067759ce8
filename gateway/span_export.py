"""Getting finished spans to the collector without ever slowing or failing a request.

The SDK's BatchSpanProcessor holds spans in a bounded queue and exports them in batches from its own thread
through the SDK's OTLP/HTTP exporter. Around them this module keeps its own count of spans waiting, so a span
that would overflow the queue is dropped here and counted (`llm_gateway_trace_spans_dropped{reason=
"queue_full"}`), and counts the spans of every failed export (`reason="export_failed"`). A collector that is
down costs an export thread that waits at most `export_timeout` per batch, those counts, and one log line a
minute at most: the exporter's own per-batch error lines are silenced, as they would repeat for every batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from policies.config import Tracing
from policies.metrics import GatewayMetrics

log = logging.getLogger("gateway.tracing")

LOG_EVERY = 60.0  # seconds between two lines about a collector that cannot be reached
QUIET = ("opentelemetry.exporter", "opentelemetry.sdk._shared_internal")  # their lines repeat per failed batch


class SpanPipe:
    """`put(spans)` from the event loop; the export happens on the processor's thread."""

    def __init__(self, config: Tracing, metrics: GatewayMetrics, exporter: SpanExporter | None = None) -> None:
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
        inner = exporter or OTLPSpanExporter(endpoint=config.endpoint, headers=config.headers(),
                                             timeout=config.export_timeout)
        self.processor = BatchSpanProcessor(
            _Counted(inner, self), max_queue_size=config.max_queue_size,
            schedule_delay_millis=config.schedule_delay * 1000,
            max_export_batch_size=config.max_export_batch_size,
            export_timeout_millis=config.export_timeout * 1000,
        )

    def put(self, spans: Sequence[ReadableSpan]) -> None:
        with self.lock:
            if self.waiting + len(spans) > self.capacity:
                room = False
            else:
                room = True
                self.waiting += len(spans)
        if not room:
            self.queue_full.inc(len(spans))
            self.failing(len(spans), "the export queue is full")
            return
        for span in spans:
            self.processor.on_end(span)

    def exported(self, count: int, ok: bool) -> None:
        """Called on the export thread after each batch."""
        with self.lock:
            self.waiting -= count
        if not ok:
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
        """Export what is queued (at most `timeout` seconds), then stop the export thread."""
        self.processor.force_flush(int(timeout * 1000))
        self.processor.shutdown()


class _Counted(SpanExporter):
    def __init__(self, inner: SpanExporter, pipe: SpanPipe) -> None:
        self.inner = inner
        self.pipe = pipe

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not kill the export thread
            result = SpanExportResult.FAILURE
        self.pipe.exported(len(spans), result == SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
