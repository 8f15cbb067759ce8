"""The hand-written OTLP span encoding (gateway/otlp_wire.py) read back by opentelemetry-proto's own messages."""

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gateway import otlp_wire as wire
from tests.support.otlp_receiver import value_of


def test_spans_decode_as_opentelemetry_proto_reads_them():
    trace_id = bytes(range(16))
    attrs = {"s": "héllo", "t": True, "f": False, "i": 7, "big": 2**40 + 3, "neg": -5, "d": 0.25,
             "reasons": ("stop", "length"), "empty": ""}
    spans = [
        wire.span(trace_id, 0xAB, 0x1234, "chat m", wire.SERVER, 1_000_000_001, 2_000_000_002, attrs,
                  status_code=wire.ERROR, message="HTTP 502", trace_state="vendor=1"),
        wire.span(trace_id, 0xCD, 0xAB, "chat served", wire.CLIENT, 1_500_000_000, 1_900_000_000, {"n": 300},
                  events=[(1_600_000_000, "gen_ai.first_token")]),
    ]
    raw = wire.export_request(wire.resource({"service.name": "gw"}), wire.scope("llm-gateway", "1"), spans)
    request = ExportTraceServiceRequest.FromString(raw)
    (rs,) = request.resource_spans
    assert {a.key: value_of(a.value) for a in rs.resource.attributes} == {"service.name": "gw"}
    (ss,) = rs.scope_spans
    assert (ss.scope.name, ss.scope.version) == ("llm-gateway", "1")
    server, client = ss.spans
    assert server.trace_id == trace_id and server.span_id == (0xAB).to_bytes(8, "big")
    assert server.parent_span_id == (0x1234).to_bytes(8, "big") and server.trace_state == "vendor=1"
    assert (server.name, server.kind) == ("chat m", 2)
    assert (server.start_time_unix_nano, server.end_time_unix_nano) == (1_000_000_001, 2_000_000_002)
    assert {a.key: value_of(a.value) for a in server.attributes} == attrs
    assert (server.status.code, server.status.message) == (2, "HTTP 502")
    assert client.kind == 3 and client.parent_span_id == server.span_id and client.status.code == 0
    assert [(e.name, e.time_unix_nano) for e in client.events] == [("gen_ai.first_token", 1_600_000_000)]
    assert value_of(client.attributes[0].value) == 300
