"""Relaying a backend's SSE stream to the client as it arrives, touching only what the gateway must.

Bytes are passed on at event boundaries without re-encoding. Only the event that carries usage is parsed (as
JSON: a provider's spacing, key order or extra fields never hide it), for token accounting, and dropped again
when the client did not ask for usage. When the backend's served model name differs from the public one,
`"model":"<served>"` is rewritten in place. `SSERelay` carries chat and completions streams (`data:` lines, a
usage chunk, `[DONE]`); `EventRelay` the `event:` + `data:` frames of the Responses and Anthropic Messages APIs;
`ReplayRelay` a stored response's events streamed again (a Responses retrieve), whose tokens were counted when
it was made. One event is bounded (`max_event`, the policy's upstream.max_event_bytes): an upstream that sends
more without an event boundary ends the stream with TooLarge, holding no more than that. CRLF line ends (which
SSE allows) are passed on as LF, so that such a stream is cut into events and metered like any other.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from backends.http1 import Limits, TooLarge

SEP = b"\n\n"
CR = b"\r"
USAGE_KEY = b'"usage"'  # cannot occur inside a JSON string (its quotes would be escaped): only as a key
USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')  # ...whose value is an object (not null, as OpenAI sends on chunks)


class Frames:
    """Cuts upstream bytes at event boundaries (a blank line): complete events go on, the rest waits (at most
    `max_event` bytes of it)."""

    pending = b""
    max_event = Limits().event_bytes
    replay = False  # True: the stream repeats stored events: no tokens, no first-token time, no verdict on the backend
    ended = False  # True: a frame that ends the stream has passed; whatever the upstream does next is not waited for

    def feed(self, chunk: bytes) -> bytes:
        """Take raw upstream bytes; return the complete events ready for the client (possibly b"")."""
        data = self.pending + chunk if self.pending else chunk
        if 13 in data:  # a CR: CRLF framing (SSE allows it): events and usage must not depend on a provider's line ends
            data = data.replace(b"\r\n", b"\n")  # a \r that ends a chunk waits in `pending` for its \n
        cut = data.rfind(SEP)
        if cut < 0:
            self.pending = data
            self._bound()
            return b""
        end = cut + len(SEP)
        ready, rest = data[:end], data[end:]
        self.pending = rest
        if rest and len(rest) > self.max_event:
            self._bound()
        return self._process(ready)

    def _bound(self) -> None:
        if len(self.pending) > self.max_event:
            self.pending = b""
            raise TooLarge(f"sent an event over the upstream.max_event_bytes of {self.max_event} bytes")

    def flush(self) -> bytes:
        """Whatever is left when the upstream ends (a well-formed stream leaves nothing)."""
        rest, self.pending = self.pending, b""
        return self._process(rest) if rest else b""

    def _process(self, events: bytes) -> bytes:
        raise NotImplementedError


def data_of(line: bytes) -> Any:
    """The JSON of one `data:` line (with or without the space after the colon); None if it is not JSON."""
    try:
        return orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        return None


class SSERelay(Frames):
    def __init__(self, strip_usage: bool, rename: tuple[bytes, bytes] | None = None) -> None:
        self.strip_usage = strip_usage
        self.rename = rename
        self.usage: dict[str, Any] | None = None
        self.pending = b""
        self.events = 0  # events passed on before any usage: a stand-in for tokens when a stream ends without it

    @staticmethod
    def error_frame(body: bytes) -> bytes:
        return b"data: " + body + b"\n\n"

    def _process(self, events: bytes) -> bytes:
        mark = events.rfind(USAGE_KEY)  # from the end: the usage event is the last but [DONE]
        while mark >= 0 and not events.startswith(b":{", mark + 7):  # compact JSON (vLLM's) needs no more
            if not events.startswith(b":null", mark + 7) and USAGE_OBJECT.match(events, mark) is not None:
                break  # "usage": {  (json.dumps's spacing, or any other)
            mark = events.rfind(USAGE_KEY, 0, mark)  # "usage":null, as OpenAI sends on every chunk
        if mark >= 0:
            events = self._take_usage(events, mark)
        if self.usage is None:  # only needed while no usage came: then it stands in for the token count
            self.events += events.count(b"\n") >> 1  # "data: {...}\n\n": two newlines an event, JSON has none
        if self.rename is not None:
            events = events.replace(*self.rename)
        return events

    def _take_usage(self, events: bytes, mark: int) -> bytes:
        """Parse the event at `mark`, the last whose JSON has a `usage` object: its usage is the call's (with
        continuous usage stats every chunk has a running total, and the final one is still the last). The
        usage event proper (`choices: []`) is cut out when the client did not ask for usage; no other event is
        touched."""
        begin = events.rfind(SEP, 0, mark)
        begin = 0 if begin < 0 else begin + len(SEP)
        end = events.find(SEP, mark)
        end = len(events) if end < 0 else end + len(SEP)
        event = events[begin:end]
        data = data_of(event) if event.startswith(b"data:") else None
        usage = data.get("usage") if isinstance(data, dict) else None
        if not isinstance(usage, dict):
            return events
        self.usage = usage
        if self.strip_usage and data.get("choices") == []:
            return events[:begin] + events[end:]
        return events


def model_rename(served: str, public: str) -> tuple[bytes, bytes] | None:
    if served == public:
        return None
    return b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(public)


EVENT = b"event:"


class EventRelay(Frames):
    """Streams of `event: <type>` + `data: <json>` frames (the Responses API, Anthropic's Messages API), passed on
    at frame boundaries as they come. Only the frames whose type is in `usage_events` are parsed: each maps the
    frame's JSON to usage in the gateway's terms (prompt_tokens, completion_tokens), merged as they arrive
    (Anthropic reports the prompt at the start and the output at the end). There is no `[DONE]`; `ends` names
    the frames after which the stream is over even if the upstream keeps it open (vLLM does, on a background
    response that failed)."""

    def __init__(self, usage_events: dict[bytes, Callable[[dict[str, Any]], dict[str, Any] | None]],
                 rename: tuple[bytes, bytes] | None = None, ends: tuple[bytes, ...] = ()) -> None:
        self.usage_events = usage_events
        self.rename = rename
        self.ends = ends
        self.usage: dict[str, Any] | None = None
        self.pending = b""
        self.events = 0

    def _process(self, frames: bytes) -> bytes:
        for name, extract in self.usage_events.items():
            at = self._frame_of(frames, name)
            if at >= 0:
                self._take_usage(frames, at, extract)
        self._note_end(frames)
        if self.usage is None:
            self.events += frames.count(SEP)
        if self.rename is not None:
            frames = frames.replace(*self.rename)
        return frames

    def _note_end(self, frames: bytes) -> None:
        if any(self._frame_of(frames, name) >= 0 for name in self.ends):
            self.ended = True

    @staticmethod
    def _frame_of(frames: bytes, name: bytes) -> int:
        """Where the frame of type `name` starts in `frames` (its `event:` line, with or without a space after
        the colon), or -1."""
        at = frames.find(name + b"\n")
        if at <= 0:
            return -1
        at = at - 7 if frames[at - 1:at] == b" " else at - 6
        return at if frames[at:at + 6] == EVENT and (at == 0 or frames[at - 1:at] == b"\n") else -1

    def _take_usage(self, frames: bytes, at: int, extract) -> None:
        end = frames.find(SEP, at)
        frame = frames[at:len(frames) if end < 0 else end]
        for line in frame.split(b"\n"):
            if line.startswith(b"data:"):
                data = data_of(line)
                found = extract(data) if isinstance(data, dict) else None
                if found:
                    self.usage = {**(self.usage or {}), **{k: v for k, v in found.items() if v}}
                return

    @staticmethod
    def error_frame(body: bytes) -> bytes:
        return b"event: error\ndata: " + body + b"\n\n"


class ReplayRelay(EventRelay):
    """A stored response's `event:` frames streamed again (GET /v1/responses/{id}?stream=true): passed on as they
    come, model renamed, nothing counted (the tokens were accounted when the response was made)."""

    replay = True

    def __init__(self, rename: tuple[bytes, bytes] | None = None, ends: tuple[bytes, ...] = ()) -> None:
        super().__init__({}, rename, ends)

    def _process(self, frames: bytes) -> bytes:
        self._note_end(frames)
        return frames.replace(*self.rename) if self.rename is not None else frames
