"""The console's fleet page names an ejected replica's rule and until when, as /admin/replicas does: a simulated
replica made to answer 5xx again and again (tests/support/faulty.py) is ejected by `consecutive_failures`, and
both the page and its live fragment say so beside that replica, and only that one."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.console.test_console_http import signed_in as sign_in_form
from tests.support.faulty import Faulty
from tests.support.gateway import TEST_KEY, one_model, running_gateway
from tests.support.servers import serve_app

SECRET = "f" * 40


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(Admin().jwt_secret_env, SECRET)


async def signed_in(http: httpx.AsyncClient, token: str) -> None:
    r = await sign_in_form(http, token)
    assert r.status_code == 303
    cookie = next(c for c in r.headers.get_list("set-cookie") if c.startswith("console_session="))
    http.cookies.set("console_session", cookie.split(";")[0].split("=", 1)[1])


def replica_row(html: str, name: str) -> str:
    found = re.search(rf'<tr data-replica="{re.escape(name)}">(.*?)</tr>', html, re.S)
    assert found is not None, f"no row for replica {name}"
    return found.group(1)


async def test_the_fleet_page_names_the_rule_and_the_end_of_an_ejection():
    sims = [Faulty() for _ in range(3)]
    async with serve_app(sims[0]) as u0, serve_app(sims[1]) as u1, serve_app(sims[2]) as u2:
        policy = {**one_model(u0, u1, u2), "console": {"enabled": True}}
        policy["health"] = {"interval": 60, "failure_threshold": 100}  # only ejection may take a replica out
        policy["models"][0]["routing"] = "least-in-flight"
        policy["models"][0]["ejection"] = {"consecutive_failures": 3, "base_seconds": 60}
        policy["models"][0]["retries"] = {"budget": 1.0}  # every retry may go: the ejection is what is shown
        viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer', secret=SECRET)}"}
        async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            await signed_in(http, mint_token(Admin(), 600, role="viewer", secret=SECRET))
            before = await http.get("/console/fleet/live")
            assert before.status_code == 200 and "ejected" not in replica_row(before.text, "m-0")
            client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)
            sims[0].mode = "5xx"
            for i in range(60):  # bounded: until the failing replica had its third 5xx in a row
                await client.chat.completions.create(model="m", max_tokens=2,
                                                     messages=[{"role": "user", "content": f"q{i}"}])
                if sims[0].requests >= 3:
                    break
            admin = {r["name"]: r for r in (await http.get("/admin/replicas", headers=viewer)).json()["m"]}
            assert admin["m-0"]["ejected_by"] == "consecutive_failures"
            until = admin["m-0"]["ejected_until"]
            assert time.time() < until
            shown = time.strftime("%H:%M:%S", time.gmtime(until))
            for path in ("/console/fleet", "/console/fleet/live"):
                page = await http.get(path)
                assert page.status_code == 200
                row = replica_row(page.text, "m-0")
                assert "ejected (consecutive_failures)" in row and f"until {shown} UTC" in row, path
                assert f'data-ejected-until="{until}"' in row, path
                for other in ("m-1", "m-2"):
                    assert "ejected" not in replica_row(page.text, other), (path, other)
