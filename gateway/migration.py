"""Streams that survive: a Chat Completions or Completions stream whose replica fails mid-body (a reset, a stall
past the read timeout, an error event) goes on from another replica, and the client sees one stream.

While a stream is relayed, `Migration.feed` reads the events that went to the client: the text generated so far,
how many chunks carried it (vLLM streams one token a chunk), and the first chunk's `id`, `created` and `model`.
When the replica fails, `continuation` is the original request again with that text: a completion's prompt plus
the text; a chat's messages plus a partial assistant message that vLLM continues (`continue_final_message: true,
add_generation_prompt: false`), with `max_tokens`/`max_completion_tokens` (and `min_tokens`) lowered by what
was generated. The continuation's chunks are passed on with the first's id, created and model, its role chunk
dropped (the client had one), and its usage summed with the first attempt's: what both replicas computed.
At most `retries.migrations` times per request (policies/config/reliability.py).

Where the continuation would not be the same stream, the stream is not moved and ends with the error event as
before (`unfaithful` and `Migration.feed` say why; docs/guides/reliability.md tells users):
- several choices (`n` > 1, `best_of` > 1): their texts are interleaved, each would need its own continuation;
- `logprobs`/`top_logprobs`/`echo`/`prompt_logprobs`: the continuation would report them for a different prompt;
- a completion whose prompt is token ids, or several prompts: no text to append to;
- `tools` offered (unless `tool_choice` is "none"), structured output (`response_format` json, guided decoding):
  a half-written call or JSON document cannot be resumed by a grammar that starts again;
- tool-call or reasoning deltas already relayed: only the answer's text is carried over;
- `include_stop_str_in_output`: otherwise vLLM holds back the text that could begin a stop string, so a stop
  string never straddles the cut; with it, one could.

The per-event cost when nothing fails: the relayed bytes are kept aside (a list append) and searched for a
quoted `"error"`; they are parsed only when the stream moves, or once a stream has kept `KEEP_BYTES` of them
(then they are read into the text, so that a long stream holds its text, not its events). Only for the calls of a model whose `migrations`
is above 0 on these two routes (the proxy asks `watch`, which says None for every other call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from backends.http1 import Broken, ReadTimedOut, UpstreamError
from gateway.endpoints import chat, completions
from gateway.endpoints.base import Route

MIGRATIONS_HEADER = "x-gateway-migrations"  # kept on the call for its record (the stream's head went long ago)
CONTINUED, UNFAITHFUL, EXHAUSTED, FAILED = "continued", "unfaithful", "exhausted", "failed"  # the metric's outcomes
SEP = b"\n\n"
DONE = b"data: [DONE]"
ERROR_KEY = b'"error"'
KEEP_BYTES = 64 * 1024  # events a stream keeps unread; past it they are read (a JSON parse each) into the text


class ErrorEvent(Broken):
    """The replica sent an error event mid-stream (vLLM's `{"error": {...}}`): `passed` are the events before it
    (for the client), `rest` the error event and what followed it in the same read (the client's, if the stream
    is not moved)."""

    def __init__(self, passed: bytes, rest: bytes) -> None:
        super().__init__("sent an error event mid-stream")
        self.passed = passed
        self.rest = rest


def movable(error: UpstreamError) -> bool:
    """Whether a stream that failed with `error` may be moved: a reset, an error event or a stall; not a body
    past the gateway's bounds (the request's own size), nor a write timeout."""
    return isinstance(error, (Broken, ReadTimedOut))


@dataclass(frozen=True, slots=True)
class Shape:
    """How one route's stream is read and continued."""

    text_of: Callable[[dict[str, Any]], str | None]  # the generated text in a choice (None: a delta of another kind)
    continued: Callable[[dict[str, Any], str], dict[str, Any] | None]  # the continuation body (None: cannot)
    budget_fields: tuple[str, ...]  # the fields that bound the output, lowered by what was generated


def chat_text(choice: dict[str, Any]) -> str | None:
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return None
    if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
        return None
    content = delta.get("content")
    return content if isinstance(content, str) else ""


def completion_text(choice: dict[str, Any]) -> str | None:
    text = choice.get("text")
    return text if isinstance(text, str) else None


def chat_continued(body: dict[str, Any], text: str) -> dict[str, Any] | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if body.get("continue_final_message") is True and isinstance(last, dict) and last.get("role") == "assistant":
        content = last.get("content")
        if not isinstance(content, str):
            return None
        messages = [*messages[:-1], {**last, "content": content + text}]  # it was continuing one already
    else:
        messages = [*messages, {"role": "assistant", "content": text}]
    return {**body, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}


