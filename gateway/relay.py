"""Relaying a backend's SSE stream to the client as it arrives, touching only what the gateway must.

Bytes are passed on at event boundaries without re-encoding. Only events that carry usage are parsed, for token
accounting, and the usage event proper is dropped again when the client did not ask for usage. When the
backend's served model name differs from the public one, `"model":"<served>"` is rewritten in place.
`SSERelay` carries chat and completions streams (`data:` lines, a usage chunk, `[DONE]`); `EventRelay` the
`event:` + `data:` frames of the Responses and Anthropic Messages APIs; `ReplayRelay` a stored response's events
streamed again (a Responses retrieve), whose tokens were counted when it was made. One event is bounded
(`max_event`, the policy's upstream.max_event_bytes): an upstream that sends more without an event boundary ends
the stream with TooLarge, holding no more than that.

An event that carries usage is read as the SSE grammar reads it (WHATWG's event-stream), as the client's SDK
will: CRLF, CR and LF all end a line (CR and CRLF are passed on as LF, so every stream is cut and metered
alike), `id:`, `event:`, `retry:` and `:` comment lines may come before or between `data:` lines, and several
`data:` lines are one payload joined with "\\n". Usage is merged across the events of a stream in their order:
a usage that counts both the prompt's tokens and the output's is the provider's total so far and stands for
everything before it (a running total on every chunk, a final usage sent twice: the total, once); one that
counts only some is merged into what came before, each count at the largest value reported (a provider that
sends the prompt's tokens and the output's in separate events is charged for both). So within one read only
the usage events from the last total on are looked into, found from the read's end: a stream that arrives whole
in one read (a fast replica) is not searched through for the usage events its total already stands for. The
cost stays where it was for the plain stream (one `data:` line an event, most with no usage in them): a chunk
is looked into only when it holds a `"usage"` key whose value is not `null`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

import orjson

from backends.http1 import Limits, TooLarge
from policies.json_types import JSON, JSONObject

Usage = Mapping[str, JSON]  # a usage object as a backend reported it (read, never written)

SEP = b"\n\n"
USAGE_KEY = b'"usage"'  # a key (or the whole string "usage": parsed, no harm); never inside a longer JSON string
USAGE_TAIL = b'usage"'  # what USAGE_KEY is searched by: JSON is full of `"`, a poor last byte for a search (2x slower)
USAGE_NULL = re.compile(rb'"usage"[ \t]*:[ \t]*null')  # OpenAI's `"usage": null` on every chunk, any spacing
BOM = b"\xef\xbb\xbf"  # a stream may start with one; the grammar drops it
COUNTED = ("prompt_tokens", "completion_tokens", "total_tokens")


class Frames:
    """Cuts upstream bytes at event boundaries (a blank line): complete events go on, the rest waits (at most
    `max_event` bytes of it)."""

    pending = b""
    max_event = Limits().event_bytes
    replay = False  # True: the stream repeats stored events: no tokens, no first-token time, no verdict on the backend
    ended = False  # True: a frame that ends the stream has passed; whatever the upstream does next is not waited for
    cr_ended = False  # True: `pending` is only a CR that ended an event (passed on as LF); a LF next is its pair

    def feed(self, chunk: bytes) -> bytes:
        """Take raw upstream bytes; return the complete events ready for the client (possibly b"")."""
        data = self.pending + chunk if self.pending else chunk
        if 13 in data:  # a CR: CRLF or CR line ends (SSE allows both); never on vLLM's streams
            return self._feed_cr(data)
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

    def _feed_cr(self, data: bytes) -> bytes:
        """`feed` for bytes with a CR in them: every line end becomes a LF, so the stream is cut and metered like
        any other. A CR that ends the bytes may be the first half of a CRLF: it counts as a line end now (an event
        it ends goes on at once), and waits in `pending` as a CR so that a LF right after it is not a second one."""
        if self.cr_ended:  # `pending` was that lone CR, already passed on
            self.cr_ended = False
            data = data[2:] if data[1:2] == b"\n" else data[1:]
        data = data.replace(b"\r\n", b"\n")
        held = data[-1:] == b"\r"
        if 13 in data:
            data = data.replace(b"\r", b"\n")
        cut = data.rfind(SEP)
        if cut < 0:
            self.pending = data[:-1] + b"\r" if held else data
            self._bound()
            return b""
        end = cut + len(SEP)
        ready, rest = data[:end], data[end:]
        if held:
            if rest:
                rest = rest[:-1] + b"\r"
            else:
                rest, self.cr_ended = b"\r", True
        self.pending = rest
        if len(rest) > self.max_event:
            self._bound()
        return self._process(ready)

    def _bound(self) -> None:
        if len(self.pending) > self.max_event:
            self.pending = b""
            raise TooLarge(f"sent an event over the upstream.max_event_bytes of {self.max_event} bytes")

    def flush(self) -> bytes:
        """Whatever is left when the upstream ends (a well-formed stream leaves nothing)."""
        rest, self.pending = self.pending, b""
        if self.cr_ended:
            self.cr_ended, rest = False, b""
        elif 13 in rest:
            rest = rest.replace(b"\r", b"\n")
        return self._process(rest) if rest else b""

    def _process(self, events: bytes) -> bytes:
        raise NotImplementedError


def usage_in(events: bytes, mark: int) -> bool:
    """Whether `events` hold a `"usage"` key whose value is anything but null (then they are parsed); `mark` is
    where the last `"usage"` is (events.rfind(USAGE_KEY): from the end, where a stream's usage is, and faster
    than `in` on JSON, full of quotes)."""
    while mark >= 0:
        if events.startswith(b":{", mark + 7):  # compact JSON, vLLM's: an object, no more to check
            return True
        if not events.startswith(b":null", mark + 7) and USAGE_NULL.match(events, mark) is None:
            return True
        mark = rfind_usage(events, mark)
    return False


def rfind_usage(events: bytes, end: int | None = None) -> int:
    """events.rfind(USAGE_KEY, 0, end), faster."""
    mark = events.rfind(USAGE_TAIL, 0, len(events) if end is None else end)
    while mark > 0 and events[mark - 1] != 34:  # 34: `"`
        mark = events.rfind(USAGE_TAIL, 0, mark)
    return mark - 1 if mark > 0 else -1


def usage_events(events: bytes) -> Iterator[tuple[int, int]]:
    """(begin, end) of each event in `events` (complete ones, each with its blank line; a tail at flush may have
    none) that holds a `"usage"` key whose value is not `null`, from the last to the first. Found from the usage
    keys (rfind), not by splitting every event: a chunk of hundreds of events with one usage among them costs a
    few searches, not a pass over each; a caller that stops early searches no further."""
    mark = rfind_usage(events)
    while mark >= 0:  # bounded: each pass moves back past one event
        begin = events.rfind(SEP, 0, mark)
        begin = 0 if begin < 0 else begin + len(SEP)
        if not events.startswith(b":null", mark + 7):  # OpenAI's "usage":null on every chunk: nothing to read
            end = events.find(SEP, mark)
            yield begin, len(events) if end < 0 else end + len(SEP)
        mark = rfind_usage(events, begin)


def event_fields(event: bytes) -> tuple[bytes | None, bytes | None]:
    """(the `event:` type or None, the data or None) of one event (LF line ends; its blank line may follow), as
    the SSE grammar reads it: `data:` lines joined with "\\n", one space after a field's colon dropped, comment
    lines (`:`) and other fields (`id:`, `retry:`, unknown ones) skipped."""
    kind, data = None, []
    for line in event.removeprefix(BOM).split(b"\n"):
        if not line or line[0] == 58:  # a blank line, or ":" a comment
            continue
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            kind = value
    return kind, b"\n".join(data) if data else None


def event_json(event: bytes) -> JSON:
    """The JSON of one event's data (its blank line may follow), or None where there is none or it is not JSON."""
    line_end = event.find(b"\n")
    if event.startswith(b"data:") and (line_end < 0 or line_end == len(event) - 2 and event[-1] == 10):
        data: bytes | None = event[5:]  # one data line, as most are; JSON allows the space and newlines around it
    else:
        data = event_fields(event)[1]
    return json_of(data) if data is not None else None


