"""Streams that survive: a Chat Completions or Completions stream whose replica fails mid-body (a reset, a stall
past the read timeout, an error event) goes on from another replica, and the client sees one stream (a Messages
stream is asked again and cut instead: gateway/stream_replay.py).

While a stream is relayed, `Migration.feed` reads the events that went to the client: the text generated so far,
how many chunks carried it (vLLM streams one token a chunk), and the first chunk's `id`, `created` and `model`.
When the replica fails, `continuation` is the original request again with that text: a completion's prompt plus
the text; a chat's messages plus a partial assistant message that vLLM continues (`continue_final_message: true,
add_generation_prompt: false`), with `max_tokens`/`max_completion_tokens` (and `min_tokens`) lowered by what
was generated. The continuation's chunks are passed on with the first's id, created and model, its role chunk
dropped (the client had one), and its usage summed with the first attempt's: what both replicas computed.
At most `retries.migrations` times per request (policies/config/reliability.py).

Token-exact where the replica says its tokens: a stream that may move is asked for them (vLLM's
`return_token_ids`, added by `ask_for_ids` where the client did not ask; the ids are then put back to vLLM's
`null` before the client sees a chunk, so its bytes are what it asked for). The continuation is then the prompt's
token ids plus the generated ones, sent as a completion's token prompt (a chat's continuation goes to
/v1/completions, its chunks told back as chat chunks): nothing is re-tokenized, so at temperature 0 the text is
the one an uninterrupted run gives, to its end. Tokens whose text was held back when the replica failed (the
tail of a character cut between tokens) are left out and made again. The text continuation above stays for
replicas that send no ids, and for requests with `stop` strings (vLLM holds back text that may begin one, so the
text relayed can end inside a token).

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

The per-event cost when nothing fails: the relayed bytes are kept aside (a list append) and a read's last event
(or the one before `[DONE]`) is searched for a quoted `"error"`; they are parsed only when the stream moves, or
once a stream has kept `KEEP_BYTES` of them (then they are read into the text, so that a long stream holds its
text, not its events). Only for the calls of a model whose `migrations` is above 0 on these two routes (the
proxy asks `watch`, which says None for every other call).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import orjson

from backends.http1 import Broken, ReadTimedOut, UpstreamError
from gateway.endpoints import chat, completions
from gateway.endpoints.base import Route
from gateway.relay import Usage
from policies.json_types import JSON, JSONObject, JSONView, is_int
from policies.pipeline import Call, Slot
from policies.tokens import count

MIGRATIONS_HEADER = "x-gateway-migrations"  # kept on the call for its record (the stream's head went long ago)
CONTINUED, UNFAITHFUL, EXHAUSTED, FAILED = "continued", "unfaithful", "exhausted", "failed"  # the metric's outcomes
SEP = b"\n\n"
DONE = b"data: [DONE]"
ERROR_KEY = b'"error"'
KEEP_BYTES = 64 * 1024  # events a stream keeps unread; past it they are read (a JSON parse each) into the text
IDS = "return_token_ids"  # vLLM's: each chunk says its token ids, the first the prompt's
IDS_KEY = b'token_ids":['  # in a chunk that carries ids (and only there: vLLM's null otherwise)
ID_LISTS = re.compile(rb'("(?:prompt_)?token_ids":)\[[0-9, ]*\]')  # put back to null for a client that did not ask
# the gateway asked for the ids (the client did not): the client never sees them
ASKED: Slot[bool] = Slot("ids asked")
# what a completion request takes of a chat's body when a chat goes on as a completion of its prompt's tokens
# (the sampling settings both share; the rest is the chat's own or was refused by `unfaithful`)
SAMPLING = ("model", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "length_penalty", "logit_bias", "ignore_eos", "min_tokens",
            "stop_token_ids", "bad_words", "allowed_token_ids", "skip_special_tokens",
            "spaces_between_special_tokens", "priority", "user", "cache_salt", "vllm_xargs")


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

    text_of: Callable[[JSONObject], str | None]  # the generated text in a choice (None: a delta of another kind)
    continued: Callable[[JSONView, str], JSONObject | None]  # the continuation body (None: cannot)
    budget_fields: tuple[str, ...]  # the fields that bound the output, lowered by what was generated


def chat_text(choice: JSONObject) -> str | None:
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return None
    if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
        return None
    content = delta.get("content")
    return content if isinstance(content, str) else ""


def completion_text(choice: JSONObject) -> str | None:
    text = choice.get("text")
    return text if isinstance(text, str) else None


def chat_continued(body: JSONView, text: str) -> JSONObject | None:
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


def completion_continued(body: JSONView, text: str) -> JSONObject | None:
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


def unfaithful(body: JSONView) -> str | None:
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


def ask_for_ids(call: Call, body: JSONObject, route: Route, allowed: int, rented: bool) -> None:
    """Before a stream is sent: ask the replica for its token ids where the stream may move token-exactly (the
    model allows migrations, the route continues, the request is faithful, no `stop` strings), unless the client
    asked (or refused) itself; never a rented API, which would refuse the field."""
    if ASKED.get(call):
        if rented:
            body.pop(IDS, None)
        else:
            body[IDS] = True
        return
    if rented or allowed <= 0 or route not in SHAPES or IDS in body or body.get("stop") or \
            unfaithful(body) is not None:
        return
    body[IDS] = True
    ASKED.put(call, True)


def _says_ids(events: bytes) -> bool:
    """Whether the stream's first event carries token ids (vLLM's, asked for, always does: the prompt's)."""
    end = events.find(SEP)
    return events.find(IDS_KEY, 0, len(events) if end < 0 else end) >= 0


