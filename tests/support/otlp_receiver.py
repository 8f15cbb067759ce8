"""A local OTLP/HTTP traces receiver: decodes each POST to /v1/traces as opentelemetry-proto's
ExportTraceServiceRequest, as a collector would, and keeps the spans, the raw bodies and the request headers."""

from __future__ import annotations

import http.server
import threading
import time
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.support.servers import free_port


@dataclass
class Span:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    start: int
    end: int
    attributes: dict
    events: list[str]
    status_code: int
    resource: dict


def value_of(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(value_of(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    spans: list[Span] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def take(self, body: bytes, headers: dict) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: value_of(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(Span(
                        s.name, s.kind, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: value_of(a.value) for a in s.attributes}, [e.name for e in s.events],
                        s.status.code, resource))
        with self.lock:
            self.bodies.append(body)
            self.headers.append(headers)
            self.spans.extend(spans)

    def wait_for(self, predicate, timeout: float = 30.0, count: int = 1) -> list[Span]:
        """The spans that match, once there are at least `count` of them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if predicate(s)]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no such span within {timeout} s; have {[s.name for s in self.spans]}")

    def __enter__(self) -> Receiver:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.take(body, {k.lower(): v for k, v in self.headers.items()})
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
