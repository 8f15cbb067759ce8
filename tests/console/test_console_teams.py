"""The console's teams page over HTTP (no browser), a team admin's own-or-rent view, and the summary that opens
every long page. An admin lists every team (active keys, budget, limits, spend this period), creates one and
changes it through the admin API's own team operations (CSRF, 409 when a key would be above its team, audited);
a team admin sees its own team only, read-only, and another team's page answers it 403; its own-or-rent page
counts its team's calls only, whatever another team sends."""

from __future__ import annotations

import re

import httpx
import pytest

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.support.gateway import one_model, running_gateway
from tests.support.servers import serve_app

SECRET = "e" * 40
CONSOLE = {"enabled": True, "secure_cookie": False}
CALLS = {"red": 2, "blue": 5}  # distinct traffic, so one team's figures cannot pass for the other's


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(Admin().jwt_secret_env, SECRET)


def token(role: str = "admin", team: str | None = None) -> str:
    return mint_token(Admin(), 900, role=role, subject=f"{role}-{team or 'all'}", secret=SECRET, team=team)


def bearer() -> dict:
    return {"authorization": f"Bearer {token()}"}


async def signed_in(http: httpx.AsyncClient, jwt: str) -> str:
    """Signs `http` in; the session's CSRF token."""
    form = await http.get("/console/signin")
    nonce = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    r = await http.post("/console/signin", data={"csrf": nonce, "token": jwt})
    assert r.status_code == 303, r.text
    page = await http.get(r.headers["location"])
    return re.search(r'"X-CSRF-Token": "([0-9a-f]+)"', page.text).group(1)


def row(html: str, team: str) -> str:
    """The teams table's row of `team`, tags stripped."""
    found = re.search(rf'<tr data-team="{team}">(.*?)</tr>', html, re.S)
    assert found, f"no row for team {team}"
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", found.group(1))).strip()


def figure(html: str, label: str) -> str:
    """A summary figure by its label."""
    found = re.search(rf"<dt>{re.escape(label)}</dt><dd>([^<]*)</dd>", html)
    assert found, f"no summary figure {label!r}"
    return found.group(1)


def summary_first(html: str, where: str) -> None:
    """The page's main part opens with the summary block, before any table (and before the first card)."""
    main = html.split('<main id="main"', 1)[1]
    at = main.find('id="summary"')
    assert at != -1, f"{where} has no summary"
    assert main.count('id="summary"') == 1, where
    for first in ("<table", 'class="card'):
        if first in main:
            assert at < main.index(first), f"{where}: the summary comes after the first {first}"
    assert "<dt>" in main[at:main.index("</section>", at)], f"{where}: an empty summary"


