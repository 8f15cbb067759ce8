"""Relaying a backend's SSE stream to the client as it arrives, touching only what the gateway must.

Bytes are passed on at event boundaries without re-encoding. Only the final usage event (`choices: []` with
`usage`) is parsed, for token accounting, and dropped again when the client did not ask for usage. When the
backend's served model name differs from the public one, `"model":"<served>"` is rewritten in place.
"""

from __future__ import annotations

from typing import Any

import orjson

SEP = b"\n\n"
USAGE_MARK = b'"usage":{'
EMPTY_CHOICES = b'"choices":[]'


class SSERelay:
    def __init__(self, strip_usage: bool, rename: tuple[bytes, bytes] | None = None) -> None:
        self.strip_usage = strip_usage
        self.rename = rename
        self.usage: dict[str, Any] | None = None
        self.pending = b""
        self.events = 0  # events passed on: a stand-in for tokens when a stream ends without usage

    def feed(self, chunk: bytes) -> bytes:
        """Take raw upstream bytes; return the complete events ready for the client (possibly b"")."""
        data = self.pending + chunk if self.pending else chunk
        cut = data.rfind(SEP)
        if cut < 0:
            self.pending = data
            return b""
        end = cut + len(SEP)
        ready, self.pending = data[:end], data[end:]
        return self._process(ready)

    def flush(self) -> bytes:
        """Whatever is left when the upstream ends (a well-formed stream leaves nothing)."""
        rest, self.pending = self.pending, b""
        return self._process(rest) if rest else b""

    def _process(self, events: bytes) -> bytes:
        self.events += events.count(SEP)
        if USAGE_MARK in events:
            events = self._take_usage(events)
        if self.rename is not None:
            events = events.replace(*self.rename)
        return events

    def _take_usage(self, events: bytes) -> bytes:
        kept = []
        for event in events.split(SEP):
            if USAGE_MARK in event and EMPTY_CHOICES in event and event.startswith(b"data: "):
                try:
                    self.usage = orjson.loads(event[6:]).get("usage") or self.usage
                except orjson.JSONDecodeError:
                    pass
                else:
                    if self.strip_usage:
                        continue
            kept.append(event)
        return SEP.join(kept)


def model_rename(served: str, public: str) -> tuple[bytes, bytes] | None:
    if served == public:
        return None
    return b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(public)
