"""Pipeline step: which priority class a request belongs to, and what it may say about it.

A key carries a class (`priority_class`, else the policy's default). A key with `client_priority` may pick
another class per request with the policy's header (x-priority-class) and may send vLLM's own `priority`
field; from any other key that field is dropped and the header ignored, so a client cannot buy itself a
better place in a queue its key does not allow. Admission serves waiting requests class by class; backends
that run vLLM's priority scheduling get the class's `vllm_priority` (policies/admission.py, gateway/proxy.py).
A batch's lines are always in the batch class (`batch.priority_class`), whatever their key's.
A key of a team with `max_priority_class` is never served above it (policies/teams.py): the class is clamped
down to the ceiling, and a client's own `priority` more urgent than the ceiling's `vllm_priority` is dropped.
A client's own `priority` stays within its class's range: a class after the first is never served ahead of a
better one, so a value at or below a better class's `vllm_priority` or its prefill levels (lower is served
first in vLLM; at a tie the earlier arrival is) becomes one past the largest of them: a batch line sent with
`priority: -100` still runs behind interactive work.
"""

from __future__ import annotations

from policies.config import Policy, Priorities, PriorityClass
from policies.errors import BadRequest
from policies.json_types import JSON, is_int
from policies.pipeline import CLASS, Call, Slot
from policies.teams import ClassOrder, TeamRecord


def default_class(priorities: Priorities) -> PriorityClass:
    """The class of a request whose key names none."""
    chosen = priorities.named(priorities.default)
    assert chosen is not None  # the schema's known_default: the default is one of the classes
    return chosen


def class_order(priorities: Priorities) -> ClassOrder:
    """The policy's classes as a team's ceiling ranks them (policies/teams.py)."""
    return ClassOrder(tuple(c.name for c in priorities.classes), priorities.default)


def within_ceiling(chosen: PriorityClass, team: TeamRecord | None, priorities: Priorities,
                   order: ClassOrder | None = None) -> PriorityClass:
    """`chosen`, or the team's ceiling class where `chosen` is more urgent (listed earlier in the policy)."""
    top = (order or class_order(priorities)).ceiling(team)
    if top is None:
        return chosen
    return priorities.classes[top] if priorities.classes.index(chosen) < top else chosen


# the vLLM `priority` the client sent and its key lets it send, clamped to its class: the proxy sends it instead
# of its class's (absent: the client's own, if any, is dropped)
CLIENT_PRIORITY: Slot[JSON] = Slot("client's own priority")


class Classify:
    name = "priority"
    writes = (CLIENT_PRIORITY, CLASS)

    def __init__(self, policy: Policy) -> None:
        self.config = policy.priorities
        self.order = class_order(self.config)
        self.default = default_class(self.config)
        # a batch's lines: the batch class (the last, least urgent class when the policy has none of that name)
        self.batch = self.config.named(policy.batch.priority_class) or self.config.classes[-1]
        # by class name: the least vLLM priority a client may send in it (None: the first class, unbounded): one
        # past every better class's range (its vllm_priority and its prefill levels, policies/prefill_order.py)
        self.floors = {c.name: (max(b.last_priority for b in self.config.classes[:i]) + 1 if i else None)
                       for i, c in enumerate(self.config.classes)}

    def of(self, call: Call) -> PriorityClass:
        chosen = self.asked(call)
        return chosen if call.team is None else within_ceiling(chosen, call.team, self.config, self.order)

    def asked(self, call: Call) -> PriorityClass:
        """The class the key names or its client picks, before the team's ceiling."""
        key = call.key
        if call.batch is not None:
            return self.batch
        assert key is not None  # the key step ran first
        if key.client_priority:
            asked = call.request.headers.get(self.config.header)
            if asked:
                chosen = self.config.named(asked.strip())
                if chosen is None:
                    raise BadRequest(f"unknown priority class in {self.config.header}; known: "
                                     f"{', '.join(c.name for c in self.config.classes)}", param=self.config.header,
                                     code="unknown_priority_class")
                return chosen
        # a class the policy no longer has (renamed since the key was set) falls back to the default
        return self.config.named(key.priority_class) or self.default

    async def enter(self, call: Call) -> None:
        CLASS.put(call, self.of(call))
        assert call.key is not None  # the key step ran first (a batch's line comes with its key)
        own = call.body.get("priority")
        if own is not None and call.key.client_priority and self.own_priority_fits(call):
            CLIENT_PRIORITY.put(call, self.clamped(call, own))

    def clamped(self, call: Call, own: JSON) -> JSON:
        """A client's own vLLM `priority` no more urgent than its class's range allows (see the docstring)."""
        floor = self.floors.get(call.priority.name) if call.priority is not None else None
        if floor is not None and is_int(own) and own < floor:
            return floor
        return own

    def own_priority_fits(self, call: Call) -> bool:
        """Whether a client's own vLLM `priority` stays within its team's ceiling (lower is more urgent)."""
        top = self.order.ceiling(call.team)
        own = call.body.get("priority")
        if top is None or own is None:
            return True
        floor = self.config.classes[top].vllm_priority
        return is_int(own) and own >= floor

    async def leave(self, call: Call) -> None:
        pass
