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
from typing import Any

_fixed64 = struct.Struct("<Q").pack
_double = struct.Struct("<d").pack
_SMALL = [bytes([n]) for n in range(128)]
_KEYS: dict[str, bytes] = {}  # attribute key -> its encoded KeyValue.key field
_PAIRS: dict[tuple[str, Any], bytes] = {}  # (key, value) -> the encoded KeyValue, for values that repeat
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


def any_value(value: Any) -> bytes:
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


def key_value(key: str, value: Any) -> bytes:
    """A KeyValue message (key 1, value 2)."""
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = _KEYS[key] = field(b"\x0a", key.encode())
    return encoded + field(b"\x12", any_value(value))


def attributes(tag: bytes, attrs: Mapping[str, Any]) -> bytes:
    """Repeated KeyValue under `tag`."""
    return b"".join(field(tag, key_value(key, value)) for key, value in attrs.items())


def repeated_attributes(attrs: Mapping[str, Any]) -> bytes:
    """Span attributes (field 9) whose values repeat from call to call (model, backend, status, small counts):
    each (key, value) is encoded once and then looked up."""
    out = []
    for pair in attrs.items():
        encoded = _PAIRS.get(pair)
        if encoded is None:
            if len(_PAIRS) >= PAIRS_MAX:
                _PAIRS.clear()
            encoded = _PAIRS[pair] = field(b"\x4a", key_value(*pair))
        out.append(encoded)
    return b"".join(out)


def span(trace_id: bytes, span_id: int, parent_id: int, name: str, kind: int, start: int, end: int,
         attrs: Mapping[str, Any], events: Iterable[tuple[int, str]] = (), status: int = UNSET,
         message: str = "", trace_state: str = "", repeated: Mapping[str, Any] | None = None,
         encoded: bytes = b"") -> bytes:
    """One Span, as an entry of ScopeSpans.spans (field 2). Times in ns since the epoch; ids as ints.
    `attrs` are encoded as they come, `repeated` through the cache (see `repeated_attributes`), `encoded` are
    attributes already encoded (`attributes(b"\x4a", ...)`)."""
    out = [b"\x0a\x10", trace_id, b"\x12\x08", span_id.to_bytes(8, "big")]
    if trace_state:
        out.append(field(b"\x1a", trace_state.encode()))
    if parent_id:
        out += (b"\x22\x08", parent_id.to_bytes(8, "big"))
    out += (field(b"\x2a", name.encode()), b"\x30", varint(kind), b"\x39", _fixed64(start), b"\x41", _fixed64(end),
            attributes(b"\x4a", attrs), repeated_attributes(repeated) if repeated else b"", encoded)
    for at, event in events:  # Event: time 1 (fixed64), name 2
        out.append(field(b"\x5a", b"\x09" + _fixed64(at) + field(b"\x12", event.encode())))
    if status:  # Status: message 2, code 3
        out.append(field(b"\x7a", (field(b"\x12", message.encode()) if message else b"") + b"\x18" + varint(status)))
    return field(b"\x12", b"".join(out))


def resource(attrs: Mapping[str, Any]) -> bytes:
    """A Resource message (attributes 1)."""
    return attributes(b"\x0a", attrs)


def scope(name: str, version: str = "") -> bytes:
    """An InstrumentationScope message (name 1, version 2)."""
    return field(b"\x0a", name.encode()) + (field(b"\x12", version.encode()) if version else b"")


def export_request(resource_message: bytes, scope_message: bytes, spans: Iterable[bytes]) -> bytes:
    """ExportTraceServiceRequest: one ResourceSpans (resource 1, scope_spans 2) with one ScopeSpans (scope 1,
    spans 2) holding the already encoded spans."""
    scope_spans = field(b"\x0a", scope_message) + b"".join(spans)
    return field(b"\x0a", field(b"\x0a", resource_message) + field(b"\x12", scope_spans))
