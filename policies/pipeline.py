"""One request moving through the gateway, and the ordered steps it passes before reaching a backend.

Like a filter chain: each step may stop the request by raising a GatewayError. Steps that entered get their
`leave` called exactly once when the response is finished, however it ended (done, error, client gone), so a
step that takes something (a concurrency slot, a token reservation) always gives it back. What a finished call
did is not a step's business but its observers' (policies/finished.py: metrics, usage, the ledger...).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from backends.replicas import Replica
from policies.json_types import JSON, JSONObject, JSONView
from policies.routing.request import Prompt, PromptReader, RoutingRequest
from policies.tokens import FREE, Estimate

if TYPE_CHECKING:  # the steps' own types
    from backends.lora import AdapterTarget
    from policies.config.admission import PriorityClass
    from policies.keys import KeyRecord
    from policies.teams import TeamRecord

log = logging.getLogger("gateway.pipeline")


NO_PARAMS: Mapping[str, str] = MappingProxyType({})  # a request whose path has none (shared: read only)


@dataclass(frozen=True, slots=True)
class Request:
    """What the client asked, as the edge read it: fixed for the call's life (steps read it, none writes it)."""

    id: str  # the request id (x-request-id)
    route: str  # the route's name: "chat/completions", "responses", "tokenize"... (gateway/endpoints/)
    headers: Mapping[str, str]  # the client's request headers, names in lower case
    peer: str  # the address its connection came from (the network step finds the client behind a proxy)
    arrived: float  # perf_counter() when the request arrived
    params: Mapping[str, str] = field(default_factory=lambda: NO_PARAMS)  # the parameters in its path ({id})
    deadline: float = math.inf  # perf_counter() past which its client no longer waits (policies/deadline.py)


