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
        self.events = 0  # events passed on before any usage: a stand-in for tokens when a stream ends without it

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
        mark = events.rfind(USAGE_MARK)  # from the end: the usage event is the last but [DONE]
        if mark >= 0:
            events = self._take_usage(events, mark)
        if self.usage is None:  # only needed while no usage came: then it stands in for the token count
            self.events += events.count(b"\n") >> 1  # "data: {...}\n\n": two newlines an event, JSON has none
        if self.rename is not None:
            events = events.replace(*self.rename)
        return events

    def _take_usage(self, events: bytes, mark: int) -> bytes:
        """Parse the event at `mark`, the last carrying the usage mark, when it is the usage event (`choices: []`;
        with continuous usage stats every chunk has usage, and the final one is still the last); cut it out when
        the client did not ask for usage. The other events are not touched."""
        begin = events.rfind(SEP, 0, mark)
        begin = 0 if begin < 0 else begin + len(SEP)
        end = events.find(SEP, mark)
        end = len(events) if end < 0 else end + len(SEP)
        event = events[begin:end]
        if EMPTY_CHOICES not in event or not event.startswith(b"data: "):
            return events
        try:
            self.usage = orjson.loads(event[6:].rstrip(b"\n")).get("usage") or self.usage
        except orjson.JSONDecodeError:
            return events
        return events[:begin] + events[end:] if self.strip_usage else events


def model_rename(served: str, public: str) -> tuple[bytes, bytes] | None:
    if served == public:
        return None
    return b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(public)
