"""The rules that keep a key inside its team, and the team_admin token's shape."""

import time

import jwt
import pytest

from gateway.admin_auth import AdminAuth, mint_token
from policies.config import Admin
from policies.errors import AuthenticationFailed
from policies.keys import KeyBudget, KeyLimits, KeyRecord, hash_key, new_key, new_key_id
from policies.teams import TeamRecord, effective_models, key_problems, keys_over

SECRET = "t" * 40


def key(**fields) -> KeyRecord:
    key_id = new_key_id()
    return KeyRecord(id=key_id, name="k", created_at=time.time(), hash=hash_key(new_key(key_id)), team="red",
                     **fields)


TEAM = TeamRecord(name="red", models=["a", "b"], data_policy="private_only",
                  limits=KeyLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=2),
                  budget=KeyBudget(max_rented_spend=5.0, max_tokens_per_period=100))


def test_a_key_that_sets_nothing_of_its_own_fits_and_inherits_the_teams_models() -> None:
    assert key_problems(key(), TEAM) == []
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
])
def test_each_way_a_key_exceeds_its_team_is_named(fields: dict, field: str) -> None:
    problems = key_problems(key(**fields), TEAM)
    assert [f for f, _ in problems] == [field]
    assert field in problems[0][1] and "red" in problems[0][1]


def test_equal_to_the_team_fits_and_a_team_without_a_setting_bounds_nothing() -> None:
    same = key(models=["a"], limits=TEAM.limits, budget=KeyBudget(max_rented_spend=5.0, max_tokens_per_period=100))
    assert key_problems(same, TEAM) == []
    open_team = TeamRecord(name="red", data_policy="allow_rented")
    assert key_problems(key(models=["z"], data_policy="allow_rented", limits=KeyLimits(max_concurrent=99)),
                        open_team) == []


def test_a_team_change_names_its_active_keys_above_it() -> None:
    over, fits, revoked = key(limits=KeyLimits(max_concurrent=2)), key(), key(limits=KeyLimits(max_concurrent=2),
                                                                               revoked=True)
    other_team = key(limits=KeyLimits(max_concurrent=2)).model_copy(update={"team": "blue"})
    tighter = TEAM.model_copy(update={"limits": KeyLimits(max_concurrent=1)})
    assert keys_over(tighter, [over, fits, revoked, other_team]) == {over.id: [key_problems(over, tighter)[0][1]]}


def test_team_admin_tokens_carry_their_team(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    auth = AdminAuth(Admin())
    claims = auth.check(f"Bearer {mint_token(Admin(), 60, role='team_admin', team='red')}", write=True)
    assert claims["role"] == "team_admin" and claims["team"] == "red"
    for bad in ({"role": "team_admin"}, {"role": "team_admin", "team": "Red Team"}, {"role": "admin", "team": "red"}):
        with pytest.raises(ValueError):
            mint_token(Admin(), 60, **bad)
    now = int(time.time())
    teamless = jwt.encode({"iss": "llm-gateway", "aud": "llm-gateway-admin", "role": "team_admin", "exp": now + 60},
                          SECRET, algorithm="HS256")
    with pytest.raises(AuthenticationFailed):
        auth.check(f"Bearer {teamless}", write=False)