def completion_continued(body: dict[str, Any], text: str) -> dict[str, Any] | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    return {**body, "prompt": prompt + text}


SHAPES: dict[Route, Shape] = {
    chat.ROUTE: Shape(chat_text, chat_continued, ("max_tokens", "max_completion_tokens", "min_tokens")),
    completions.ROUTE: Shape(completion_text, completion_continued, ("max_tokens", "min_tokens")),
}
NEVER = ("logprobs", "top_logprobs", "echo", "prompt_logprobs", "include_stop_str_in_output", "guided_json",
         "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def unfaithful(body: dict[str, Any]) -> str | None:
    """Why a stream asked for with `body` could not be continued faithfully elsewhere, or None: it can."""
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and value != 1:
            return name
    for name in NEVER:
        value = body.get(name)
        if value is not None and value is not False and value != 0:
            return name
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "response_format"
    return None


class Migration:
    """One stream's record of what went to the client, and how it goes on elsewhere. Made by `watch`."""

    __slots__ = ("shape", "left", "moves", "text", "chunks", "head", "refused", "rewrite", "before", "relayed",
                 "kept")

    def __init__(self, shape: Shape, allowed: int, refused: str | None) -> None:
        self.shape = shape
        self.left = allowed  # moves still allowed
        self.moves = 0
        self.relayed: list[bytes] = []  # the events relayed and not yet read (read only if the stream moves)
        self.kept = 0  # bytes in `relayed`
        self.text: list[str] = []  # the generated text relayed so far (once read)
        self.chunks = 0  # chunks that carried generated text (tokens, on vLLM)
        self.head: dict[str, Any] | None = None  # id, created and model of the stream's first chunk
        self.refused = refused  # why it cannot move (the request, or what was relayed), or None
        self.rewrite = False  # the current attempt is a continuation: its chunks take the first's head
        self.before: dict[str, int] = {}  # the tokens of the attempts before the current one

    def feed(self, events: bytes) -> bytes:
        """Complete events on their way to the client -> what goes to the client: the same bytes, kept aside
        (read only if the stream moves: a list append, and a search for an error event); on a continuation, its
        chunks under the first's head, its role chunk dropped, its usage summed. Raises ErrorEvent at an error
        event."""
        if not self.rewrite:
            if self.refused is not None:
                return events  # it cannot move: nothing to keep (an error event goes on as it came)
            # rare: a quoted "error" is a key or a value, never inside a JSON string (rfind: ~2x faster than `in`)
            if events.rfind(ERROR_KEY) >= 0:
                self._error_in(events)
            self.relayed.append(events)
            self.kept += len(events)
            if self.kept > KEEP_BYTES:  # a long stream: read what it kept, so it holds its text, not its events
                self.read_relayed()
            return events
        out: list[bytes] = []
        for begin, end, data in _events(events):
            if isinstance(data, dict):
                if _is_error(data):
                    raise ErrorEvent(b"".join(out), events[begin:])
                if self._read(data):
                    out.append(b"data: " + orjson.dumps(data) + SEP)
            else:
                out.append(events[begin:end])
        return b"".join(out)

    def _error_in(self, events: bytes) -> None:
        for begin, _end, data in _events(events):
            if isinstance(data, dict) and _is_error(data):
                self.relayed.append(events[:begin])
                raise ErrorEvent(events[:begin], events[begin:])

    def read_relayed(self) -> None:
        """Read the events relayed so far: the text, its chunks, the first chunk's head, and whether anything
        in them (a tool call, several choices) forbids a move."""
        relayed, self.relayed, self.kept = self.relayed, [], 0
        for data in _chunks(relayed):
            if isinstance(data, dict):
                self._read(data)

    def _read(self, data: dict[str, Any]) -> bool:
        """Note one chunk's text and head; on a continuation, put the first's head on it. Whether it goes on."""
        if self.head is None:
            self.head = {k: data[k] for k in ("id", "created", "model") if k in data}
        choices = data.get("choices")
        usage = data.get("usage")
        if self.rewrite:
            data.update(self.head)
            if isinstance(usage, dict):
                data["usage"] = self.summed(usage)
        if not isinstance(choices, list):
            return True
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self.refused = "n"
                continue
            text = self.shape.text_of(choice)
            if text is None:
                if self.refused is None:
                    self.refused = "a tool call or reasoning"
                continue
            if text:
                self.text.append(text)
                self.chunks += 1
            elif self.rewrite and choice.get("finish_reason") is None and not choice.get("logprobs"):
                return False  # the continuation's role chunk (or an empty delta): the client had its own
        return True

    def stop(self) -> None:
        """No more moves: what follows goes on as it comes (a continuation's chunks still under the first's
        head, its usage still summed)."""
        self.left = 0
        self.relayed, self.kept = [], 0
        if not self.rewrite and self.refused is None:
            self.refused = "stopped"

    def may_move(self) -> bool:
        if self.relayed:
            self.read_relayed()
        return self.refused is None and self.left > 0

    def continuation(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The request that goes on from what was relayed (None: there is nothing left to generate)."""
        if self.relayed:
            self.read_relayed()
        shape = self.shape
        continued = shape.continued(body, "".join(self.text))
        if continued is None:
            return None
        done = self.chunks
        for name in shape.budget_fields:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                if name != "min_tokens" and value - done < 1:
                    return None
                continued[name] = max(0, value - done)
        return continued

    def moved(self, usage: dict[str, Any] | None) -> None:
        """The stream goes on from another replica. `usage` is what the failed attempt reported: mostly None (it
        broke before its usage chunk); then its output is the chunks it relayed, and its prompt is found later
        from the last attempt's, which holds the same prompt and all the text relayed before it."""
        if self.relayed:
            self.read_relayed()
        self.left -= 1
        self.moves += 1
        self.rewrite = True
        before = self.before or {"prompt_tokens": 0, "completion_tokens": 0, "chunks": 0, "unknown": 0, "offsets": 0}
        since = before["chunks"]  # chunks relayed before the failed attempt began
        before["completion_tokens"] += _count(usage, "completion_tokens") if usage else self.chunks - since
        if usage and _count(usage, "prompt_tokens"):
            before["prompt_tokens"] += _count(usage, "prompt_tokens")
        else:
            before["unknown"] += 1
            before["offsets"] += since
        before["chunks"] = self.chunks
        self.before = before

    def summed(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The current attempt's usage plus the attempts' before it: the tokens all the replicas computed. An
        earlier attempt's unknown prompt is the first prompt (the current one less the chunks relayed before the
        current attempt) plus the chunks relayed before that attempt began."""
        before = self.before
        if not before:
            return usage
        prompt = _count(usage, "prompt_tokens")
        completion = _count(usage, "completion_tokens")
        first = max(0, prompt - before["chunks"])
        earlier = before["prompt_tokens"] + before["unknown"] * first + before["offsets"]
        total_prompt, total_completion = prompt + earlier, completion + before["completion_tokens"]
        summed = {**usage, "prompt_tokens": total_prompt, "completion_tokens": total_completion,
                  "total_tokens": total_prompt + total_completion}
        summed.pop("prompt_tokens_details", None)  # one attempt's cached tokens say nothing of the sum
        return summed


def watch(route: Route, body: dict[str, Any], allowed: int) -> Migration | None:
    """A stream's Migration, or None where it never moves: the model allows no migrations, the route has no
    continuation (only Chat Completions and Completions do), or the request cannot be continued faithfully
    (then one is still made, refused, so the metric counts it when its replica fails)."""
    if allowed <= 0:
        return None
    shape = SHAPES.get(route)
    if shape is None:
        return None
    return Migration(shape, allowed, unfaithful(body))


def _events(events: bytes) -> Iterator[tuple[int, int, Any]]:
    """(begin, end, JSON of its data or None) of each event in `events`."""
    at = 0
    while at < len(events):  # bounded: each pass moves past one event
        end = events.find(SEP, at)
        end = len(events) if end < 0 else end + len(SEP)
        yield at, end, _data(events[at:end])
        at = end


def _chunks(relayed: list[bytes]) -> list[Any]:
    """The JSON of every `data:` event in `relayed`: parsed at once as one JSON array where they are all one-line
    `data:` events (vLLM's, but for `[DONE]`), else one by one."""
    joined = b"".join(relayed)
    if joined.startswith(b"data: ") and joined.endswith(SEP):
        body = joined[6:-2]
        if body.count(b"\n") == body.count(b"\n\ndata: ") * 2:  # nothing but one-line data events
            try:
                found = orjson.loads(b"[" + body.replace(b"\n\ndata: ", b",") + b"]")
            except orjson.JSONDecodeError:
                pass
            else:
                return found if isinstance(found, list) else []
    return [data for events in relayed for _begin, _end, data in _events(events)]


def _is_error(data: dict[str, Any]) -> bool:
    return data.get("error") is not None or data.get("object") == "error"


def _data(event: bytes) -> Any:
    """The JSON of a `data:` event (None for `[DONE]`, a comment or anything else)."""
    if not event.startswith(b"data:") or event.startswith(DONE):
        return None
    try:
        return orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return None


def _count(usage: dict[str, Any] | None, name: str) -> int:
    value = usage.get(name) if usage else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
