"""What each variant's real answers say: speed, errors and the validity of structured output.

Read from every finished call of a model with variants (policies/variants.py hands them over):

- errors by kind (`upstream_error`, `timeout`, `no_backend`: the variant's fault; `at_capacity`, `rejected`
  (the backend refused the request with a 4xx), `client_closed`: recorded, but not held against it);
- time to first token and inter-token latency (the stream's time after its first token over the tokens after
  the first), each recorded with the load it met: the requests in flight to its replica when it was sent, in
  power-of-two levels, so a 10% canary at load 2 is compared with the baseline at load 2, not at load 16;
- output tokens per second of each stream (completion tokens over the time after the first token);
- structured output: an answer to `response_format` json_object (a JSON object) or json_schema (valid against
  the schema, by jsonschema), and each tool call's arguments (a JSON object valid against the declared tool's
  `parameters`); a call with neither is not a structured sample. Every answer to a request that required
  JSON counts: empty or null content, a refusal, or an answer cut at the length limit is invalid;
- whether the answer stopped at the length limit (finish_reason `length`).

Each goes to Prometheus (llm_gateway_variant_*) and into a bounded window per variant (the last `size`
calls) that the admin view and the guard read. A streamed answer is read as it passes (`StreamAnswer`): no
chunk is kept, and its text only when the request asked for structured output or a shadow compares with it.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import orjson
from jsonschema import validators
from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator

from policies.json_types import JSON, JSONObject, JSONView
from policies.memo import Memo
from policies.pipeline import Call, Slot

FINISH_REASON = re.compile(rb'"finish_reason":"([A-Za-z_]{1,32})"')
FINISH_MARK = b'"finish_reason":"'  # a finish_reason that is not null
FAULTS = frozenset({"upstream_error", "timeout", "no_backend"})  # held against the variant
ERROR_KINDS = {502: "upstream_error", 504: "timeout", 503: "no_backend", 429: "at_capacity", 499: "client_closed"}
LOAD_LEVELS = (1, 2, 4, 8, 16, 32, 64)  # in flight to the server when sent: up to this many
STRUCTURED = ("json_object", "json_schema")


# the level of each in-flight count up to the last level, worked out once: a call's finish looks its level up
_LEVEL_OF = tuple(next(str(level) for level in LOAD_LEVELS if n <= level) for n in range(LOAD_LEVELS[-1] + 1))
_ABOVE = f">{LOAD_LEVELS[-1]}"


def load_level(in_flight: int) -> str:
    """The power-of-two level of an in-flight count: the first of LOAD_LEVELS at or above it (">64" past them)."""
    return _LEVEL_OF[max(0, in_flight)] if in_flight <= LOAD_LEVELS[-1] else _ABOVE


def error_kind(status: int) -> str | None:
    if status < 400:
        return None
    return ERROR_KINDS.get(status) or ("upstream_error" if status >= 500 else "rejected")


@dataclass(slots=True)
class Sample:
    """One finished call of a variant, as the window keeps it."""

    at: float  # monotonic, as it finished
    error: str | None
    load: str
    ttft: float | None = None
    itl: float | None = None
    tokens_per_second: float | None = None
    structured: bool | None = None  # None: not a structured answer
    length: bool = False
    agreed: bool | None = None  # a shadow's answer at temperature 0: the live one's, exactly or as JSON
    exact: bool | None = None  # ... exactly (text and tool calls)
    load_matched: bool = False  # sent while the guard matched its variant's load with the baseline's
    began: float | None = None  # monotonic, as it was sent upstream (None: never sent)


def _validator(schema_json: bytes) -> Validator | None:
    """A jsonschema validator for a schema (checked once); None when the schema itself is not valid."""
    schema = orjson.loads(schema_json)
    cls = validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except SchemaError:
        return None
    return cls(schema)


VALIDATORS = Memo(_validator, limit=256)


ToolCall = dict[str, JSON]  # {"name": ..., "arguments": ...}: one tool call of an answer, as the signals compare it
Answer = tuple[JSON, list[ToolCall]]  # an answer's content and tool calls


def valid_against(value: JSON, schema: JSON) -> bool:
    if not isinstance(schema, dict) or not schema:
        return True
    validator = VALIDATORS(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS))
    return True if validator is None else validator.is_valid(value)  # a broken schema is the client's, not ours


def json_object(text: JSON) -> JSONObject | None:
    if not isinstance(text, str):
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def structured_validity(body: JSONView, content: JSON, tool_calls: list[ToolCall],
                        finish: str | None = None, refused: bool = False) -> bool | None:
    """Whether the structured parts of an answer are valid; None when it has none. Where JSON was required
    (response_format json_object or json_schema) every answer counts: empty or null content, an answer cut at
    the length limit (finish_reason `length`) and a refusal are invalid, as the client cannot parse them. A tool
    call counts the same way: missing arguments, arguments that are not a JSON object or break the tool's
    `parameters`, an undeclared tool, or a call cut at the length limit."""
    verdicts = []
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    cut = finish == "length"
    if kind in STRUCTURED and not tool_calls:
        value = json_object(content) if not (cut or refused) else None
        ok = value is not None
        if ok and kind == "json_schema":
            assert isinstance(fmt, dict)  # kind was read from it
            spec = fmt.get("json_schema")
            ok = valid_against(value, spec.get("schema") if isinstance(spec, dict) else None)
        verdicts.append(ok)
    if tool_calls:
        declared: dict[str, JSON] = {}
        tools = body.get("tools")
        for tool in tools if isinstance(tools, list) else ():
            function = tool.get("function") if isinstance(tool, dict) else None
            tool_name = function.get("name") if isinstance(function, dict) else None
            if isinstance(function, dict) and isinstance(tool_name, str):
                declared[tool_name] = function.get("parameters")
        for call in tool_calls:
            name, value = call.get("name"), json_object(call.get("arguments"))
            verdicts.append(not cut and value is not None and isinstance(name, str) and name in declared
                            and valid_against(value, declared[name]))
    return all(verdicts) if verdicts else None


def first_choice(response: JSONObject | None) -> JSONObject | None:
    """Choice 0 of an answer not streamed, when it has one."""
    choices = response.get("choices") if response is not None else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    return choice if isinstance(choice, dict) else None


def finish_of(choice: JSONObject | None) -> str | None:
    """A choice's finish_reason (all the signals read of an answer not checked whole)."""
    finish = choice.get("finish_reason") if choice is not None else None
    return finish if isinstance(finish, str) else None