@dataclass(slots=True, eq=False)
class Call:
    request: Request
    client_host: str = ""  # the client's address: its peer's, or who a trusted proxy says it forwards
    sent_at: float = 0.0  # perf_counter() when it was sent upstream
    prompt_of: PromptReader | None = None  # how its route reads the prompt of its body (prefix routing reads it)
    query: str = ""  # the query string sent upstream ("?stream=true"), on a route that forwards the client's
    # the client's JSON body (or the text fields read of a form), as the proxy read it, read only: what goes
    # upstream is a copy made for each attempt (the served model name, vLLM's priority: gateway/proxy.py), and a
    # moved stream's continuation is a body of its own
    body: JSONView = field(default_factory=dict)
    tokens: Estimate = FREE  # how the route prices this body in tokens, for the rate limits
    asked_model: JSON = None  # the model the request names (its body's `model`, or what its route found)
    pinned: Replica | None = None  # the one replica that can serve it (a stored Responses id lives there)
    response_headers: dict[str, str] = field(default_factory=dict)  # added to the reply, errors included
    streamed_events: int = 0
    fallback_model: str = ""  # the model a fallback chain serves it with instead (gateway/fallbacks.py)
    variant: str | None = None  # the model's variant that serves it, when the model has variants
    adapter: AdapterTarget | None = None  # the LoRA adapter that serves it, when its model is one
    group: str = ""  # the replica set it is admitted to, when not the model's own: `model#variant`
    load: int = 0  # requests in flight to its server when it was sent (itself and other groups' at the URL included)
    stream: bool = False
    wants_usage: bool = False  # the client asked for the usage chunk in its stream
    replica: Replica | None = None
    holds_replica: bool = False  # counted in replica.in_flight right now
    status: int = 0
    usage: Mapping[str, JSON] | None = None  # as the backend reported it (or estimated), read only
    overhead: float = 0.0  # seconds the gateway itself spent on this call
    queue_wait: float = 0.0  # seconds it waited for a slot on an owned backend
    rent_allowed: bool = True  # False: this call stays on owned backends (e.g. its key's rented budget is spent)
    error: BaseException | None = None  # why the call ended badly, if it did (a started stream: set as it ends)
    finished: bool = False
    entered: list[Step] = field(default_factory=list)
    # for the observers of the finished call (policies/finished.py): set by the proxy, read once it is finished
    first_token_at: float = 0.0  # perf_counter() of the first streamed chunk
    response: JSONObject | None = None  # the parsed JSON answer of a call that was not streamed
    tap: list[bytes] | deque[bytes] | None = None  # when a trace wants them, the streamed chunks are appended here
    batch: str | None = None  # the batch it is a line of (its key is set before it enters: policies/batches/)
    # what a layer above keeps on the call (its route, its upload, its trace: the HTTP shell's), by Slot
    state: dict[object, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.client_host:
            self.client_host = self.request.peer

    # What the steps settle once, read as fields, written through their Once slots (below): a second write
    # raises, and the type checker refuses `call.key = ...` anywhere.
    @property
    def key(self) -> KeyRecord | None:
        """The caller's key, once authenticated."""
        return self.state.get(KEY)  # type: ignore[return-value]  # only KEY.put writes it

    @property
    def team(self) -> TeamRecord | None:
        """Its key's team, when it has one (policies/teams.py)."""
        return self.state.get(TEAM)  # type: ignore[return-value]  # only TEAM.put writes it

    @property
    def priority(self) -> PriorityClass | None:
        """Its class (policies/priority.py); None: the default class."""
        return self.state.get(CLASS)  # type: ignore[return-value]  # only CLASS.put writes it

    @property
    def model(self) -> str:
        """The public model it is served as: the one it asked for after alias resolution ("" before
        policies/models.py found it), or the one a fallback chain moved it to."""
        return self.fallback_model or self.state.get(MODEL, "")  # type: ignore[return-value]  # MODEL.put only

    def routing(self) -> RoutingRequest:
        """The request as routing sees it, for one pick (nothing is copied: the call's own headers and body are
        read)."""
        request = self.request
        return RoutingRequest(self.model, request.route, request.headers, self.adapter,
                              Prompt(self.body, self.prompt_of))

    def routed(self, uncached: float | None) -> None:
        """Routing's word on its last pick: the prompt tokens the chosen replica likely has to prefill (None: no
        prefix scorer looked). A retry's pick replaces it."""
        if uncached is None:
            self.state.pop(UNCACHED, None)
        else:
            self.state[UNCACHED] = uncached


T = TypeVar("T")


class StateKey:
    """The name of one piece of state a call carries in `Call.state` (a Slot, typed by what it holds)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<slot {self.name}>"


class Slot(StateKey, Generic[T]):
    """One module's own state on a call (as llm-d's CycleState): the module that makes the slot writes it, and a
    reader gets it typed through the slot. A pipeline step names the slots it writes in its `writes` (the
    pipeline refuses two steps writing one slot); a layer above the policies (the HTTP shell's route, upload and
    trace) keeps its state the same way, so the call names no type of that layer and holds nothing untyped."""

    __slots__ = ()

    def get(self, call: Call) -> T | None:
        return call.state.get(self)  # type: ignore[return-value]  # only `put` writes it, with a T

    def of(self, call: Call) -> T:
        """The value, which this call must have (a slot its maker always fills)."""
        value = call.state.get(self)
        if value is None:
            raise LookupError(f"the call has no {self.name}")
        return value  # type: ignore[return-value]  # only `put` writes it, with a T

    def put(self, call: Call, value: T) -> None:
        call.state[self] = value

    def take(self, call: Call) -> T | None:
        """The value, removed from the call (what is settled once is not settled again)."""
        return call.state.pop(self, None)  # type: ignore[return-value]  # only `put` writes it, with a T


class Once(Slot[T]):
    """A slot written once in a call's life: what a step settles about the request (who calls, as which team and
    class, for which model). A second write is a bug and raises."""

    __slots__ = ()

    def put(self, call: Call, value: T) -> None:
        if call.state.setdefault(self, value) is not value:
            raise RuntimeError(f"the call's {self.name} is written once")

    def take(self, call: Call) -> T | None:
        raise RuntimeError(f"the call's {self.name} is written once, never taken")


# Written once each, read as the call's fields of the same names:
KEY: Once[KeyRecord] = Once("key")  # the edge from the head, a batch's line from its batch, or Authenticate
TEAM: Once[TeamRecord] = Once("team")  # Authenticate (policies/auth.py)
CLASS: Once[PriorityClass] = Once("class")  # Classify (policies/priority.py)
MODEL: Once[str] = Once("model")  # ResolveModel (policies/models.py)
# Written by each pick (Call.routed): the prompt tokens the chosen replica likely has to prefill
UNCACHED: Slot[float] = Slot("uncached prompt tokens")


class Step(Protocol):
    name: str

    @property
    def writes(self) -> tuple[StateKey, ...]:
        """The slots of the call it fills: its own state, which no other step writes."""

    async def enter(self, call: Call) -> None:
        """Check or prepare the call; raise a GatewayError to refuse it."""

    async def leave(self, call: Call) -> None:
        """Release whatever `enter` took; runs once the response is over."""


class Pipeline:
    def __init__(self, steps: list[Step]) -> None:
        writers: dict[StateKey, str] = {}
        for step in steps:
            for slot in step.writes:
                if slot in writers:
                    raise ValueError(f"pipeline steps {writers[slot]} and {step.name} both write {slot.name}")
                writers[slot] = step.name
        self.steps = steps
        self.writers = writers  # slot -> the step that writes it

    async def enter(self, call: Call) -> None:
        for step in self.steps:
            await step.enter(call)
            call.entered.append(step)

    async def leave(self, call: Call) -> None:
        while call.entered:
            step = call.entered.pop()
            try:
                await step.leave(call)
            except Exception:  # one step's bug must not stop the others from releasing
                log.exception("pipeline step %s failed to leave request %s", step.name, call.request.id)