async def test_an_admin_creates_and_changes_teams_and_a_team_admin_sees_only_its_own():
    async with serve_app(simulator(SimConfig(model="served-m"))) as sim, \
            running_gateway({**one_model(sim), "console": CONSOLE}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        csrf = await signed_in(http, token())
        for name in ("red", "blue"):
            r = await http.post("/console/teams", data={"csrf": csrf, "name": name, "description": f"the {name} team",
                                                        "requests_per_minute": "600"},
                                headers={"hx-request": "true"})
            assert r.status_code == 201, r.text
            assert f'href="/console/teams/{name}"' in r.text and 'hx-swap-oob="innerHTML"' in r.text
        assert (await http.post("/console/teams", data={"csrf": csrf, "name": "red"})).status_code == 409
        assert (await http.post("/console/teams", data={"csrf": csrf, "name": "Not A Name"})).status_code == 400
        assert (await http.post("/console/teams", data={"name": "green"})).status_code == 403  # no CSRF token
        assert (await http.get("/admin/teams/green", headers=bearer())).status_code == 404

        keys = {}
        for name in ("red", "blue"):
            r = await http.post("/admin/keys", json={"name": f"{name}-app", "team": name,
                                                     "limits": {"requests_per_minute": 300}}, headers=bearer())
            assert r.status_code == 201, r.text
            keys[name] = (r.json()["record"]["id"], r.json()["key"])
            for _ in range(CALLS[name]):
                r = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {keys[name][1]}"},
                                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text

        # change red: a budget, and limits the admin API takes; then one that its key would exceed (409)
        r = await http.post("/console/teams/red", headers={"hx-request": "true"},
                            data={"csrf": csrf, "description": "the red team", "data_policy": "private_only",
                                  "requests_per_minute": "400", "max_concurrent": "8", "max_tokens_per_period": "50000",
                                  "period": "week", "when_spent": "reject"})
        assert r.status_code == 200, r.text
        assert "Saved." in r.text and re.search(r'id="team-limits">400 requests/min, – tokens/min, 8 at once', r.text)
        red = (await http.get("/admin/teams/red", headers=bearer())).json()
        assert red["limits"] == {"requests_per_minute": 400, "tokens_per_minute": None, "max_concurrent": 8}
        assert red["budget"]["max_tokens_per_period"] == 50000 and red["budget"]["period"] == "week"
        r = await http.post("/console/teams/red", headers={"hx-request": "true"},
                            data={"csrf": csrf, "requests_per_minute": "100"})
        assert r.status_code == 409 and keys["red"][0] in r.text, r.text
        assert (await http.get("/admin/teams/red", headers=bearer())).json()["limits"]["requests_per_minute"] == 400
        events = (await http.get("/admin/audit", params={"action": "team.update"}, headers=bearer())).json()["events"]
        assert len(events) == 1 and events[0]["actor"] == "admin-all" and events[0]["target"] == "red"

        listing = await http.get("/console/teams")
        assert listing.status_code == 200
        summary_first(listing.text, "teams")
        assert figure(listing.text, "Teams") == "2" and figure(listing.text, "Active keys in them") == "2"
        assert row(listing.text, "red").startswith("red 1 – rented spend, 50000 tokens per week 400 / – / 8 0.0000")
        assert row(listing.text, "blue") == "blue 1 none 600 / – / – 0.0000 –"
        tokens_red = int(row(listing.text, "red").split()[-1])
        assert tokens_red > 0  # red's calls this week count against its new token budget
        page = await http.get("/console/teams/red")
        assert page.status_code == 200 and keys["red"][0] in page.text and keys["blue"][0] not in page.text
        summary_first(page.text, "a team's page")
        assert 'action="/console/teams/red"' in page.text  # an admin may change it

        # the long pages open with their summary
        for path in ("keys", "usage", "fleet", "report"):
            r = await http.get(f"/console/{path}")
            assert r.status_code == 200, path
            summary_first(r.text, path)
        assert figure((await http.get("/console/keys")).text, "In a team") == "2"
        admin_report = await http.get("/console/report")
        total = sum(CALLS.values())
        assert figure(admin_report.text, "Requests") == str(total)
        assert figure((await http.get("/console/usage")).text, "Requests") == str(total)
        assert figure((await http.get("/console/fleet")).text, "Answered since start") == str(total)

        # a team admin of red: its team only, read-only; blue's page, by URL, is refused
        http.cookies.clear()
        csrf = await signed_in(http, token("team_admin", "red"))
        listing = await http.get("/console/teams")
        assert listing.status_code == 200 and 'data-team="red"' in listing.text
        assert "blue" not in listing.text.split('<main id="main"')[1]
        assert figure(listing.text, "Teams") == "1"
        assert 'action="/console/teams"' not in listing.text  # no create form
        page = await http.get("/console/teams/red")
        assert page.status_code == 200 and 'action="/console/teams/red"' not in page.text
        for other in ("blue", "nosuchteam"):
            r = await http.get(f"/console/teams/{other}")
            assert r.status_code == 403, (other, r.status_code)
            assert keys["blue"][0] not in r.text and "the blue team" not in r.text
        for path, data in (("teams/red", {"requests_per_minute": "1000"}), ("teams/blue", {}),
                           ("teams", {"name": "green"})):
            r = await http.post(f"/console/{path}", data={"csrf": csrf, **data}, headers={"hx-request": "true"})
            assert r.status_code == 403, (path, r.status_code)
        assert (await http.get("/admin/teams/red", headers=bearer())).json()["limits"]["requests_per_minute"] == 400
        assert (await http.get("/admin/teams/green", headers=bearer())).status_code == 404

        # its own-or-rent view: its team's calls only
        report = await http.get("/console/report")
        assert report.status_code == 200, report.text
        summary_first(report.text, "a team admin's report")
        assert figure(report.text, "Requests of team red") == str(CALLS["red"])
        assert "Owned cost" not in report.text.split('id="summary"')[1].split("</section>")[0]
        assert keys["blue"][0] not in report.text and 'id="team-scope"' in report.text
        figures = (await http.get("/console/report.json")).json()
        assert set(figures["keys"]) == {keys["red"][0]} and set(figures["teams"]) <= {"red"}
        assert figures["keys"][keys["red"][0]]["requests"] == CALLS["red"]
        served = sum(m["owned"]["requests"] + m["rented"]["requests"] for m in figures["models"].values())
        assert served == CALLS["red"]
        nav = re.findall(r'<li><a href="/console/([a-z]+)"', report.text)
        assert nav == ["keys", "teams", "usage", "report"]
