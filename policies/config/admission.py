"""Waiting for a slot: the model's queue, the priority classes, and caps shared across gateway replicas."""

from __future__ import annotations

from pydantic import Field, model_validator

from policies.config.base import NAME, Seconds, Strict


class Queue(Strict):
    """Where requests wait while every replica of the model is at its cap."""

    max_depth: int = Field(256, ge=0, le=100_000)  # more waiting than this: 429 at once
    max_wait: Seconds = 30.0  # waited this long: 429 with a Retry-After from the observed drain rate
    # slots of each replica's cap that batch-class requests (batch lines, and the batch class generally) leave
    # free, so an arriving interactive request finds one at once instead of waiting for a batch line to end;
    # None: an eighth of the cap, at least 1; 0: no reserve. Never the whole cap: batch work keeps one slot
    reserve: int | None = Field(None, ge=0, le=100_000)


class PriorityClass(Strict):
    """A class of traffic: waiting requests are served class by class (in the order the policy lists them),
    fairly across keys within a class."""

    name: str = Field(pattern=NAME)
    max_wait: Seconds | None = None  # its own bound on the wait for a slot (default: the model's queue.max_wait)
    vllm_priority: int = 0  # sent as vLLM's `priority` to backends with scheduling_policy: priority
    rent_first: bool = False  # a key allowed to rent spills to the rented provider rather than wait at all
    # the least fraction of freed slots this class gets while it waits, ahead of better classes (so nightly
    # batch work finishes under steady interactive load); 0: served only when no better class wants a slot,
    # which starves it whenever better classes alone fill the cap
    min_share: float = Field(0.0, ge=0, le=1)
    # cheapest prefill first within the class, on backends with scheduling_policy: priority: a request is sent
    # as vllm_priority + level, its level the prompt tokens the chosen replica likely has to prefill (what the
    # prefix scorer did not find cached there) divided by level_tokens, at most prefill_levels - 1; vLLM then
    # serves a waiting request that recomputes little ahead of one that recomputes a whole prompt, which cuts
    # the mean wait when prefills queue. 1: arrival order. Levels stay below the next class's vllm_priority.
    prefill_levels: int = Field(1, ge=1, le=64)
    level_tokens: int = Field(1024, ge=16, le=1_000_000)

    @property
    def last_priority(self) -> int:
        """The least urgent vLLM `priority` the class sends: its `vllm_priority` and its prefill levels."""
        return self.vllm_priority + self.prefill_levels - 1


class Priorities(Strict):
    default: str = Field("interactive", pattern=NAME)  # the class of a key that names none
    header: str = Field("x-priority-class", pattern=r"^[a-z0-9-]{1,64}$")  # where a permitted client picks one
    # a slot freed by a request while only worse classes wait is kept this long for its own class's next
    # request (a client sends its next call a moment after the last ends); 0: handed on at once
    hold: float = Field(0.05, ge=0, le=1)
    classes: list[PriorityClass] = Field([
        PriorityClass(name="interactive", prefill_levels=4),
        PriorityClass(name="batch", max_wait=300, vllm_priority=10, rent_first=True, prefill_levels=4),
    ], min_length=1, max_length=16)

    @model_validator(mode="after")
    def known_default(self) -> Priorities:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError("priority class names must be unique")
        if self.default not in names:
            raise ValueError(f"default {self.default!r} is not one of the classes: {', '.join(names)}")
        for i, c in enumerate(self.classes):
            later = [b.vllm_priority for b in self.classes[i + 1:]]
            if c.prefill_levels > 1 and later and c.last_priority >= min(later):
                raise ValueError(f"class {c.name!r}: vllm_priority {c.vllm_priority} + prefill_levels "
                                 f"{c.prefill_levels} - 1 reaches a later class's vllm_priority ({min(later)}): "
                                 "its levels would be served with or after that class")
        return self

    def named(self, name: str | None) -> PriorityClass | None:
        return next((c for c in self.classes if c.name == name), None)


class Caps(Strict):
    """Backend caps shared by every gateway replica (with the Redis store): slots are leases in Redis."""

    lease_seconds: Seconds = 15.0  # renewed every third of it; a dead gateway's slots come back after this
    poll_interval: float = Field(0.02, ge=0.001, le=5)  # how often a process with waiters retries the fleet
    # a process whose longest waiter (same class) arrived within this of another process's takes a free slot
    # itself instead of yielding it: strict order would hand each slot across processes, a refusal and a
    # wake-up apiece, which at hundreds of slots freed at once leaves the backend short for tens of ms
    fair_within: float = Field(0.05, ge=0, le=10)
