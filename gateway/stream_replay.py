"""Streams that survive, for Anthropic's Messages API: a /v1/messages stream whose replica fails mid-body (a reset,
a stall past the read timeout, an error frame) is asked again of another replica, and what the client already
has is skipped in the new stream, so the client reads one stream.

vLLM's /v1/messages cannot continue a partial assistant message (it renders every request with a new assistant
turn) and does not say its token ids, so the continuation of gateway/migration.py has nothing to stand on here.
Asked again at temperature 0, the other replica of the same model makes the same tokens; its frames are compared
with what was relayed and passed on from where the client's text ends: its `message_start` and the content
blocks the client has begun are dropped, each text delta is cut by the text the client has of its block, and
the frames after it go on as they come. Where the new text is not the client's (a replica that answers
otherwise), the stream ends with an error frame, as it did before, never with text the client would read twice
or not at all. Only requests that replay to the same text are moved: temperature 0 (or top_k 1), no tools (a
half-written call), no extended thinking. The client waits while the other replica makes the text again; usage
counts both replicas' work (each prompt, each output), in the last `message_delta` as in the record.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson

from gateway.endpoints import messages
from gateway.endpoints.base import Route
from gateway.migration import KEEP_BYTES, SEP, ErrorEvent, count_of, last_events
from gateway.relay import Usage, event_fields
from policies.json_types import JSON, JSONObject, JSONView

ERROR_FRAME = b"event: error"


def unfaithful(body: JSONView) -> str | None:
    """Why a Messages stream asked for with `body` would not replay to the same text elsewhere, or None."""
    choice = body.get("tool_choice")
    if body.get("tools") and not (isinstance(choice, dict) and choice.get("type") == "none"):
        return "tools"
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return "thinking"
    if body.get("temperature") != 0 and body.get("top_k") != 1:
        return "temperature"
    return None


class Asked:
    """What every stream that is asked again keeps (a Messages stream here, a Responses stream in
    gateway/responses_replay.py): the frames relayed, read only if the stream moves, and the moves left; a
    subclass says what the client has (`read_relayed`) and how a replay's frame is cut (`_replayed`)."""

    __slots__ = ("left", "moves", "refused", "rewrite", "relayed", "kept", "deltas", "deltas_before", "ended",
                 "before", "unsaid_prompts")

    def __init__(self, allowed: int, refused: str | None) -> None:
        self.left = allowed  # moves still allowed
        self.moves = 0
        self.refused = refused  # why it cannot move, or None
        self.rewrite = False  # the current attempt is a replay: its frames are cut by what the client has
        self.relayed: list[bytes] = []  # the frames relayed and not yet read
        self.kept = 0  # bytes in `relayed`
        self.deltas = 0  # text deltas the client has (a token each, on vLLM)
        self.deltas_before = 0  # of those, the ones relayed before the current attempt began
        self.ended = False  # a replay's text was not the client's: the stream ended with an error frame
        self.before = {"prompt_tokens": 0, "completion_tokens": 0}  # the earlier attempts' work
        self.unsaid_prompts = 0  # earlier attempts that failed before saying their prompt's tokens

    def feed(self, frames: bytes) -> bytes:
        """Complete frames on their way to the client -> what goes to the client. Raises ErrorEvent at an error
        frame (the frames before it are the client's)."""
        if not self.rewrite:
            if frames.find(ERROR_FRAME, last_events(frames)) >= 0:  # where vLLM puts it: a read's last frame
                for at, _end, kind, _data in frames_in(frames):
                    if kind == b"error":
                        self.relayed.append(frames[:at])
                        raise ErrorEvent(frames[:at], frames[at:])
            if self.refused is None:
                self.relayed.append(frames)
                self.kept += len(frames)
                if self.kept > KEEP_BYTES:  # a long stream: read what it kept, so it holds its text, not its frames
                    self.read_relayed()
            return frames
        if self.ended:
            return b""  # what the replica still sends after the stream ended for the client
        out: list[bytes] = []
        for at, end, kind, data in frames_in(frames):
            if kind == b"error":
                raise ErrorEvent(b"".join(out), frames[at:])
            passed = self._replayed(kind, data, frames[at:end])
            if passed:
                out.append(passed)
            if self.ended:
                break
        return b"".join(out)

    def _replayed(self, kind: bytes | None, data: JSON, frame: bytes) -> bytes | None:
        raise NotImplementedError

    def read_relayed(self) -> None:
        raise NotImplementedError

    def _restart(self) -> None:
        """A replay begins: what it has to make again is what the client has."""
        raise NotImplementedError

    def may_move(self) -> bool:
        if self.relayed:
            self.read_relayed()
        return self.refused is None and self.left > 0

    def moved(self, usage: Usage | None, as_chat: bool = False) -> None:
        """The stream is asked again of another replica; `usage` is the failed attempt's where it said it: its
        prompt (a Messages stream says it in `message_start`; a Responses stream only at its end, so a failed
        one's prompt is counted as the replay's: the same request), its output (else the text deltas the client
        has of it)."""
        if self.relayed:
            self.read_relayed()
        self.left -= 1
        self.moves += 1
        self.rewrite = True
        self._restart()
        usage = usage or {}
        prompt = count_of(usage, "prompt_tokens")
        self.before["prompt_tokens"] += prompt
        self.unsaid_prompts += prompt == 0
        self.before["completion_tokens"] += count_of(usage, "completion_tokens") or self.deltas - self.deltas_before
        self.deltas_before = self.deltas

    def summed(self, usage: Usage) -> JSONObject:
        """The last attempt's usage (the gateway's terms) plus the earlier attempts'."""
        if not self.moves:
            return dict(usage)
        own = count_of(usage, "prompt_tokens")
        prompt = own + self.before["prompt_tokens"] + own * self.unsaid_prompts
        completion = count_of(usage, "completion_tokens") + self.before["completion_tokens"]
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def summed_named(self, usage: Usage) -> JSONObject:
        """A replay's usage as its API names it (`input_tokens`, `output_tokens`, `total_tokens`: Anthropic's and
        the Responses API's), each count it sent summed with the earlier attempts' as `summed` sums the record's,
        so the client reads what the record says."""
        summed = self.summed({"prompt_tokens": count_of(usage, "input_tokens"),
                              "completion_tokens": count_of(usage, "output_tokens")})
        out = dict(usage)
        for name, key in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens"),
                          ("total_tokens", "total_tokens")):
            if isinstance(usage.get(name), int):
                out[name] = summed[key]
        return out

    def continuation(self, body: JSONView) -> JSONObject | None:
        """The request again, as it came (the replay is cut as it streams)."""
        return dict(body)

    def sent_as(self, route: Route) -> Route:
        return route

    def stop(self) -> None:
        """No more moves: what follows goes on as it comes (a replay still cut)."""
        self.left = 0
        self.relayed = []
        if not self.rewrite and self.refused is None:
            self.refused = "stopped"


