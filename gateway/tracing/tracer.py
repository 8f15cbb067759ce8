"""The tracer of gateway/tracing/__init__.py (read that first): a trace per call, written when the call is finished."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, set_span_in_context

from gateway.tracing import wire
from gateway.tracing.spans import SpanWriter
from gateway.tracing.export import Encoded, SpanPipe
from gateway.tracing.context import TRACE, CallTrace, client_context, passthrough
from backends.replicas import Replica
from policies.config import Tracing as TracingConfig
from policies.finished import Finished
from policies.metrics import GatewayMetrics
from policies.pipeline import Call

log = logging.getLogger("gateway.tracing")

# finished calls' spans are written in batches, on the event loop: over a batch the code and caches stay warm,
# where writing each call's between requests took ~1.7 times the CPU (22 against 13 us, in the running gateway
# under load against a tight loop; docs/benchmarks.md). A batch is written at WRITE_EVERY calls or WRITE_AFTER
# seconds after its first, and holds its calls (bodies, responses) until then
WRITE_EVERY = 64
WRITE_AFTER = 0.05
SAMPLED, NOT_SAMPLED = TraceFlags(TraceFlags.SAMPLED), TraceFlags(TraceFlags.DEFAULT)
getrandbits, perf_counter = random.getrandbits, time.perf_counter  # per call: no module attribute lookups


class Tracer:
    enabled = True

    def __init__(self, config: TracingConfig, metrics: GatewayMetrics) -> None:
        ratio = TraceIdRatioBased(config.sampling_ratio)
        self.id_limit, self.bound = ratio.TRACE_ID_LIMIT, ratio.bound
        self.sampler = ParentBased(ratio)  # a client's traceparent: its sampled flag decides
        resource = Resource.create({"service.name": config.service_name})  # + OTEL_RESOURCE_ATTRIBUTES
        self.content_models = frozenset(config.content_models)
        self.write_every = min(WRITE_EVERY, config.max_queue_size)
        self.pipe = SpanPipe(config, metrics, wire.resource(resource.attributes), wire.scope("llm-gateway"),
                             self.write_every)
        self.timeout = config.export_timeout
        self.writer = SpanWriter(frozenset(config.content_models))
        self.done: list[Call] = []  # finished sampled calls whose spans are not written yet
        self.timer: asyncio.TimerHandle | None = None
        self.writing = threading.Lock()

    def start(self, call: Call) -> CallTrace:
        """The call's trace ids, when the gateway first needs them: the client's trace continued, or a new one."""
        found = client_context(call.request.headers)
        if found is None:  # a new trace: TraceIdRatioBased's own test, without building a SamplingResult
            trace_id = getrandbits(128) or 1
            trace = CallTrace(trace_id, 0, trace_id & self.id_limit < self.bound, "")
        else:
            _, trace_id, parent, sampled, state = found
            remote = SpanContext(trace_id, parent, True, SAMPLED if sampled else NOT_SAMPLED)
            decision = self.sampler.should_sample(set_span_in_context(NonRecordingSpan(remote)), trace_id,
                                                  call.request.route, SpanKind.SERVER)
            trace = CallTrace(trace_id, parent, decision.decision is Decision.RECORD_AND_SAMPLE, state)
        TRACE.put(call, trace)
        return trace

    def sending(self, call: Call, replica: Replica) -> bytes:
        """The headers that carry the trace upstream; records the attempt for its span."""
        try:
            trace = TRACE.get(call) or self.start(call)
            span_id = getrandbits(64) or 1
            trace.attempts.append((span_id, replica, perf_counter(), replica.in_flight, replica.limit))
            if trace.sampled:
                if call.stream and trace.tap is None:  # every chunk, or the last two
                    call.tap = trace.tap = [] if call.model in self.content_models else deque(maxlen=2)
                out = b"traceparent: 00-%032x-%016x-01\r\n" % (trace.trace_id, span_id)
            else:
                out = b"traceparent: 00-%032x-%016x-00\r\n" % (trace.trace_id, span_id)
            return out + b"tracestate: %s\r\n" % trace.state.encode("latin-1") if trace.state else out
        except Exception:  # a tracing bug must never fail a request: the call goes on untraced
            log.exception("tracing: could not start the trace of request %s", call.request.id)
            TRACE.put(call, CallTrace(1, 0, False, ""))  # not sampled: nothing more is recorded for it
            return passthrough(call.request.headers)

    name = "tracing"  # as an observer of finished calls (policies/finished.py)

    def observe(self, record: Finished) -> None:
        if record.call is not None:
            self.finished(record.call)

    def finished(self, call: Call) -> None:
        try:
            trace = TRACE.get(call) or self.start(call)
            if not trace.sampled:
                return
            trace.end = perf_counter()
            done = self.done
            done.append(call)
            if len(done) >= self.write_every:
                self.write()
            elif self.timer is None:
                try:
                    self.timer = asyncio.get_running_loop().call_later(WRITE_AFTER, self.write)
                except RuntimeError:  # not on an event loop (an embedding program's thread): now, then
                    self.write()
        except Exception:  # a tracing bug must never fail a request: this call's trace is lost
            log.exception("tracing: could not record the trace of request %s", call.request.id)

    def write(self) -> None:
        """The spans of the calls finished since the last time, in one go, handed to the export queue."""
        with self.writing:  # the event loop's, or close()'s on a worker thread
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            done, self.done = self.done, []
        offset = time.time_ns() - time.perf_counter_ns()
        spans, count = [], 0
        for call in done:
            try:
                trace = TRACE.of(call)
                spans.append(self.writer.spans(call, trace, offset))
                count += trace.count
            except Exception:  # a tracing bug must never fail a request: this call's trace is lost
                log.exception("tracing: could not record the trace of request %s", call.request.id)
        if spans:
            self.pipe.put(Encoded(b"".join(spans), count, len(spans)))

    def close(self) -> None:
        """Called once serving has stopped (from a worker thread): the last calls' spans, then the export."""
        self.write()
        self.pipe.close(self.timeout)
