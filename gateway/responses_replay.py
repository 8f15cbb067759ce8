"""Streams that survive, for the Responses API: a streamed /v1/responses call whose replica fails mid-body (a reset,
a stall past the read timeout, an error frame) is asked again of another replica, and what the client already
has is skipped in the new stream, so the client reads one stream under one response id.

As for Messages (gateway/stream_replay.py), vLLM cannot continue a response from its partial output, so the
request is asked again, and at temperature 0 the other replica of the same model makes the same tokens. Its
frames are compared with what was relayed and passed on from where the client's text ends:
- its `response.created` and `response.in_progress`, and the output items and content parts the client has
  seen added, are dropped; each `response.output_text.delta` is cut by the text the client has of its part;
  a `*.done` frame the client already has is dropped;
- every frame passed on takes the first attempt's ids (the response's, and each output item's, by its
  `output_index`) and goes on with the client's `sequence_number`s, one after the last it read;
- the final `response.completed` (or `.incomplete`) counts both replicas' work in its usage: each prompt (the
  failed attempt's, not said before its end, is the replay's: the same request), each output.
Where the new text is not the client's, the stream ends with an `error` frame, never with text the client would
read twice or not at all. Only requests that replay to the same text are moved: temperature 0 (or top_k 1), no
tools (unless `tool_choice` is "none"), no reasoning, no logprobs; and none that lead back to one replica
(`previous_response_id`, which the other has not seen) or are polled later (`background`).

The replay is stored (where vLLM stores) by the replica that finished it, under the id the gateway gave it
there; the client holds the first attempt's id, which names the replica that failed: a later retrieve of it is
the 404 of a response whose replica is gone.
"""

from __future__ import annotations


import orjson

from gateway.endpoints import responses
from gateway.endpoints.base import Route
from gateway.migration import SEP
from gateway.stream_replay import Asked, frame_of, frames_in
from policies.json_types import JSON, JSONObject, JSONView, is_int

SKIPPED = (b"response.created", b"response.in_progress")  # the client has the first attempt's
DONE = (b"response.output_text.done", b"response.content_part.done", b"response.output_item.done")
FINAL = (b"response.completed", b"response.incomplete", b"response.failed")
TEXT_PARTS = ("output_text",)


def unfaithful(body: JSONView) -> str | None:
    """Why a Responses stream asked for with `body` would not replay to the same text elsewhere, or None."""
    if body.get("previous_response_id") is not None:
        return "previous_response_id"
    if body.get("background") is True:
        return "background"
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    if body.get("reasoning"):
        return "reasoning"
    include = body.get("include")
    if body.get("top_logprobs") or (isinstance(include, list) and any("logprobs" in str(i) for i in include)):
        return "logprobs"
    if body.get("temperature") != 0 and body.get("top_k") != 1:
        return "temperature"
    return None


def _at(data: JSONObject) -> tuple[int, int]:
    """(output_index, content_index) of a frame (-1 where it has none)."""
    output, content = data.get("output_index"), data.get("content_index")
    return (output if isinstance(output, int) else -1, content if isinstance(content, int) else -1)