class Replay(Asked):
    """One Messages stream's record of what went to the client, and how a replay of it is cut. Made by `watch`."""

    __slots__ = ("shown", "skip", "begun", "stopped")

    def __init__(self, allowed: int, refused: str | None) -> None:
        super().__init__(allowed, refused)
        self.shown: dict[int, str] = {}  # the text the client has, by content block
        self.skip: dict[int, str] = {}  # of that, what the current replay has still to make again
        self.begun = 0  # content blocks the client has seen begin
        self.stopped: set[bytes] = set()  # the frames the client has that end something (a block's, the message's)

    def _replayed(self, kind: bytes | None, data: JSON, frame: bytes) -> bytes | None:
        """One frame of a replay: dropped, cut, or passed as it came."""
        if not isinstance(data, dict):
            return frame
        index = data.get("index")
        if kind == b"message_start":
            return None  # the client has the first attempt's
        if kind == b"content_block_start" and isinstance(index, int):
            if index < self.begun:
                return None
            self.begun = index + 1
        if kind in (b"content_block_stop", b"message_delta"):
            key = (kind or b"") + str(index).encode()
            if key in self.stopped:
                return None  # the client had this block's end (or the message's delta) before the replica failed
            self.stopped.add(key)
        if kind == b"message_delta":
            usage = data.get("usage")
            if isinstance(usage, dict):
                data["usage"] = self.summed_named(usage)
                return frame_of(kind, data)
            return frame
        if kind != b"content_block_delta" or not isinstance(index, int):
            return frame
        delta = data.get("delta")
        text = delta.get("text") if isinstance(delta, dict) and delta.get("type") == "text_delta" else None
        if not isinstance(text, str):
            return frame
        owed = self.skip.get(index, "")
        if owed:
            if not (owed.startswith(text) or text.startswith(owed)):
                self.refused, self.ended = "the replay's text is not the client's", True
                return _diverged()
            cut = min(len(owed), len(text))
            self.skip[index], text = owed[cut:], text[cut:]
            if not text:
                return None
            assert isinstance(delta, dict)  # a text delta, found above
            delta["text"] = text
            frame = frame_of(kind, data)
        self.shown[index] = self.shown.get(index, "") + text
        self.deltas += 1
        return frame

    def read_relayed(self) -> None:
        """What the client has: each text block's text, how many blocks began; refused at anything else."""
        relayed, self.relayed, self.kept = b"".join(self.relayed), [], 0
        for _at, _end, kind, data in frames_in(relayed):
            if not isinstance(data, dict):
                continue
            index = data.get("index")
            if kind in (b"content_block_stop", b"message_delta"):
                self.stopped.add((kind or b"") + str(index).encode())
            if kind == b"content_block_start" and isinstance(index, int):
                block = data.get("content_block")
                if not isinstance(block, dict) or block.get("type") != "text":
                    self.refused = "a tool call or thinking"
                self.begun = max(self.begun, index + 1)
            elif kind == b"content_block_delta" and isinstance(index, int):
                delta = data.get("delta")
                text = delta.get("text") if isinstance(delta, dict) and delta.get("type") == "text_delta" else None
                if isinstance(text, str):
                    self.shown[index] = self.shown.get(index, "") + text
                    self.deltas += 1
                else:
                    self.refused = "a tool call or thinking"

    def _restart(self) -> None:
        self.skip = dict(self.shown)

