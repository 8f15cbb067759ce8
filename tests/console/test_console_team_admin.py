"""A team admin in the console: signing in with a `team_admin` token opens the console on its team's keys; it
sees, issues and changes only its team's keys, sees only its team's usage and budget, and no URL (another team's
key, a fleet-wide page, a change to another team's key) reaches any other team's data."""

from __future__ import annotations

import re

import httpx
import pytest

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.support.gateway import TEST_KEY, one_model, running_gateway
from tests.support.servers import serve_app

SECRET = "t" * 40
CONSOLE = {"enabled": True, "secure_cookie": False}


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(Admin().jwt_secret_env, SECRET)


def bearer(role: str = "admin", team: str | None = None) -> dict:
    token = mint_token(Admin(), 900, role=role, subject=f"{role}-{team}", secret=SECRET, team=team)
    return {"authorization": f"Bearer {token}"}


async def issued(http: httpx.AsyncClient, name: str, team: str | None) -> tuple[str, str]:
    r = await http.post("/admin/keys", json={"name": name, "team": team}, headers=bearer())
    assert r.status_code == 201, r.text
    return r.json()["record"]["id"], r.json()["key"]


async def test_a_team_admin_sees_and_manages_only_its_own_teams_keys_usage_and_budget():
    async with serve_app(simulator(SimConfig(model="served-m"))) as sim, \
            running_gateway({**one_model(sim), "console": CONSOLE}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        for team in ("red", "blue"):
            r = await http.post("/admin/teams", json={"name": team, "budget": {"max_tokens_per_period": 100000}},
                                headers=bearer())
            assert r.status_code == 201, r.text
        red_id, red_key = await issued(http, "red-app", "red")
        blue_id, blue_key = await issued(http, "blue-app", "blue")
        untouched = TEST_KEY.split("-")[1]  # a key of no team
        for key in (red_key, blue_key):
            r = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text

        form = await http.get("/console/signin")
        nonce = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
        team_token = bearer("team_admin", "red")["authorization"].split()[1]
        r = await http.post("/console/signin", data={"csrf": nonce, "token": team_token})
        assert r.status_code == 303 and r.headers["location"] == "/console/keys"  # its team's keys, not the fleet
        keys = await http.get("/console/keys")
        assert keys.status_code == 200 and "team red" in keys.text
        csrf = re.search(r'"X-CSRF-Token": "([0-9a-f]+)"', keys.text).group(1)
        assert red_id in keys.text and blue_id not in keys.text and untouched not in keys.text
        nav = re.findall(r'<li><a href="/console/([a-z]+)"', keys.text)
        assert nav == ["keys", "teams", "usage", "report"]
        assert (await http.get("/console/keys", params={"q": "blue"})).text.count(blue_id) == 0

        # another team's key (or a key of no team) by URL: refused, and nothing of it shown
        for other in (blue_id, untouched):
            r = await http.get(f"/console/keys/{other}")
            assert r.status_code == 403 and "blue-app" not in r.text and other not in r.text.split("</header>")[1]
            for action, form_data in (("/revoke", {}), ("", {"name": "taken"}), ("/rotate", {})):
                r = await http.post(f"/console/keys/{other}{action}", data={"csrf": csrf, **form_data},
                                    headers={"hx-request": "true"})
                assert r.status_code == 403, (other, action, r.status_code)
                assert "sk-" not in r.text
        blue = (await http.get(f"/admin/keys/{blue_id}", headers=bearer())).json()
        assert blue["name"] == "blue-app" and blue["revoked"] is False

        # its own team's key: shown, changed, and a new one is issued into its team
        assert (await http.get(f"/console/keys/{red_id}")).status_code == 200
        r = await http.post(f"/console/keys/{red_id}", data={"csrf": csrf, "name": "red-renamed"},
                            headers={"hx-request": "true"})
        assert r.status_code == 200, r.text
        r = await http.post("/console/keys", data={"csrf": csrf, "name": "red-second"}, headers={"hx-request": "true"})
        assert r.status_code == 201, r.text
        listed = {k["name"]: k["team"] for k in (await http.get("/admin/keys", headers=bearer())).json()}
        assert listed["red-renamed"] == "red" and listed["red-second"] == "red" and listed["blue-app"] == "blue"

        usage = await http.get("/console/usage")
        assert usage.status_code == 200
        assert red_id in usage.text and blue_id not in usage.text and "blue-app" not in usage.text
        assert re.search(r'id="team-budget">Rented spend [0-9.]+; tokens \d+ of 100000', usage.text), usage.text

        # its own-or-rent view counts its team's calls only (tests/console/test_console_teams.py)
        report = await http.get("/console/report.json")
        assert report.status_code == 200 and set(report.json()["keys"]) == {red_id}

        # every page and JSON that is not about its team: refused, whatever the URL
        for path in ("fleet", "fleet/live", "variants", "batches", "audit", "teams/blue"):
            r = await http.get(f"/console/{path}")
            assert r.status_code == 403, (path, r.status_code)
            assert blue_id not in r.text and "blue-app" not in r.text, path
        for path, data in (("reload", {}), ("variants", {"model": "m"})):
            assert (await http.post(f"/console/{path}", data={"csrf": csrf, **data})).status_code == 403

        r = await http.post("/console/signout", data={"csrf": csrf})
        assert r.status_code == 303
        assert (await http.get("/console/keys", follow_redirects=False)).status_code == 303
