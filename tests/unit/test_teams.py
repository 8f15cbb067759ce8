"""The rules that keep a key inside its team, and the team_admin token's shape."""

import asyncio
import time
from types import SimpleNamespace

import jwt
import pytest

from gateway.admin.auth import AdminAuth, mint_token
from policies.config import Admin, Priorities
from policies.errors import AuthenticationFailed
from policies.keys import KeyBudget, KeyLimits, KeyRecord, hash_key, new_key, new_key_id
from policies.priority import class_order, within_ceiling
from policies.teams import TeamRecord, effective_models, key_problems, keys_over
from tests.support.calls import call_of

SECRET = "t" * 40
# most urgent first, as the policy lists them; the default is the middle one
CLASSES = Priorities(default="interactive", classes=[{"name": "urgent"}, {"name": "interactive"},
                                                      {"name": "batch", "vllm_priority": 10}])
ORDER = class_order(CLASSES)


def key(**fields) -> KeyRecord:
    key_id = new_key_id()
    return KeyRecord(id=key_id, name="k", created_at=time.time(), hash=hash_key(new_key(key_id)), team="red",
                     **fields)


TEAM = TeamRecord(name="red", models=["a", "b"], data_policy="private_only", max_priority_class="interactive",
                  limits=KeyLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=2),
                  budget=KeyBudget(max_rented_spend=5.0, max_tokens_per_period=100))


def test_a_key_that_sets_nothing_of_its_own_fits_and_inherits_the_teams_models() -> None:
    assert key_problems(key(), TEAM, ORDER) == []
    assert effective_models(key(), TEAM) == ["a", "b"]
    assert effective_models(key(models=["b", "c"]), TEAM) == ["b"]
    assert effective_models(key(models=["c"]), None) == ["c"]


@pytest.mark.parametrize("fields, field", [
    ({"models": ["a", "z"]}, "models"),
    ({"limits": KeyLimits(requests_per_minute=11)}, "limits.requests_per_minute"),
    ({"limits": KeyLimits(tokens_per_minute=1001)}, "limits.tokens_per_minute"),
    ({"limits": KeyLimits(max_concurrent=3)}, "limits.max_concurrent"),
    ({"data_policy": "allow_rented"}, "data_policy"),
    ({"budget": KeyBudget(max_rented_spend=5.01)}, "budget.max_rented_spend"),
    ({"budget": KeyBudget(max_tokens_per_period=101)}, "budget.max_tokens_per_period"),
    ({"priority_class": "urgent"}, "priority_class"),
])
def test_each_way_a_key_exceeds_its_team_is_named(fields: dict, field: str) -> None:
    problems = key_problems(key(**fields), TEAM, ORDER)
    assert [f for f, _ in problems] == [field]
    assert field in problems[0][1] and "red" in problems[0][1]


def test_equal_to_the_team_fits_and_a_team_without_a_setting_bounds_nothing() -> None:
    same = key(models=["a"], limits=TEAM.limits, budget=KeyBudget(max_rented_spend=5.0, max_tokens_per_period=100))
    assert key_problems(same, TEAM, ORDER) == []
    open_team = TeamRecord(name="red", data_policy="allow_rented")
    assert key_problems(key(models=["z"], data_policy="allow_rented", limits=KeyLimits(max_concurrent=99)),
                        open_team, ORDER) == []


def test_a_priority_class_is_ranked_as_the_policy_lists_and_serves_it() -> None:
    for fits in ("interactive", "batch", "gone"):  # at, below, and a name the policy lacks (served as the default)
        assert key_problems(key(priority_class=fits), TEAM, ORDER) == []
    [(field, text)] = key_problems(key(priority_class="urgent"), TEAM, ORDER)
    assert text == "priority_class urgent is above team red's max_priority_class interactive"
    lowest = TEAM.model_copy(update={"max_priority_class": "batch"})
    assert [f for f, _ in key_problems(key(priority_class="gone"), lowest, ORDER)] == ["priority_class"]
    no_ceiling = TEAM.model_copy(update={"max_priority_class": None})
    assert key_problems(key(priority_class="urgent"), no_ceiling, ORDER) == []
    above, unset = key(priority_class="interactive"), key()  # a key naming no class is clamped when called
    assert list(keys_over(lowest, [above, unset], ORDER)) == [above.id]


def test_a_calls_class_is_clamped_down_to_its_teams_ceiling() -> None:
    urgent, interactive, batch = CLASSES.classes
    assert within_ceiling(urgent, TEAM, CLASSES) is interactive
    assert within_ceiling(interactive, TEAM, CLASSES) is interactive
    assert within_ceiling(batch, TEAM, CLASSES) is batch  # below the ceiling: untouched
    assert within_ceiling(urgent, None, CLASSES) is urgent
    assert within_ceiling(urgent, TEAM.model_copy(update={"max_priority_class": None}), CLASSES) is urgent
    # the policy renamed the team's ceiling away: its calls get the least urgent class, never a free pass
    renamed = Priorities(default="fast", classes=[{"name": "fast"}, {"name": "slow"}])
    assert within_ceiling(renamed.classes[0], TEAM, renamed) is renamed.classes[1]