def null_ids(events: bytes) -> bytes:
    """The events with every token id list put back to vLLM's `null`, as a client that did not ask gets them."""
    return ID_LISTS.sub(rb"\1null", events) if IDS_KEY in events else events


class Migration:
    """One stream's record of what went to the client, and how it goes on elsewhere. Made by `watch`."""

    __slots__ = ("shape", "left", "moves", "text", "chunks", "head", "refused", "rewrite", "before", "relayed",
                 "kept", "hide", "prompt_ids", "ids", "shown", "exact", "attempt_prompt", "attempt_ids", "as_chat",
                 "first")

    def __init__(self, shape: Shape, allowed: int, refused: str | None, hide: bool = False) -> None:
        self.shape = shape
        self.left = allowed  # moves still allowed
        self.moves = 0
        self.relayed: list[bytes] = []  # the events relayed and not yet read (read only if the stream moves)
        self.kept = 0  # bytes in `relayed`
        self.text: list[str] = []  # the generated text relayed so far (once read)
        self.chunks = 0  # chunks that carried generated text (tokens, on vLLM)
        self.head: JSONObject | None = None  # id, created and model of the stream's first chunk
        self.refused = refused  # why it cannot move (the request, or what was relayed), or None
        self.rewrite = False  # the current attempt is a continuation: its chunks take the first's head
        self.before: dict[str, int] = {}  # the tokens of the attempts before the current one
        self.hide = hide  # the gateway asked for the token ids: they go back to null before the client
        self.prompt_ids: list[int] | None = None  # the first attempt's prompt, as the replica tokenized it
        self.ids: list[int] = []  # the generated tokens relayed, in order
        self.shown = 0  # how many of `ids` the client has the text of (the tail's may be held back)
        self.exact = True  # every text chunk so far said its ids
        self.attempt_prompt: int | None = None  # the current attempt's prompt tokens, where it said them
        self.attempt_ids = 0  # tokens the current attempt made
        self.as_chat = False  # the current attempt is a chat's continuation as a completion: told back as chat
        self.first = True  # nothing relayed yet

    def feed(self, events: bytes) -> bytes:
        """Complete events on their way to the client -> what goes to the client: the same bytes, kept aside
        (read only if the stream moves: a list append, and a search for an error event); on a continuation, its
        chunks under the first's head, its role chunk dropped, its usage summed. Raises ErrorEvent at an error
        event."""
        if not self.rewrite:
            if self.first:
                self.first = False
                if self.hide and not _says_ids(events):
                    self.hide = False  # a replica that does not say its tokens: nothing to put back, nothing to scan
            if self.refused is not None:
                return null_ids(events) if self.hide else events  # nothing to keep
            # rare: a quoted "error" is a key or a value, never inside a JSON string
            if events.find(ERROR_KEY, last_events(events)) >= 0:
                self._error_in(events)
            self.relayed.append(events)
            self.kept += len(events)
            if self.kept > KEEP_BYTES:  # a long stream: read what it kept, so it holds its text, not its events
                self.read_relayed()
            return null_ids(events) if self.hide else events
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
                passed = null_ids(events[:begin]) if self.hide else events[:begin]
                raise ErrorEvent(passed, events[begin:])

    def read_relayed(self) -> None:
        """Read the events relayed so far: the text, its chunks, the first chunk's head, and whether anything
        in them (a tool call, several choices) forbids a move."""
        relayed, self.relayed, self.kept = self.relayed, [], 0
        for data in _chunks(relayed):
            if isinstance(data, dict):
                self._read(data)

    def _read(self, data: JSONObject) -> bool:
        """Note one chunk's text and head; on a continuation, put the first's head on it. Whether it goes on."""
        if self.head is None:
            self.head = {k: data[k] for k in ("id", "created", "model") if k in data}
        choices = data.get("choices")
        usage = data.get("usage")
        self._prompt_of(data, choices)
        if self.rewrite:
            data.update(self.head)
            if isinstance(usage, dict):
                data["usage"] = self.summed(usage)
            if self.as_chat:
                _as_chat(data)
                choices = data.get("choices")
        if not isinstance(choices, list):
            return self._passed(data)
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self.refused = "n"
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                read = token_ids(ids)
                if read is None:
                    self.exact = False  # goes on from the text, as for a chunk that said no ids
                else:
                    self.ids += read
                self.attempt_ids += len(ids)
            text = self.shape.text_of(choice)
            if text is None:
                if self.refused is None:
                    self.refused = "a tool call or reasoning"
                continue
            if text:
                self.text.append(text)
                self.chunks += 1
                self.shown = len(self.ids)  # the client has the text of every token so far
                if not isinstance(ids, list):
                    self.exact = False
            elif self.rewrite and choice.get("finish_reason") is None and not choice.get("logprobs"):
                return False  # the continuation's role chunk (or an empty delta): the client had its own
        return self._passed(data)

    def _passed(self, data: JSONObject) -> bool:
        """A continuation's chunk that goes on, its token ids (read above) gone where the client did not ask for
        them: vLLM's nulls, or, on a completion told back as chat, no field."""
        if self.rewrite and self.hide:
            if self.as_chat:
                choices = data.get("choices")
                for choice in choices if isinstance(choices, list) else ():
                    if isinstance(choice, dict):  # as _as_chat made each
                        choice.pop("token_ids", None)
            else:
                _drop_ids(data)
        return True

    def _prompt_of(self, data: JSONObject, choices: JSON) -> None:
        """The prompt's token ids where this chunk says them (a chat's first chunk; a completion's first choice)."""
        prompt = data.get("prompt_token_ids")
        if prompt is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
            prompt = choices[0].get("prompt_token_ids")
        if isinstance(prompt, list):
            self.attempt_prompt = len(prompt)
            if self.prompt_ids is None and not self.rewrite:  # a continuation's prompt is not the client's
                self.prompt_ids = token_ids(prompt)

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

    def token_exact(self) -> bool:
        """Whether the stream goes on from its token ids: every text chunk said its ids, the first its prompt's."""
        if self.relayed:
            self.read_relayed()
        return self.exact and self.prompt_ids is not None

    def continuation(self, body: JSONView) -> JSONObject | None:
        """The request that goes on from what was relayed (None: there is nothing left to generate). Token-exact
        (`token_exact`): a completion whose prompt is the first prompt's token ids and the ids the client has the
        text of, with the budget lowered by those; for a chat, sent to /v1/completions (`as_chat`)."""
        if self.relayed:
            self.read_relayed()
        shape = self.shape
        if self.token_exact():
            assert self.prompt_ids is not None  # token_exact says so
            if shape is SHAPES[chat.ROUTE]:
                continued = {k: body[k] for k in SAMPLING if k in body}
                # a completion's own default is 16 tokens; null is vLLM's "what the context leaves", as a chat's
                continued["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))
            else:
                continued = dict(body)
            prompt: list[JSON] = [*self.prompt_ids, *self.ids[:self.shown]]
            continued["prompt"] = prompt
            continued[IDS] = True
            return _lowered(continued, ("max_tokens", "min_tokens"), self.shown)
        text_continued = shape.continued(body, "".join(self.text))
        if text_continued is None:
            return None
        return _lowered(text_continued, shape.budget_fields, self.chunks, body)

    def sent_as(self, route: Route) -> Route:
        """The route the continuation goes to: a chat that goes on token-exactly is a completion of its tokens."""
        return completions.ROUTE if route is chat.ROUTE and self.token_exact() else route

    def moved(self, usage: Usage | None, as_chat: bool = False) -> None:
        """The stream goes on from another replica (`as_chat`: a chat continued as a completion, whose chunks are
        told back as chat chunks). `usage` is what the failed attempt reported: mostly None (it broke before its
        usage chunk); then its output is the tokens it said (else the chunks it relayed), and its prompt the one
        it said, else is found later from the last attempt's, which holds the same prompt and all the text
        relayed before it."""
        if self.relayed:
            self.read_relayed()
        self.left -= 1
        self.moves += 1
        self.rewrite = True
        self.as_chat = as_chat
        before = self.before or {"prompt_tokens": 0, "completion_tokens": 0, "chunks": 0, "unknown": 0, "offsets": 0}
        since = before["chunks"]  # chunks relayed before the failed attempt began
        said = self.attempt_prompt is not None  # it said its tokens
        before["completion_tokens"] += count_of(usage, "completion_tokens") if usage else \
            self.attempt_ids if said else self.chunks - since
        if usage and count_of(usage, "prompt_tokens"):
            before["prompt_tokens"] += count_of(usage, "prompt_tokens")
        elif self.attempt_prompt is not None:
            before["prompt_tokens"] += self.attempt_prompt
        else:
            before["unknown"] += 1
            before["offsets"] += since
        before["chunks"] = self.chunks
        self.before = before
        self.attempt_prompt, self.attempt_ids = None, 0

    def summed(self, usage: Usage) -> JSONObject:
        """The current attempt's usage plus the attempts' before it: the tokens all the replicas computed. An
        earlier attempt's unknown prompt is the first prompt (the current one less the chunks relayed before the
        current attempt) plus the chunks relayed before that attempt began."""
        before = self.before
        if not before:
            return dict(usage)
        prompt = count_of(usage, "prompt_tokens")
        completion = count_of(usage, "completion_tokens")
        first = max(0, prompt - before["chunks"])
        earlier = before["prompt_tokens"] + before["unknown"] * first + before["offsets"]
        total_prompt, total_completion = prompt + earlier, completion + before["completion_tokens"]
        summed = {**usage, "prompt_tokens": total_prompt, "completion_tokens": total_completion,
                  "total_tokens": total_prompt + total_completion}
        summed.pop("prompt_tokens_details", None)  # one attempt's cached tokens say nothing of the sum
        return summed


def _lowered(continued: JSONObject, fields: tuple[str, ...], done: int,
             source: JSONView | None = None) -> JSONObject | None:
    """`continued` with each budget field of `source` (itself by default) lowered by the `done` tokens; None when
    nothing is left to generate."""
    for name in fields:
        value = (continued if source is None else source).get(name)
        if is_int(value):
            if name != "min_tokens" and value - done < 1:
                return None
            continued[name] = max(0, value - done)
    return continued


def token_ids(ids: list[JSON]) -> list[int] | None:
    """A replica's token ids, or None where one of them is not an integer (no vLLM sends that): a stream is never
    continued from ids it could not read."""
    kept = [i for i in ids if is_int(i)]
    return kept if len(kept) == len(ids) else None


def _as_chat(data: JSONObject) -> None:
    """A completion chunk told back as the chat chunk it continues: each choice's text as a content delta, with
    its token ids (counted by the migration, then taken out where the client did not ask for them)."""
    data["object"] = "chat.completion.chunk"
    choices = data.get("choices")
    if not isinstance(choices, list):
        return
    told: list[JSON] = []
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")
        out: JSONObject = {"index": choice.get("index", 0),
                               "delta": {"content": text if isinstance(text, str) else ""},
                               "logprobs": None, "finish_reason": choice.get("finish_reason")}
        if choice.get("stop_reason") is not None:
            out["stop_reason"] = choice["stop_reason"]
        out["token_ids"] = choice.get("token_ids")
        told.append(out)
    data["choices"] = told


def _drop_ids(data: JSONObject) -> None:
    """A continuation's chunk as a client that did not ask for token ids gets it: vLLM's nulls."""
    if "prompt_token_ids" in data:
        data["prompt_token_ids"] = None
    choices = data.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            for name in ("token_ids", "prompt_token_ids"):
                if choice.get(name) is not None:
                    choice[name] = None


def watch(route: Route, body: JSONView, allowed: int, hide: bool = False) -> Migration | None:
    """A stream's Migration, or None where it never moves: the model allows no migrations, the route has no
    continuation (only Chat Completions and Completions do), or the request cannot be continued faithfully
    (then one is still made, refused, so the metric counts it when its replica fails). `hide`: the gateway
    asked for the token ids (`ask_for_ids`), which the client then never sees."""
    if allowed <= 0:
        return None
    shape = SHAPES.get(route)
    if shape is None:
        return None
    # the ids were asked for only where the request is faithful (ask_for_ids): not judged twice
    return Migration(shape, allowed, None if hide else unfaithful(body), hide)


def last_events(events: bytes) -> int:
    """Where a read's error event would begin: vLLM ends a stream that fails with its error event (and `[DONE]`),
    so only the read's last event is looked into, or its last two where the last is `[DONE]`. A read of many
    events (a fast replica) is not searched whole for a rare key; an error event with events after it is not a
    failure the stream could go on from (it reaches the client as it is)."""
    end = len(events) - len(SEP) if events.endswith(SEP) else len(events)
    at = events.rfind(SEP, 0, end)
    if at >= 0 and events.startswith(DONE, at + len(SEP)):
        at = events.rfind(SEP, 0, at)
    return at + len(SEP) if at >= 0 else 0


def _events(events: bytes) -> Iterator[tuple[int, int, JSON]]:
    """(begin, end, JSON of its data or None) of each event in `events`."""
    at = 0
    while at < len(events):  # bounded: each pass moves past one event
        end = events.find(SEP, at)
        end = len(events) if end < 0 else end + len(SEP)
        yield at, end, _data(events[at:end])
        at = end


def _chunks(relayed: list[bytes]) -> list[JSON]:
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


def _is_error(data: JSONObject) -> bool:
    return data.get("error") is not None or data.get("object") == "error"


def _data(event: bytes) -> JSON:
    """The JSON of a `data:` event (None for `[DONE]`, a comment or anything else)."""
    if not event.startswith(b"data:") or event.startswith(DONE):
        return None
    try:
        value: JSON = orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return None
    return value


def count_of(usage: Usage | None, name: str) -> int:
    """One count of a usage as a backend reported it: a positive integer, else 0 (a hostile or missing count
    is no count)."""
    return count(usage.get(name) if usage else None)
