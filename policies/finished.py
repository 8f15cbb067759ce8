"""The finished-call record and its observers (the design's fifth shape).

Once a call is over (answered, refused, failed, or its client gone) the proxy builds one immutable `Finished`
record, its tokens and cost counted once, and hands it to `Observers.finished`. Metrics, the access log, the
usage and cost ledgers, tracing, shadow comparison and the variants' signals each subscribe: the policy
snapshot lists them (policies/snapshot.py), so a new report is a module with an `observe(record)` and one
line there, not an edit of the proxy.

An observer runs on the request path after the reply is settled, so it must be quick (sum in memory, write
later). Its exception never reaches the client: it is logged and counted (llm_gateway_observer_errors), and
the other observers still run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from backends.replicas import Replica
from policies.tokens import used_tokens

if TYPE_CHECKING:
    from policies.pipeline import Call

log = logging.getLogger("gateway.observers")

OWNED, RENTED = "owned", "rented"


class Finished(NamedTuple):
    """Immutable, and a tuple because one is built per request: a frozen dataclass's __init__ (an
    object.__setattr__ per field) cost several times as much on the request path."""

    request_id: str
    endpoint: str  # the route's name (gateway/endpoints/)
    model: str  # the public model name; "" when the call ended before it named one it may use
    group: str  # the replica set it was admitted to: the model, or `model#variant`
    variant: str | None  # the model's variant that served it, when the model has variants
    key_id: str | None  # the caller's key id, once authenticated (never the key)
    replica: Replica | None  # the owned replica or rented target it was last sent to; None: never sent
    served_by: str | None  # "owned" or "rented" for an answer below 400, else None
    status: int
    stream: bool
    prompt_tokens: int
    completion_tokens: int
    estimated: bool  # a rented answer without usage: its tokens are the gateway's estimate
    cost: float  # the rented tokens at the provider's price (0 on an owned replica)
    elapsed: float  # seconds from arrival to the end
    overhead: float  # seconds the gateway itself spent on it
    queue_wait: float  # seconds it waited for a slot on an owned backend
    sent_at: float  # perf_counter() when it was last sent upstream; 0: never sent
    ended_at: float  # perf_counter() when it ended
    call: Call | None  # the exchange itself (body, answer, trace), for the observers that read it

    @property
    def rented(self) -> str | None:
        """The provider's name when a rented API served (or failed) it."""
        return self.replica.rented if self.replica is not None else None


def record_of(call: Call, cost: Callable[[str, int, int], float]) -> Finished:
    """The record of a finished `call`; `cost(provider, prompt, completion)` prices rented tokens."""
    now = time.perf_counter()
    usage = call.usage if isinstance(call.usage, dict) else {}
    prompt, completion = used_tokens(usage)
    replica, status, key = call.replica, call.status, call.key
    rented = replica.rented if replica is not None else None
    served_by = (RENTED if rented else OWNED) if replica is not None and status < 400 else None
    return Finished(call.request.id, call.request.route, call.model, call.group or call.model, call.variant,
                    key.id if key is not None else None, replica, served_by, status, call.stream, prompt, completion,
                    usage.get("estimated") is True, cost(rented, prompt, completion) if rented else 0.0,
                    now - call.request.arrived, call.overhead, call.queue_wait, call.sent_at, now, call)


def answered(request_id: str, endpoint: str, status: int, arrived: float) -> Finished:
    """The record of a call the gateway answered itself (the model list): no model, no backend."""
    now = time.perf_counter()
    return Finished(request_id, endpoint, "", "", None, None, None, None, status, False, 0, 0, False, 0.0,
                    now - arrived, 0.0, 0.0, 0.0, now, None)


class Observer(Protocol):
    name: str

    def observe(self, record: Finished) -> None:
        """Take note of one finished call; quick, and never raising on purpose."""


class Observers:
    """The observers of one snapshot, called in order for every finished call."""

    def __init__(self, observers: Sequence[Observer], on_error: Callable[[str], None] = lambda name: None) -> None:
        self.observers = tuple(observers)
        self.on_error = on_error
        self.calls = tuple((o.name, o.observe) for o in self.observers)  # looked up once, not per call

    def finished(self, record: Finished) -> None:
        for name, observe in self.calls:
            try:
                observe(record)
            except Exception:  # one observer's bug must neither fail the response nor starve the others
                log.exception("observer %s failed on request %s", name, record.request_id)
                self.on_error(name)

    def __iter__(self) -> Iterator[Observer]:
        return iter(self.observers)