def whole_answer(response: JSONObject | None) -> tuple[JSON, list[ToolCall], str | None, bool]:
    """Content, tool calls, finish_reason and whether it is a refusal, of a chat completion not streamed."""
    choice = first_choice(response)
    if choice is None:
        return None, [], None, False
    message = choice.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if content is None:
        content = choice.get("text")  # /v1/completions
    calls: list[ToolCall] = []
    tool_calls = message.get("tool_calls") if isinstance(message, dict) else None
    for call in tool_calls if isinstance(tool_calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            calls.append({"name": function.get("name"), "arguments": function.get("arguments")})
    refused = isinstance(message, dict) and bool(message.get("refusal"))
    return content, calls, finish_of(choice), refused


def sse_events(chunks: Iterable[bytes]) -> Iterator[JSONObject]:
    """The JSON `data:` events of a chat or completions stream's chunks (cut anywhere)."""
    for line in b"".join(chunks).split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            event = orjson.loads(line[6:])
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict):
            yield event


class StreamAnswer:
    """What the signals need of a streamed chat or completions answer, gathered as the relay passes its complete
    events on (gateway/proxy.py), so a stream keeps no chunks: always the last finish_reason, found by a byte
    search; and only when `whole` (the request asked for structured output or tools, or a shadow's answer is
    compared with it) the text of choice 0 and its tool calls, concatenated from the parsed deltas."""

    __slots__ = ("calls", "finish", "refused", "text", "whole")

    def __init__(self, whole: bool) -> None:
        self.whole = whole
        self.finish: str | None = None
        self.refused = False
        self.text: list[str] = []
        self.calls: dict[int, tuple[list[str], list[str]]] = {}  # index -> (its name's parts, its arguments')

    def feed(self, events: bytes) -> None:
        if self.whole:
            for event in sse_events((events,)):
                self.take(event)
            return
        at = events.rfind(FINISH_MARK)  # from the end: the last event with one is the stream's last word
        if at >= 0:
            found = FINISH_REASON.match(events, at)
            if found:
                self.finish = found.group(1).decode()

    def take(self, event: JSONObject) -> None:
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            finish = choice.get("finish_reason")
            if isinstance(finish, str) and finish:
                self.finish = finish
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {}
            if delta.get("refusal"):
                self.refused = True
            content, text = delta.get("content"), choice.get("text")
            if isinstance(content, str):
                self.text.append(content)
            elif isinstance(text, str):
                self.text.append(text)
            parts = delta.get("tool_calls")
            for part in parts if isinstance(parts, list) else ():
                if isinstance(part, dict):
                    self.take_call(part)

    def take_call(self, part: JSONObject) -> None:
        """One streamed piece of a tool call: its name (once) and a piece of its arguments."""
        index = part.get("index", 0)
        if not isinstance(index, int):
            return
        name, arguments = self.calls.setdefault(index, ([], []))
        function = part.get("function")
        if not isinstance(function, dict):
            return
        named, more = function.get("name"), function.get("arguments")
        if isinstance(named, str) and named:
            name[:] = [named]
        if isinstance(more, str):
            arguments.append(more)

    def answer(self) -> Answer:
        """Content and tool calls (only gathered when `whole`)."""
        calls: list[ToolCall] = [{"name": name[0] if name else None, "arguments": "".join(arguments)}
                                 for name, arguments in (self.calls[i] for i in sorted(self.calls))]
        return "".join(self.text), calls