def watch(route: Route, body: JSONView, allowed: int) -> Replay | None:
    """A Messages stream's Replay, or None where it never moves (another route, or no migrations allowed);
    refused (so the metric counts it) where a replay would not give the same text."""
    if allowed <= 0 or route is not messages.MESSAGES:
        return None
    return Replay(allowed, unfaithful(body))


def frames_in(frames: bytes) -> Iterator[tuple[int, int, bytes | None, JSON]]:
    """(begin, end, type, JSON or None) of each frame in `frames` (see _parsed)."""
    at = 0
    while at < len(frames):  # bounded: each pass moves past one frame
        end = frames.find(SEP, at)
        end = len(frames) if end < 0 else end + len(SEP)
        yield (at, end, *_parsed(frames[at:end]))
        at = end


def _parsed(frame: bytes) -> tuple[bytes | None, JSON]:
    """(its type: the `event:` field, else its JSON's `type`; its JSON or None)."""
    kind, raw = event_fields(frame)
    try:
        data = orjson.loads(raw) if raw is not None else None
    except orjson.JSONDecodeError:
        data = None
    if kind is None and isinstance(data, dict) and isinstance(data.get("type"), str):
        kind = data["type"].encode()
    return kind, data


def frame_of(kind: bytes | None, data: JSONObject) -> bytes:
    return (b"event: " + kind + b"\n" if kind else b"") + b"data: " + orjson.dumps(data) + SEP


def _diverged() -> bytes:
    body = {"type": "error", "error": {"type": "api_error", "message": "the backend failed mid-stream and another "
                                       "replica's answer was not the same text: the stream ends here"}}
    return b"event: error\ndata: " + orjson.dumps(body) + SEP