def test_a_team_change_names_its_active_keys_above_it() -> None:
    over, fits, revoked = key(limits=KeyLimits(max_concurrent=2)), key(), key(limits=KeyLimits(max_concurrent=2),
                                                                               revoked=True)
    other_team = key(limits=KeyLimits(max_concurrent=2)).model_copy(update={"team": "blue"})
    tighter = TEAM.model_copy(update={"limits": KeyLimits(max_concurrent=1)})
    assert keys_over(tighter, [over, fits, revoked, other_team], ORDER) == \
        {over.id: [key_problems(over, tighter, ORDER)[0][1]]}


async def test_team_admin_tokens_carry_their_team(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    auth = AdminAuth(Admin())
    claims = await auth.check(f"Bearer {mint_token(Admin(), 60, role='team_admin', team='red')}", write=True,
                              team_admin=True)
    assert claims["role"] == "team_admin" and claims["team"] == "red"
    for bad in ({"role": "team_admin"}, {"role": "team_admin", "team": "Red Team"}, {"role": "admin", "team": "red"}):
        with pytest.raises(ValueError):
            mint_token(Admin(), 60, **bad)
    now = int(time.time())
    teamless = jwt.encode({"iss": "llm-gateway", "aud": "llm-gateway-admin", "role": "team_admin", "exp": now + 60},
                          SECRET, algorithm="HS256")
    with pytest.raises(AuthenticationFailed):
        await auth.check(f"Bearer {teamless}", write=False)


async def test_a_call_rents_only_while_both_its_keys_and_its_teams_budgets_have_room(tmp_path) -> None:
    """Each rented call costs 1; the key may spend 5, its team 2: the third call stays owned, and the key's
    reservation for it is given back (its spend stays what was really rented)."""
    from policies.budget import BEFORE_RENT, Budget, MemoryBudgets, period_bounds
    from policies.config import Policy
    from policies.finished import record_of
    from policies.ledger.sqlite import SQLiteLedger
    from policies.pipeline import Request

    ledger = SQLiteLedger(str(tmp_path / "ledger.db"))
    budgets = MemoryBudgets(ledger, members=lambda team: asyncio.sleep(0, []))
    policy = Policy.model_validate({"models": [{"name": "m", "backends": [{"url": "http://10.0.0.1:8000"}]}]})
    step = Budget(policy, budgets, lambda provider, prompt, completion: 1.0, background=None)
    step.overflow = {"m": "rented"}
    team = TeamRecord(name="red", data_policy="allow_rented", budget=KeyBudget(max_rented_spend=2.0))
    member = key(data_policy="allow_rented", budget=KeyBudget(max_rented_spend=5.0))
    rented = []
    for i in range(3):
        call = call_of(Request(str(i), "chat/completions", {}, "10.0.0.2", 0.0),
                       model="m", key=member, team=team)
        await step.enter(call)
        rented.append(await BEFORE_RENT.of(call)())
        call.usage = {"prompt_tokens": 1, "completion_tokens": 1}
        call.status, call.replica = 200, SimpleNamespace(rented="rented" if rented[-1] else None)
        await step.leave(call)
        step.observe(record_of(call, lambda provider, prompt, completion: 1.0))  # settles from the record
    assert rented == [True, True, False]
    start, end = period_bounds("month", time.time())
    assert await budgets.status(member.id, start, end) == (2.0, 4.0)  # spent, tokens: the two rented calls
    assert (await budgets.counters(member.id, start))[1] == 0.0  # nothing left held: the third's was given back
    assert await budgets.status(team.id, start, end) == (2.0, 4.0)
    await ledger.close()


async def test_the_classify_step_clamps_a_header_pick_and_a_clients_own_priority_to_the_ceiling() -> None:
    from policies.config import Policy
    from policies.pipeline import Call, Request
    from policies.priority import CLIENT_PRIORITY, Classify

    policy = Policy.model_validate({"models": [{"name": "m", "backends": [{"url": "http://10.0.0.1:8000"}]}],
                                    "priorities": CLASSES.model_dump()})
    step = Classify(policy)
    picker = key(priority_class="urgent", client_priority=True)
    capped = TEAM.model_copy(update={"max_priority_class": "batch"})

    async def classified(team: TeamRecord | None, header: str | None, body: dict) -> Call:
        call = call_of(Request("r", "chat/completions", {"x-priority-class": header} if header
                       else {}, "10.0.0.2", 0.0), model="m", key=picker, team=team, body=dict(body))
        await step.enter(call)
        return call

    assert (await classified(None, "urgent", {})).priority.name == "urgent"  # no team: the key's own choice
    assert (await classified(TEAM, None, {})).priority.name == "interactive"  # the key's own class, clamped
    assert (await classified(TEAM, "urgent", {})).priority.name == "interactive"  # the header's pick, clamped
    assert (await classified(capped, "interactive", {})).priority.name == "batch"
    assert (await classified(TEAM, "batch", {})).priority.name == "batch"  # below the ceiling: as asked
    # vLLM's own `priority` (lower is sooner): kept at or after the ceiling's, dropped when ahead of it
    kept = await classified(capped, None, {"priority": 10})
    assert CLIENT_PRIORITY.get(kept) == 10
    for ahead in (9, -100, 9.5, True):
        dropped = await classified(capped, None, {"priority": ahead})
        assert CLIENT_PRIORITY.get(dropped) is None and dropped.body["priority"] == ahead  # the client's, not sent
    assert CLIENT_PRIORITY.get(await classified(None, None, {"priority": -100})) == -100