# a streamed call's answer as its signals need it, fed the events as they pass (the variant step makes it)
ANSWER: Slot[StreamAnswer] = Slot("stream answer")


def answer_of(call: Call) -> Answer:
    """The content and tool calls of a finished chat call, streamed (gathered whole) or not."""
    if call.stream:
        answer = ANSWER.get(call)
        return answer.answer() if answer is not None else (None, [])
    content, calls, _, _ = whole_answer(call.response)
    return content, calls


def agreement(live: Answer, shadow: Answer) -> tuple[bool, bool]:
    """(exact, agreed): the same text and tool calls; or, where they differ, the same JSON values."""
    if live == shadow:
        return True, True
    (text_a, calls_a), (text_b, calls_b) = live, shadow
    if len(calls_a) != len(calls_b) or any(a.get("name") != b.get("name") for a, b in zip(calls_a, calls_b)):
        return False, False
    return False, same_json(text_a, text_b) and all(same_json(a.get("arguments"), b.get("arguments"))
                                                    for a, b in zip(calls_a, calls_b))


def same_json(a: JSON, b: JSON) -> bool:
    if a == b:
        return True
    try:
        return isinstance(a, str) and isinstance(b, str) and orjson.loads(a) == orjson.loads(b)
    except orjson.JSONDecodeError:
        return False


def wants_structure(body: JSONView) -> bool:
    """A request whose answer the signals must read whole: structured output or tools."""
    fmt = body.get("response_format")
    return bool(body.get("tools")) or (isinstance(fmt, dict) and fmt.get("type") in STRUCTURED)