def json_of(data: bytes) -> JSON:
    """`data` as JSON, or None where it is not JSON."""
    try:
        value: JSON = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value


def counts(usage: Usage) -> bool:
    """Whether `usage` counts any token (`{}` and zeros count none)."""
    for name in COUNTED:
        value = usage.get(name)
        if value.__class__ is int and value > 0:
            return True
    return False


def total(usage: Usage) -> bool:
    """Whether `usage` counts both the prompt's tokens and the output's: the provider's total so far."""
    prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return prompt.__class__ is int and prompt > 0 and output.__class__ is int and output > 0


def merged_usage(seen: Usage | None, usage: Usage) -> Usage | None:
    """The stream's usage so far with one more event's: a total (`total`) stands for everything before it (a
    running total, or the same usage repeated, counts once); else each count at the largest value reported
    (counts sent in separate events are all kept), the other fields as last sent. A usage that counts nothing is
    no usage: such a stream is still estimated."""
    if usage == seen:
        return seen
    if seen is None or total(usage):
        return usage if counts(usage) else None
    merged = {**seen, **usage}
    for name in COUNTED:
        before = seen.get(name)
        if before.__class__ is int:
            now = usage.get(name)
            if now.__class__ is not int or now < before:
                merged[name] = before
    return merged


class SSERelay(Frames):
    def __init__(self, strip_usage: bool, rename: tuple[bytes, bytes] | None = None) -> None:
        self.strip_usage = strip_usage
        self.rename = rename
        self.usage: Usage | None = None
        self.pending = b""
        self.events = 0  # events passed on before any usage: a stand-in for tokens when a stream ends without it

    @staticmethod
    def error_frame(body: bytes) -> bytes:
        return b"data: " + body + b"\n\n"

    def _process(self, events: bytes) -> bytes:
        mark = events.rfind(USAGE_KEY)  # (inline: a call per chunk costs more than the faster search saves)
        while mark >= 0 and events.startswith(b":null", mark + 7):  # "usage":null, as OpenAI sends on chunks
            mark = events.rfind(USAGE_KEY, 0, mark)
        if mark >= 0 and (events.startswith(b":{", mark + 7) or usage_in(events, mark)):
            events = self._take_usage(events)
        if self.usage is None:  # only needed while no usage came: then it stands in for the token count
            self.events += events.count(b"\n") >> 1  # "data: {...}\n\n": two newlines an event, JSON has none
        if self.rename is not None:
            events = events.replace(*self.rename)
        return events

    def _take_usage(self, events: bytes) -> bytes:
        """Merge the usage of the events in `events` from the last total on (with continuous usage stats every
        chunk has a running total: only the last is read). A usage event proper (`choices: []`) among them is
        cut out when the client did not ask for usage; no other event is touched. (A provider that sent its
        final usage event twice in one read would pass the first copy on: the total stands for it, so it is not
        looked into.)"""
        if events.find(b"\n") == len(events) - 2 and events[-1] == 10 and events.startswith(b"data:"):
            try:  # one event of one data line, as most chunks are
                data = orjson.loads(events[5:])  # JSON allows the space and the newlines around it
            except orjson.JSONDecodeError:
                return events
            return b"" if self._merge(data) else events
        found: list[tuple[int, int, JSON]] = []
        for begin, end in usage_events(events):  # from the read's last total on (merged_usage: it stands for all)
            data = event_json(events[begin:end])
            usage = data.get("usage") if isinstance(data, dict) else None
            if isinstance(usage, dict):
                found.append((begin, end, data))
                if total(usage):
                    break
        cut = [(begin, end) for begin, end, data in reversed(found) if self._merge(data)]
        if not cut:
            return events
        kept, at = [], 0
        for begin, end in cut:
            kept.append(events[at:begin])
            at = end
        kept.append(events[at:])
        return b"".join(kept)

    def _merge(self, data: JSON) -> bool:
        """Merge the usage of an event's JSON, if it has one; whether the event is to be cut out."""
        if not isinstance(data, dict):
            return False
        usage = data.get("usage")
        if not isinstance(usage, dict):
            return False
        self.usage = merged_usage(self.usage, usage)  # (a usage repeated is the same usage: merged_usage says so)
        return self.strip_usage and data.get("choices") == []


