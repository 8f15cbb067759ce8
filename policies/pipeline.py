"""One request moving through the gateway, and the ordered steps it passes before reaching a backend.

Like a filter chain: each step may stop the request by raising a GatewayError. Steps that entered get their
`leave` called exactly once when the response is finished, however it ended (done, error, client gone), so a
step that takes something (a concurrency slot, a token reservation) always gives it back. What a finished call
did is not a step's business but its observers' (policies/finished.py: metrics, usage, the ledger...).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from backends.replicas import Replica
from policies.routing.request import Prompt, PromptReader, RoutingRequest
from policies.tokens import FREE, Estimate

if TYPE_CHECKING:  # the steps' own types
    from backends.lora import AdapterTarget
    from policies.budget_holds import Hold
    from policies.config.admission import PriorityClass
    from policies.keys import KeyRecord
    from policies.ratelimit.base import Ticket
    from policies.teams import TeamRecord
    from policies.variant_signals import StreamAnswer

log = logging.getLogger("gateway.pipeline")


@dataclass(slots=True, eq=False)
class Call:
    request_id: str
    endpoint: str  # the route's name: "chat/completions", "responses", "tokenize"... (gateway/endpoints/)
    headers: Mapping[str, str]  # the client's request headers, names in lower case
    client_host: str
    arrived: float  # perf_counter() when the request arrived
    sent_at: float = 0.0  # perf_counter() when it was sent upstream
    prompt_of: PromptReader | None = None  # how its route reads the prompt of its body (prefix routing reads it)
    params: dict[str, str] = field(default_factory=dict)  # the parameters in its path ({id})
    query: str = ""  # the query string sent upstream ("?stream=true"), on a route that forwards the client's
    body: dict[str, Any] = field(default_factory=dict)  # a JSON body, or the text fields read of a form
    tokens: Estimate = FREE  # how the route prices this body in tokens, for the rate limits
    asked_model: object = None  # the model the request names (its body's `model`, or what its route found)
    pinned: Replica | None = None  # the one replica that can serve it (a stored Responses id lives there)
    key: KeyRecord | None = None  # the caller's key, once authenticated
    team: TeamRecord | None = None  # its key's team, when it has one (policies/teams.py)
    # ids it names that must be its key's (policies/ownership.py): (what the tag covers, the tag, the refusal)
    claims: list[tuple[str, str, Exception]] = field(default_factory=list)
    mints_ids: bool = False  # it will mint ids its key owns: the owners step sets tag_owner
    tag_owner: Callable[[str], str] | None = None  # (rest of an id) -> its owner tag, for this call's key
    priority: PriorityClass | None = None  # its class (policies/priority.py); None: the default class
    client_priority: bool = False  # the body's vLLM `priority` is the client's own (its key may set it)
    response_headers: dict[str, str] = field(default_factory=dict)  # added to the reply, errors included
    ticket: Ticket | None = None  # what the rate limiter took, to give back
    prompt_estimate: int = 0
    streamed_events: int = 0
    model: str = ""  # the public model name, after alias resolution
    variant: str | None = None  # the model's variant that serves it, when the model has variants
    adapter: AdapterTarget | None = None  # the LoRA adapter that serves it, when its model is one
    group: str = ""  # the replica set it is admitted to, when not the model's own: `model#variant`
    load: int = 0  # requests in flight to its replica when it was sent (itself included)
    load_matched: bool = False  # assigned its variant while the variant guard matched the load (policies/variant_guard.py)
    shadow: tuple[str, str] | None = None  # (variant, replica set) of a shadow variant it is copied to once under way
    stream: bool = False
    wants_usage: bool = False  # the client asked for the usage chunk in its stream
    replica: Replica | None = None
    holds_replica: bool = False  # counted in replica.in_flight right now
    status: int = 0
    usage: dict[str, Any] | None = None
    overhead: float = 0.0  # seconds the gateway itself spent on this call
    queue_wait: float = 0.0  # seconds it waited for a slot on an owned backend
    rent_allowed: bool = True  # False: this call stays on owned backends (e.g. its key's rented budget is spent)
    before_rent: Callable[[], Awaitable[bool]] | None = None  # set by a step: may it spill to a rented provider now?
    budget_hold: list[Hold] | None = None  # what the budget step reserved, to settle when the call ends
    error: BaseException | None = None  # why the call ended badly, if it did (a started stream: set as it ends)
    finished: bool = False
    entered: list[Step] = field(default_factory=list)
    # for the observers of the finished call (policies/finished.py): set by the proxy, read once it is finished
    first_token_at: float = 0.0  # perf_counter() of the first streamed chunk
    response: dict[str, Any] | None = None  # the parsed JSON answer of a call that was not streamed
    tap: list[bytes] | deque[bytes] | None = None  # when a trace wants them, the streamed chunks are appended here
    answer: StreamAnswer | None = None  # a variant's signals (policies/variant_signals.py): fed the streamed events
    batch: str | None = None  # the batch it is a line of (its key is set before it enters: policies/batches/)
    # what a layer above keeps on the call (its route, its upload, its trace: the HTTP shell's), by Slot
    state: dict[object, object] = field(default_factory=dict)

    def routing(self) -> RoutingRequest:
        """The request as routing sees it, for one pick (nothing is copied: the call's own headers and body are
        read)."""
        return RoutingRequest(self.model, self.endpoint, self.headers, self.adapter,
                              Prompt(self.body, self.prompt_of))


T = TypeVar("T")


class Slot(Generic[T]):
    """One module's own state on a call (as llm-d's CycleState): the module that makes the slot writes it, and a
    reader gets it typed through the slot. For what a layer above the policies keeps on a call (the HTTP shell's
    route, upload and trace), so that the call names no type of that layer and still holds nothing untyped."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

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


class Step(Protocol):
    name: str

    async def enter(self, call: Call) -> None:
        """Check or prepare the call; raise a GatewayError to refuse it."""

    async def leave(self, call: Call) -> None:
        """Release whatever `enter` took; runs once the response is over."""


class Pipeline:
    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps

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
                log.exception("pipeline step %s failed to leave request %s", step.name, call.request_id)