def compared(body: JSONView) -> bool:
    """A request whose shadow copy's answer is compared with its own: one at temperature 0 (else they differ)."""
    temperature = body.get("temperature")
    return temperature == 0 and not isinstance(temperature, bool)


def sample_of(call: Call, now: float, load_matched: bool = False) -> Sample:
    """`now`: perf_counter() as the call finished; `load_matched`: its variant was assigned while the guard
    matched the load (policies/variants.py LOAD_MATCHED)."""
    status = call.status
    at = time.monotonic()
    sample = Sample(at, error_kind(status), load_level(call.load), load_matched=load_matched,
                    began=at - (now - call.sent_at) if call.sent_at else None)
    if status >= 400:
        return sample
    usage = call.usage if isinstance(call.usage, dict) else {}
    completion = usage.get("completion_tokens")
    completion = completion if isinstance(completion, int) else 0
    if call.stream:
        if call.first_token_at:
            sample.ttft = call.first_token_at - call.sent_at
            after = now - call.first_token_at
            if completion > 1 and after > 0:
                sample.itl = after / (completion - 1)
                sample.tokens_per_second = (completion - 1) / after
        answer = ANSWER.get(call)
        finish = answer.finish if answer is not None else None
        if answer is not None and answer.whole:
            content, tool_calls = answer.answer()
            sample.structured = structured_validity(call.body, content, tool_calls, finish, answer.refused)
    else:
        answer = ANSWER.get(call)
        if answer.whole if answer is not None else wants_structure(call.body):  # decided as it came in
            content, tool_calls, finish, refused = whole_answer(call.response)
            sample.structured = structured_validity(call.body, content, tool_calls, finish, refused)
        else:
            finish = finish_of(first_choice(call.response))
    sample.length = finish == "length"
    return sample


class Window:
    """The last `size` samples of one variant."""

    def __init__(self, size: int = 2000) -> None:
        self.samples: deque[Sample] = deque(maxlen=size)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)

    def recent(self, seconds: float | None = None) -> list[Sample]:
        if seconds is None:
            return list(self.samples)
        since = time.monotonic() - seconds
        return [s for s in self.samples if s.at >= since]


def summary(samples: list[Sample]) -> JSONObject:
    """What a window says: rates, and latency medians per load level (the admin view, the CLI, the guard)."""
    n = len(samples)
    counts: dict[str, int] = {}
    for s in samples:
        if s.error is not None:
            counts[s.error] = counts.get(s.error, 0) + 1
    errors: JSONObject = dict(counts)
    served = [s for s in samples if s.error is None]
    structured = [s.structured for s in served if s.structured is not None]
    agreed = [s.agreed for s in served if s.agreed is not None]
    exact = [s.exact for s in served if s.exact is not None]
    by_load: JSONObject = {}
    for level in sorted({s.load for s in served}, key=level_key):
        at = [s for s in served if s.load == level]
        by_load[level] = {"requests": len(at), "ttft_p50": median([s.ttft for s in at]),
                          "itl_p50": median([s.itl for s in at])}
    return {
        "requests": n,
        "errors": errors,
        "error_rate": _rate(sum(v for k, v in counts.items() if k in FAULTS), n),
        "ttft_p50": median([s.ttft for s in served]),
        "itl_p50": median([s.itl for s in served]),
        "tokens_per_second_p50": median([s.tokens_per_second for s in served]),
        "structured": len(structured),
        "structured_valid_rate": _rate(sum(structured), len(structured)),
        "length_rate": _rate(sum(1 for s in served if s.length), len(served)),
        "shadow_compared": len(agreed),
        "agreement_rate": _rate(sum(agreed), len(agreed)),
        "exact_match_rate": _rate(sum(exact), len(exact)),
        "by_load": by_load,
    }


def level_key(level: str) -> int:
    return int(level.lstrip(">")) + (1 if level.startswith(">") else 0)


def median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def _rate(part: int, whole: int) -> float | None:
    return part / whole if whole else None

