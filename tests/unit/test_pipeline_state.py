"""A call's per-step state: each pipeline step names the slots it writes, and one slot has one writer."""

from __future__ import annotations

import asyncio

import pytest

from policies.pipeline import CLASS, KEY, MODEL, TEAM, Call, Pipeline, Request, Slot, StateKey

COUNT: Slot[int] = Slot("count")
NAME: Slot[str] = Slot("name")


class Writes:
    def __init__(self, name: str, *slots: StateKey) -> None:
        self.name = name
        self.writes = slots
        self.left: list[str] = []

    async def enter(self, call: Call) -> None:
        if COUNT in self.writes:
            COUNT.put(call, 1)

    async def leave(self, call: Call) -> None:
        self.left.append(call.request.id)


def new_call() -> Call:
    return Call(Request("r1", "chat/completions", {}, "127.0.0.1", 0.0))


def test_two_steps_that_write_one_slot_make_no_pipeline() -> None:
    with pytest.raises(ValueError, match="first and second both write count"):
        Pipeline([Writes("first", COUNT), Writes("second", NAME, COUNT)])


def test_each_slot_has_its_writer() -> None:
    pipeline = Pipeline([Writes("first", COUNT), Writes("second", NAME), Writes("third")])
    assert pipeline.writers == {COUNT: "first", NAME: "second"}


def test_a_slot_reads_what_its_writer_put_and_is_taken_once() -> None:
    call = new_call()
    step = Writes("first", COUNT)
    pipeline = Pipeline([step])
    assert COUNT.get(call) is None
    with pytest.raises(LookupError, match="has no count"):
        COUNT.of(call)
    asyncio.run(pipeline.enter(call))
    assert COUNT.of(call) == 1
    assert COUNT.take(call) == 1
    assert COUNT.take(call) is None  # settled once
    asyncio.run(pipeline.leave(call))
    assert step.left == ["r1"]


def test_the_real_steps_each_write_their_own_slots() -> None:
    from policies.auth import Authenticate
    from policies.budget import BEFORE_RENT, HOLDS, Budget
    from policies.models import ResolveModel
    from policies.ownership import TAG_OWNER, Owners
    from policies.priority import CLIENT_PRIORITY, Classify
    from policies.rate_limit import TICKET, RateLimit
    from policies.variant_signals import ANSWER
    from policies.variants import LOAD_MATCHED, SHADOW, AssignVariant

    assert (Authenticate.writes, ResolveModel.writes, Owners.writes, Classify.writes, RateLimit.writes,
            Budget.writes, AssignVariant.writes) == \
        ((KEY, TEAM), (MODEL,), (TAG_OWNER,), (CLIENT_PRIORITY, CLASS), (TICKET,), (HOLDS, BEFORE_RENT),
         (LOAD_MATCHED, SHADOW, ANSWER))


def test_what_a_step_settles_is_written_once_and_read_as_the_calls_field() -> None:
    from policies.config.admission import Priorities

    call = new_call()
    assert (call.model, call.key, call.team, call.priority) == ("", None, None, None)
    MODEL.put(call, "m")
    klass = Priorities().named("batch")
    CLASS.put(call, klass)
    assert call.model == "m" and call.priority is klass
    with pytest.raises(RuntimeError, match="model is written once"):
        MODEL.put(call, "other")
    with pytest.raises(RuntimeError, match="class is written once"):
        CLASS.take(call)
    assert call.model == "m"
    with pytest.raises(AttributeError):
        call.model = "other"  # type: ignore[misc]  # read-only: only MODEL.put writes it
    call.fallback_model = "small"  # a fallback chain serves it as another model; what it asked stays
    assert call.model == "small" and MODEL.of(call) == "m"
