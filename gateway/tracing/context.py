"""The W3C trace context of a call (version 00): the client's `traceparent` and `tracestate` as read, passed on
unchanged when tracing is off, and the trace id the access log prints. What gateway/tracing/__init__.py and the tracer
(gateway/tracing/tracer.py) both read."""

from __future__ import annotations

import random
import re
from collections import deque
from collections.abc import Mapping

from backends.replicas import Replica
from policies.pipeline import Call, Slot

# W3C Trace Context, version 00: a trace id and a parent id not all zeros, flags; later versions may append
TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
TRACESTATE_MAX = 512  # W3C: a propagator may drop a longer one


class CallTrace:
    """The ids of one call's trace, fixed before anything is sent, and its upstream attempts."""

    __slots__ = ("trace_id", "parent", "span_id", "sampled", "state", "attempts", "tap", "end", "count")

    def __init__(self, trace_id: int, parent: int, sampled: bool, state: str) -> None:
        self.trace_id, self.parent, self.sampled, self.state = trace_id, parent, sampled, state
        self.span_id = random.getrandbits(64) or 1
        self.attempts: list[tuple[int, Replica, float, int, float | None]] = []  # span id, replica, sent, in flight, limit
        self.tap: list[bytes] | deque[bytes] | None = None
        self.end = 0.0  # perf_counter() when the call finished
        self.count = 0  # spans written for it


TRACE: Slot[CallTrace] = Slot("trace")  # the call's trace ids, once it has some (the tracer makes them)


def client_context(headers: Mapping[str, str]) -> tuple[str, int, int, bool, str] | None:
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


def passthrough(headers: Mapping[str, str]) -> bytes:
    """With tracing off: the client's trace context headers, unchanged, for the upstream request."""
    found = client_context(headers)
    if found is None:
        return b""
    header, _, _, _, state = found
    out = b"traceparent: %s\r\n" % header.encode("latin-1")
    return out + b"tracestate: %s\r\n" % state.encode("latin-1") if state else out


def trace_id_of(call: Call) -> str:
    """The call's trace id as 32 hex digits (for the access log), or "" when it has none."""
    trace = TRACE.get(call)
    if trace is not None:
        return f"{trace.trace_id:032x}"
    found = client_context(call.request.headers)
    return f"{found[1]:032x}" if found else ""
