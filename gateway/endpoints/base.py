"""What one route of the OpenAI surface declares, and the parts routes share.

A `Route` is a declaration, not code: its path pattern and methods, how its body is read (JSON, multipart,
none), where its model is, how its tokens are estimated for the rate limits, where its usage is in the answer,
how its stream is relayed, its affinity (a replica it must go to), and the shape of its errors. The HTTP shell
(gateway/openai_routes.py) looks a request's route up in the registry (gateway/endpoints/__init__.py) and the
proxy (gateway/proxy.py) runs it; neither knows any route by name.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode

import orjson

from backends.replicas import Replica
from gateway.needs import Answering
from gateway.relay import EventRelay, SSERelay
from policies.config import Policy
from policies.deadline import deadline_of
from policies.errors import BadRequest, GatewayError
from policies.json_depth import json_too_deep, nests_past_bound
from policies.json_types import JSON as JSONValue
from policies.json_types import JSONObject, JSONView, is_int
from policies.keys import KeyRecord
from policies.pipeline import NO_PARAMS, Call, Request, Slot
from policies.routing.request import PromptReader
from policies.tokens import FREE, Estimate, count

JSON, MULTIPART, NONE = "json", "multipart", "none"
PARAM = re.compile(r"\{(\w+)(:path)?\}")
SEGMENT = r"[A-Za-z0-9_.\-]{1,200}"  # an id in a path: nothing that could bend the upstream request line
MODEL_PATH = r"[^\x00-\x20\x7f]{1,256}"  # a model name in a path may hold slashes ("org/model")


def body_model(call: Call) -> JSONValue:
    return call.body.get("model")


def openai_usage(data: JSONObject) -> JSONObject | None:
    """`usage` as chat, completions, embeddings and vLLM's pooling routes report it."""
    usage = data.get("usage")
    return usage if isinstance(usage, dict) else None


def io_usage(usage: JSONValue) -> dict[str, int] | None:
    """Responses' and Anthropic's `usage` ({input_tokens, output_tokens}) in the gateway's terms."""
    if not isinstance(usage, dict):
        return None
    return {"prompt_tokens": count(usage.get("input_tokens")), "completion_tokens": count(usage.get("output_tokens"))}


def no_usage(_data: JSONObject) -> None:
    return None


def openai_error_body(error: GatewayError) -> bytes:
    return error.body()


# The body fields that change what the gateway does (stream or not, how many tokens to reserve): checked for type
# before forwarding, so the gateway and the backend never read one body two ways (vLLM coerces "yes" to true).
def _bool(value: JSONValue) -> bool:
    return isinstance(value, bool)


def _count(value: JSONValue) -> bool:
    return is_int(value) and value >= 0


def _positive(value: JSONValue) -> bool:
    return is_int(value) and value >= 1


def _stream_options(value: JSONValue) -> bool:
    return isinstance(value, dict) and all(
        v is None or isinstance(v, bool) for k, v in value.items() if k in ("include_usage", "continuous_usage_stats"))


FIELD_CHECKS: tuple[tuple[str, Callable[[JSONValue], bool], str], ...] = (
    ("stream", _bool, "a boolean"),
    ("stream_options", _stream_options, "an object whose include_usage is a boolean"),
    ("n", _positive, "an integer of at least 1"),
    ("max_tokens", _count, "a non-negative integer"),
    ("max_completion_tokens", _count, "a non-negative integer"),
    ("max_output_tokens", _count, "a non-negative integer"),
)


def check_fields(body: JSONObject) -> None:
    for name, ok, what in FIELD_CHECKS:
        value = body.get(name)
        if value is not None and not ok(value):
            raise BadRequest(f"'{name}' must be {what}", param=name, code="invalid_type")


def parse_json(raw: bytes) -> JSONObject:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg == "depth limit exceeded":  # orjson's own bound (1024 levels), well past ours
            raise BadRequest(json_too_deep("the request body"), code="json_too_deep") from None
        raise BadRequest(f"the request body is not valid JSON: {exc.msg}", code="invalid_json") from None
    if nests_past_bound(raw, body):
        raise BadRequest(json_too_deep("the request body"), code="json_too_deep")
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    check_fields(body)
    return body


MAX_QUERY = 2048  # bytes of a query string the gateway forwards
MAX_QUERY_FIELDS = 32


def query_flag(value: str) -> bool:
    return value in ("true", "false")


def query_count(value: str) -> bool:
    return value.isdigit() and len(value) <= 9


def query_text(value: str) -> bool:
    return 0 < len(value) <= 200


def forward_query(fields: dict[str, Callable[[str], bool]], repeated: tuple[str, ...] = ()) -> Callable[[bytes], str]:
    """A route's `query`: reads the client's raw query string into the one sent upstream (`?...`, re-encoded by
    the gateway, so nothing in it can bend the request line). Only the named `fields` pass, each value checked,
    once each but for the `repeated` ones; anything else (too long, not UTF-8, malformed, unknown) is a 400."""

    def read(raw: bytes) -> str:
        if not raw:
            return ""
        if len(raw) > MAX_QUERY:
            raise BadRequest(f"the query string is longer than the {MAX_QUERY} bytes this gateway accepts",
                             code="invalid_query")
        try:
            pairs = parse_qsl(raw.decode("ascii"), strict_parsing=True, errors="strict",
                              max_num_fields=MAX_QUERY_FIELDS)
        except (UnicodeDecodeError, ValueError):
            raise BadRequest("the query string is malformed", code="invalid_query") from None
        seen: set[str] = set()
        for name, value in pairs:
            ok = fields.get(name)
            if ok is None:
                raise BadRequest(f"unknown query parameter '{name[:64]}'", param=name[:64], code="invalid_query")
            if name in seen and name not in repeated:
                raise BadRequest(f"query parameter '{name}' is given more than once", param=name,
                                 code="invalid_query")
            if not ok(value):
                raise BadRequest(f"query parameter '{name}' has an invalid value", param=name, code="invalid_query")
            seen.add(name)
        return "?" + urlencode(pairs) if pairs else ""

    return read