class ResponsesReplay(Asked):
    """One Responses stream's record of what went to the client, and how a replay of it is cut. Made by
    `watch`; the proxy drives it as it drives stream_replay.Replay."""

    __slots__ = ("shown", "skip", "items", "parts", "done", "response_id", "sequence", "ids")

    def __init__(self, allowed: int, refused: str | None) -> None:
        super().__init__(allowed, refused)
        self.shown: dict[tuple[int, int], str] = {}  # the text the client has, by (output_index, content_index)
        self.skip: dict[tuple[int, int], str] = {}  # of that, what the current replay has still to make again
        self.items: dict[int, str] = {}  # the id of each output item the client has seen added
        self.parts: set[tuple[int, int]] = set()  # the content parts the client has seen added
        self.done: set[tuple[bytes, int, int]] = set()  # the `*.done` frames the client has
        self.response_id: str | None = None  # the response's id, as the client has it
        self.sequence = -1  # the last sequence_number the client read
        self.ids: dict[str, str] = {}  # the current replay's item ids -> the client's

    def _replayed(self, kind: bytes | None, data: JSON, frame: bytes) -> bytes | None:
        """One frame of a replay: dropped, cut, or passed on under the client's ids and sequence."""
        if not isinstance(data, dict) or kind is None:
            return frame
        if kind in SKIPPED:
            return None
        at = _at(data)
        item = data.get("item")
        if kind == b"response.output_item.added":
            known = self.items.get(at[0])
            item_id = item.get("id") if isinstance(item, dict) else None
            if known is not None:
                if isinstance(item_id, str):
                    self.ids[item_id] = known
                return None
            if isinstance(item_id, str):
                self.items[at[0]] = item_id
        elif kind == b"response.content_part.added":
            if at in self.parts:
                return None
            self.parts.add(at)
        elif kind in DONE:
            if (kind, *at) in self.done:
                return None
            self.done.add((kind, *at))
        elif kind == b"response.output_text.delta":
            text = data.get("delta")
            if isinstance(text, str):
                owed = self.skip.get(at, "")
                if owed:
                    if not (owed.startswith(text) or text.startswith(owed)):
                        self.refused, self.ended = "the replay's text is not the client's", True
                        return self._diverged()
                    cut = min(len(owed), len(text))
                    self.skip[at], text = owed[cut:], text[cut:]
                    if not text:
                        return None
                    data["delta"] = text
                self.shown[at] = self.shown.get(at, "") + text
                self.deltas += 1
        elif kind in FINAL:
            self._final(data.get("response"))
        self._renamed(data)
        self.sequence += 1
        data["sequence_number"] = self.sequence
        return frame_of(kind, data)

    def _renamed(self, data: JSONObject) -> None:
        """The first attempt's item ids in a frame of the replay (its own item ids where the client has none)."""
        item_id = data.get("item_id")
        if isinstance(item_id, str) and item_id in self.ids:
            data["item_id"] = self.ids[item_id]
        item = data.get("item")
        if isinstance(item, dict):
            self._renamed_item(item)

    def _renamed_item(self, item: JSONObject) -> None:
        item_id = item.get("id")
        if isinstance(item_id, str) and item_id in self.ids:
            item["id"] = self.ids[item_id]

    def _final(self, response: JSON) -> None:
        """The final response object of a replay: the client's response id and item ids, both attempts' usage."""
        if not isinstance(response, dict):
            return
        if self.response_id is not None:
            response["id"] = self.response_id
        output = response.get("output")
        for item in output if isinstance(output, list) else []:
            if isinstance(item, dict):
                self._renamed_item(item)
        usage = response.get("usage")
        if isinstance(usage, dict):
            response["usage"] = self.summed_named(usage)

    def _diverged(self) -> bytes:
        self.sequence += 1
        body = {"type": "error", "code": "stream_diverged", "param": None, "sequence_number": self.sequence,
                "message": "the backend failed mid-stream and another replica's answer was not the same text: "
                           "the stream ends here"}
        return b"event: error\ndata: " + orjson.dumps(body) + SEP

    def read_relayed(self) -> None:
        """What the client has: its response id, each output item and content part begun, each text part's text,
        the last sequence number; refused at anything but text (a tool call, reasoning)."""
        relayed, self.relayed, self.kept = b"".join(self.relayed), [], 0
        for _begin, _end, kind, data in frames_in(relayed):
            if not isinstance(data, dict) or kind is None:
                continue
            sequence = data.get("sequence_number")
            if is_int(sequence):
                self.sequence = max(self.sequence, sequence)
            at = _at(data)
            if kind == b"response.created":
                response = data.get("response")
                response_id = response.get("id") if isinstance(response, dict) else None
                if isinstance(response_id, str):
                    self.response_id = response_id
            elif kind == b"response.output_item.added":
                item = data.get("item")
                item_id = item.get("id") if isinstance(item, dict) and item.get("type") == "message" else None
                if not isinstance(item_id, str):
                    self.refused = "a tool call or reasoning"
                else:
                    self.items[at[0]] = item_id
            elif kind == b"response.content_part.added":
                part = data.get("part")
                if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                    self.refused = "a part that is not text"
                self.parts.add(at)
            elif kind == b"response.output_text.delta" and isinstance(delta := data.get("delta"), str):
                self.shown[at] = self.shown.get(at, "") + delta
                self.deltas += 1
            elif kind in DONE:
                self.done.add((kind, *at))
            elif kind.endswith(b".delta"):
                self.refused = "a tool call or reasoning"

    def _restart(self) -> None:
        self.skip = dict(self.shown)
        self.ids = {}



def watch(route: Route, body: JSONView, allowed: int) -> ResponsesReplay | None:
    """A Responses stream's replay record, or None where it never moves (another route, or no migrations
    allowed); refused (so the metric counts it) where a replay would not give the same text."""
    if allowed <= 0 or route is not responses.CREATE:
        return None
    return ResponsesReplay(allowed, unfaithful(body))
