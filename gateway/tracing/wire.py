"""OTLP spans written straight to protobuf bytes: the few message shapes the gateway sends, nothing else.

Why not the SDK's encoder: building `ReadableSpan`s and encoding them with opentelemetry-exporter-otlp's
`encode_spans` cost ~0.3 ms of CPU per traced call on the benchmark machine, about as much as the gateway's
whole request path, so tracing every call halved the requests a core could serve. Writing the wire format
directly costs a small fraction of that. The export itself (batching, the HTTP client, its retries and
headers) stays the SDK's; the tests decode what this writes with opentelemetry-proto's own messages.

Field numbers are opentelemetry-proto's (opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

_fixed64 = struct.Struct("<Q").pack
_double = struct.Struct("<d").pack
_SMALL = [bytes([n]) for n in range(128)]
_KEYS: dict[str, bytes] = {}  # attribute key -> its encoded KeyValue.key field
_PAIRS: dict[tuple[str, object, type], bytes] = {}  # (key, value, its class) -> the encoded attribute
_DOUBLES: dict[str, bytes] = {}  # attribute key -> everything of a double attribute before its 8 bytes
_EVENTS: dict[str, bytes] = {}  # event name -> its encoded name field
_times = struct.Struct("<BQBQ").pack
PAIRS_MAX = 8192  # then the cache starts over: a bound, whatever the values

# span kinds and status codes as the protocol numbers them
INTERNAL, SERVER, CLIENT = 1, 2, 3
UNSET, ERROR = 0, 2


def varint(n: int) -> bytes:
    if n < 128:
        return _SMALL[n] if n >= 0 else varint(n + (1 << 64))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + varint(len(payload)) + payload


def any_value(value: object) -> bytes:
    """AnyValue: string 1, bool 2, int 3, double 4, array 5 (ArrayValue.values 1)."""
    if isinstance(value, str):
        return field(b"\x0a", value.encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + _double(value)
    if isinstance(value, (tuple, list)):
        return field(b"\x2a", b"".join(field(b"\x0a", any_value(v)) for v in value))
    return field(b"\x0a", str(value).encode())


def key_value(key: str, value: object) -> bytes:
    """A KeyValue message (key 1, value 2)."""
    return key_field(key) + field(b"\x12", any_value(value))


def attributes(tag: bytes, attrs: Mapping[str, object]) -> bytes:
    """Repeated KeyValue under `tag`."""
    return b"".join(field(tag, key_value(key, value)) for key, value in attrs.items())


def size(n: int) -> bytes:
    """A length as its varint."""
    return _SMALL[n] if n < 128 else varint(n)


def key_field(key: str) -> bytes:
    """KeyValue.key (field 1) of an attribute key, encoded once."""
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = _KEYS[key] = field(b"\x0a", key.encode())
    return encoded


def pair(key: str, value: object) -> bytes:
    """One span attribute (field 9) whose value repeats from call to call: encoded once, then looked up."""
    cached = (key, value, value.__class__)  # the class too: True == 1 == 1.0, but each is written differently
    found = _PAIRS.get(cached)
    if found is None:
        if len(_PAIRS) >= PAIRS_MAX:
            _PAIRS.clear()
        found = _PAIRS[cached] = field(b"\x4a", key_value(key, value))
    return found


def string_attribute(key: str, value: str) -> bytes:
    """One span attribute (field 9) with a string value that differs on every call (an id)."""
    raw = value.encode()
    n, name = len(raw), key_field(key)
    if n + len(name) < 124:  # every length fits one byte: the usual id
        return b"\x4a%c%b\x12%c\x0a%c%b" % (n + len(name) + 4, name, n + 2, n, raw)
    any_value = b"\x0a" + varint(n) + raw
    kv = name + b"\x12" + varint(len(any_value)) + any_value
    return b"\x4a" + varint(len(kv)) + kv


def double_attribute(key: str, value: float) -> bytes:
    """One span attribute (field 9) with a double value."""
    prefix = _DOUBLES.get(key)
    if prefix is None:
        kv_size = len(key_field(key)) + 11  # + value tag, length 9, AnyValue's tag, 8 bytes
        prefix = _DOUBLES[key] = b"\x4a" + size(kv_size) + key_field(key) + b"\x12\x09\x21"
    return prefix + _double(value)


def span_head(trace_id: bytes, span_id: int, parent_id: int = 0, trace_state: str = "") -> bytes:
    """A span's trace id (1), span id (2), trace state (3) and parent span id (4)."""
    head = b"\x0a\x10" + trace_id + b"\x12\x08" + span_id.to_bytes(8, "big")
    if trace_state:
        head += field(b"\x1a", trace_state.encode())
    return head + b"\x22\x08" + parent_id.to_bytes(8, "big") if parent_id else head


def name_and_kind(name: str, kind: int) -> bytes:
    """A span's name (5) and kind (6)."""
    return field(b"\x2a", name.encode()) + b"\x30" + varint(kind)


def times(start: int, end: int) -> bytes:
    """A span's start (7) and end (8), ns since the epoch."""
    return _times(0x39, start, 0x41, end)


def event(at: int, name: str) -> bytes:
    """A span event (field 11): time 1 (fixed64), name 2."""
    tail = _EVENTS.get(name)
    if tail is None:
        tail = _EVENTS[name] = field(b"\x12", name.encode())
    return b"\x5a" + size(9 + len(tail)) + b"\x09" + _fixed64(at) + tail


def status(code: int, message: str = "") -> bytes:
    """A span's status (field 15): message 2, code 3."""
    return field(b"\x7a", (field(b"\x12", message.encode()) if message else b"") + b"\x18" + varint(code))


def wrap(parts: Iterable[bytes]) -> bytes:
    """The parts of one Span joined as an entry of ScopeSpans.spans (field 2)."""
    payload = b"".join(parts)
    return b"\x12" + size(len(payload)) + payload


def span(trace_id: bytes, span_id: int, parent_id: int, name: str, kind: int, start: int, end: int,
         attrs: Mapping[str, object], events: Iterable[tuple[int, str]] = (), status_code: int = UNSET,
         message: str = "", trace_state: str = "") -> bytes:
    """One whole Span, as an entry of ScopeSpans.spans (field 2). Times in ns since the epoch; ids as ints."""
    parts = [span_head(trace_id, span_id, parent_id, trace_state), name_and_kind(name, kind), times(start, end),
             attributes(b"\x4a", attrs)]
    parts += (event(at, name) for at, name in events)
    if status_code:
        parts.append(status(status_code, message))
    return wrap(parts)


def resource(attrs: Mapping[str, object]) -> bytes:
    """A Resource message (attributes 1)."""
    return attributes(b"\x0a", attrs)


def scope(name: str, version: str = "") -> bytes:
    """An InstrumentationScope message (name 1, version 2)."""
    return field(b"\x0a", name.encode()) + (field(b"\x12", version.encode()) if version else b"")


def export_request(resource_message: bytes, scope_message: bytes, spans: list[bytes]) -> bytes:
    """ExportTraceServiceRequest: one ResourceSpans (resource 1, scope_spans 2) with one ScopeSpans (scope 1,
    spans 2) holding the already encoded spans; the spans (megabytes) are copied once."""
    scope = field(b"\x0a", scope_message)
    scope_spans_size = len(scope) + sum(map(len, spans))
    resource = field(b"\x0a", resource_message)
    resource_spans_size = len(resource) + 1 + len(varint(scope_spans_size)) + scope_spans_size
    return b"".join([b"\x0a", varint(resource_spans_size), resource, b"\x12", varint(scope_spans_size), scope,
                     *spans])