def model_rename(served: str, public: str) -> tuple[bytes, bytes] | None:
    if served == public:
        return None
    return b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(public)


EVENT = b"event:"


class EventRelay(Frames):
    """Streams of `event: <type>` + `data: <json>` frames (the Responses API, Anthropic's Messages API), passed on
    at frame boundaries as they come. Only the frames whose type is in `usage_events` are parsed: each maps the
    frame's JSON to usage in the gateway's terms (prompt_tokens, completion_tokens), merged as they arrive
    (Anthropic reports the prompt at the start and the output at the end). A frame's type is its `event:` field
    or, as the SDKs read it, its JSON's `type`. There is no `[DONE]`; `ends` names the frames after which the
    stream is over even if the upstream keeps it open (vLLM does, on a background response that failed)."""

    def __init__(self, usage_events: dict[bytes, Callable[[JSONObject], Usage | None]],
                 rename: tuple[bytes, bytes] | None = None, ends: tuple[bytes, ...] = ()) -> None:
        self.usage_events = usage_events
        self.rename = rename
        self.ends = ends
        self.usage: Usage | None = None
        self.pending = b""
        self.events = 0

    def _process(self, frames: bytes) -> bytes:
        mark = frames.rfind(USAGE_KEY)
        if mark >= 0 and usage_in(frames, mark):
            self._take_usage(frames)
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

    def _take_usage(self, frames: bytes) -> None:
        found: list[Usage] = []
        for begin, end in usage_events(frames):  # from the read's last total on (merged_usage: it stands for all)
            kind, raw = event_fields(frames[begin:end])
            data = json_of(raw) if raw is not None else None
            if not isinstance(data, dict):
                continue
            extract = self.usage_events.get(kind) if kind is not None else None
            named = data.get("type")
            if extract is None and isinstance(named, str):
                extract = self.usage_events.get(named.encode())
            usage = extract(data) if extract is not None else None
            if usage:
                found.append(usage)
                if total(usage):
                    break
        for usage in reversed(found):
            self.usage = merged_usage(self.usage, usage)

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
