"""admin.oidc as the policy file gives it, and how a provider's claims become one gateway role."""

import pytest
from pydantic import ValidationError

from gateway.admin.auth import role_of
from policies.config import Admin

ROLES = {"admins": "admin", "ops": "operator", "all": "viewer",
         "search-leads": {"role": "team_admin", "team": "search"},
         "ads-leads": {"role": "team_admin", "team": "ads"}}


def oidc(**settings):
    return Admin(oidc={"issuer": "https://sso.example.com/realms/x", "roles": ROLES, **settings}).oidc


@pytest.mark.parametrize("bad", [
    {"issuer": "http://sso.example.com"},  # plain http off the loopback address
    {"issuer": "sso.example.com"},
    {"roles": {}},
    {"roles": {"g": "root"}},
    {"roles": {"g": "team_admin"}},  # a team admin of no team
    {"roles": {"g": {"role": "admin", "team": "search"}}},  # a team only with team_admin
    {"algorithms": ["HS256"]},
    {"algorithms": ["none"]},
    {"surprise": 1},
])
def test_bad_settings_are_refused_by_name(bad):
    with pytest.raises(ValidationError):
        oidc(**bad)


def test_loopback_http_and_defaults():
    settings = oidc(issuer="http://127.0.0.1:8444")
    assert settings.audience == "llm-gateway-admin" and settings.claim == "groups"
    assert settings.roles["ops"].role == "operator"
    assert settings.roles["search-leads"].team == "search"
    timings = (settings.refresh_seconds, settings.unknown_kid_refetch_seconds, settings.max_stale_seconds)
    assert timings == (300, 30, 3600)


def test_the_strongest_mapped_role_wins_and_a_team_comes_only_from_the_mapping():
    settings = oidc()
    assert role_of({"groups": ["all", "ops"]}, settings).role == "operator"
    assert role_of({"groups": ["all", "admins", "ops"]}, settings).role == "admin"
    both = role_of({"groups": ["ads-leads", "all", "search-leads"]}, settings)
    assert (both.role, both.team) == ("team_admin", "search")  # between two teams, the first the policy lists
    assert role_of({"groups": "ops"}, settings).role == "operator"  # a single string
    assert role_of({"groups": ["nobody", 3, None]}, settings) is None
    assert role_of({"groups": {"admins": True}}, settings) is None
    assert role_of({}, settings) is None
    nested = oidc(claim="realm_access.roles")
    assert role_of({"realm_access": {"roles": ["admins"]}}, nested).role == "admin"
    assert role_of({"realm_access": ["admins"]}, nested) is None
