"""The hand-written OTLP span encoding (gateway/tracing/wire.py) read back by opentelemetry-proto's own messages."""

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gateway.tracing import wire
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


def decode_span(parts: list[bytes]):
    request = ExportTraceServiceRequest.FromString(wire.export_request(wire.resource({}), wire.scope("s"),
                                                                       [wire.wrap(parts)]))
    return request.resource_spans[0].scope_spans[0].spans[0]


def test_the_per_call_pieces_decode_as_written():
    """What the tracer writes per call (gateway/tracing/spans.py): ids, times, string attributes short and long
    (lengths of one byte and of several), doubles, cached pairs whose values compare equal across types, an
    event; and an export request whose lengths span several bytes."""
    long_id = "req-" + "é" * 200  # multi-byte UTF-8, past the one-byte lengths
    span = decode_span([
        wire.span_head(bytes(range(16)), 0xAB, 0xCD, "k=v"), wire.name_and_kind("chat m", wire.SERVER),
        wire.times(5, 7_000_000_000_000_000_000), wire.string_attribute("short", "req-1"),
        wire.string_attribute("long", long_id), wire.string_attribute("empty", ""),
        wire.double_attribute("wait", 0.125), wire.pair("one", 1), wire.pair("true", True),
        wire.pair("float", 1.0), wire.pair("big", 2**63 - 1), wire.pair("reasons", ("stop",)),
        wire.event(6, "gen_ai.first_token"), wire.status(wire.ERROR)])
    assert (span.name, span.kind, span.trace_state) == ("chat m", wire.SERVER, "k=v")
    assert span.span_id == (0xAB).to_bytes(8, "big") and span.parent_span_id == (0xCD).to_bytes(8, "big")
    assert (span.start_time_unix_nano, span.end_time_unix_nano) == (5, 7_000_000_000_000_000_000)
    attrs = {a.key: (a.value.WhichOneof("value"), value_of(a.value)) for a in span.attributes}
    assert attrs == {"short": ("string_value", "req-1"), "long": ("string_value", long_id),
                     "empty": ("string_value", ""), "wait": ("double_value", 0.125), "one": ("int_value", 1),
                     "true": ("bool_value", True), "float": ("double_value", 1.0),
                     "big": ("int_value", 2**63 - 1), "reasons": ("array_value", ("stop",))}
    assert [(e.name, e.time_unix_nano) for e in span.events] == [("gen_ai.first_token", 6)]
    assert span.status.code == wire.ERROR
    # one key, values equal to each other (1 == True == 1.0): each is written as what it is, not as the first
    for value, kind in ((1, "int_value"), (True, "bool_value"), (1.0, "double_value")):
        (attr,) = decode_span([wire.span_head(bytes(16), 1), wire.pair("n", value)]).attributes
        assert (attr.value.WhichOneof("value"), value_of(attr.value)) == (kind, value)
    many = [wire.span(bytes(16), n + 1, 0, "s" * 300, wire.CLIENT, 1, 2, {}) for n in range(300)]
    request = ExportTraceServiceRequest.FromString(wire.export_request(wire.resource({"service.name": "gw"}),
                                                                       wire.scope("s"), many))
    assert [s.span_id for s in request.resource_spans[0].scope_spans[0].spans] == [
        (n + 1).to_bytes(8, "big") for n in range(300)]