def chat_relay(call: Call, rename: tuple[bytes, bytes] | None) -> SSERelay:
    return SSERelay(strip_usage=not call.wants_usage, rename=rename)


@dataclass(frozen=True, slots=True)
class Asked:
    """What a route the gateway answers itself is given: its path's parameters, the client's query string, body
    (read whole, within the route's limit; b"" for a route without one, or a MULTIPART one, whose body comes as
    `stream` instead, within the same limit), headers and address."""

    params: dict[str, str]
    query: bytes = b""
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    client_host: str = ""
    stream: AsyncIterator[bytes] | None = None


@dataclass(frozen=True)
class Download:
    """An answer the gateway sends in pieces as they are read (a stored file), never held whole: `size` bytes in
    all, which `pieces` yields (and closes what it reads from when done or dropped)."""

    size: int
    pieces: AsyncGenerator[bytes, None]


@dataclass(frozen=True, eq=False)
class Route:
    name: str  # the endpoint's name in metrics, the access log and usage ("chat/completions", "responses")
    path: str  # the client's path; `{id}` is one segment, `{model:path}` may span several
    methods: tuple[str, ...] = ("POST",)
    upstream: str | None = None  # vLLM's path for it (`{id}` filled in), when it differs from `path`
    body: str = JSON
    tokens: Estimate = FREE  # the token estimate the rate limits reserve
    model: Callable[[Call], JSONValue] = body_model  # the model it names (before aliases are resolved)
    usage: Callable[[JSONObject], Mapping[str, JSONValue] | None] = openai_usage  # from a whole JSON answer
    relay: Callable[[Call, tuple[bytes, bytes] | None], SSERelay | EventRelay] | None = None  # None: never streams
    stream_usage: bool = False  # ask the backend for the usage chunk (stripped again when the client did not)
    pin: Callable[[Call, Iterable[Replica]], Replica | None] | None = None  # affinity: the replica it must go to (or None)
    prepare: Callable[[Call, JSONObject, Replica], None] | None = None  # last touches for the chosen replica
    rentable: bool = False  # OpenAI's API has it too, so it may overflow to a rented provider
    errors: Callable[[GatewayError], bytes] = openai_error_body  # the shape its errors take
    key_header: str | None = None  # a header that may carry the API key instead of Authorization
    # answered by the gateway: (the gateway, as the route's own Protocol in gateway/needs.py names it; the key;
    # what was asked)
    answer: Callable[[Answering, KeyRecord, Asked], Awaitable[bytes | Download]] | None = None
    answer_type: str = "application/json"  # the content type of what `answer` returns
    limited: bool = True  # an answered route counts against its key's requests per minute and concurrency
    max_body: Callable[[Policy], int] | None = None  # its body limit from the policy (default: server.max_body_bytes)
    plain_text: bool = False  # a 200 answer may be text, not JSON (passed on as it is)
    query: Callable[[bytes], str] | None = None  # the client's query string into the one sent upstream; None: dropped
    stream_by_answer: bool = False  # it streams when its answer is an event stream (a form's or a query's `stream`)
    prompt: PromptReader | None = None  # the text its prompt starts with (prefix routing reads it)
    pattern: re.Pattern[str] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if "{" in self.path:
            regex = PARAM.sub(lambda m: f"(?P<{m[1]}>{MODEL_PATH if m[2] else SEGMENT})", self.path)
            object.__setattr__(self, "pattern", re.compile(f"^{regex}$"))

    def call(self, request_id: str, headers: Mapping[str, str], client_host: str, arrived: float,
             params: Mapping[str, str] | None = None, batch: str | None = None) -> Call:
        """A call of this route: its name, how it reads its prompt, and the route itself in the call's ROUTE slot."""
        call = Call(Request(request_id, self.name, headers, client_host, arrived, params or NO_PARAMS,
                            deadline_of(headers, arrived)), batch=batch, prompt_of=self.prompt)
        ROUTE.put(call, self)
        return call

    def relay_of(self, call: Call, rename: tuple[bytes, bytes] | None) -> SSERelay | EventRelay:
        """The relay of the call's streamed answer: only a route that streams has one."""
        if self.relay is None:
            raise TypeError(f"the route {self.name} never streams")
        return self.relay(call, rename)

    def upstream_path(self, params: Mapping[str, str]) -> str:
        if self.pattern is None:  # a path without parameters (most routes): nothing to fill in
            return self.upstream or self.path
        return (self.upstream or self.path).format(**params)

    def streams(self, body: JSONView) -> bool:
        return self.relay is not None and body.get("stream") is True


ROUTE: Slot[Route] = Slot("route")  # the route a call is served by (Route.call fills it)

