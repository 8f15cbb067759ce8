"""The gateway's own acts in the audit log, read through GET /admin/audit: the variant guard's rollback (over
simulated vLLM servers, one of which breaks tool calls) and a policy reload refused (a broken file that quotes
secrets, none of which reaches the log's events)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import yaml

from gateway.admin.auth import mint_token
from gateway.app import create_app as gateway_app
from gateway.reload import INVALID, PolicyReloader
from policies.config import Admin, load_policy
from tests.integration.test_variants_gateway import TOOL_CALL, breaking_tool_calls
from tests.support.servers import serve_app

SECRET = "y" * 40


def viewer(monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    return {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer')}"}


async def events(http: httpx.AsyncClient, url: str, headers: dict, action: str, at_least: int = 1,
                 deadline_s: float = 30) -> list[dict]:
    """The audit events of `action`, newest first, once there are `at_least` (they are written in the background)."""
    deadline = time.monotonic() + deadline_s
    while True:
        r = await http.get(f"{url}/admin/audit", params={"action": action}, headers=headers)
        assert r.status_code == 200, r.text
        found = r.json()["events"]
        if len(found) >= at_least or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.05)


async def test_a_guard_rollback_is_recorded_as_the_gateways_own_act(monkeypatch):
    headers = viewer(monkeypatch)
    operator = {"authorization": f"Bearer {mint_token(Admin(), 600, role='operator', subject='ops')}"}
    async with breaking_tool_calls() as (gw, http):
        guard = gw.state.shared.variants.guard
        deadline = time.monotonic() + 120
        while guard.state("m", "b").state != "rolled_back":  # bounded: the guard looks within 60 of b's calls
            assert time.monotonic() < deadline, guard.state("m", "b")
            r = await http.post(f"{gw.url}/v1/chat/completions", json=TOOL_CALL)
            assert r.status_code == 200, r.text

        [rollback] = await events(http, gw.url, headers, "variants.weights")
        assert (rollback["actor"], rollback["role"], rollback["target"]) == ("gateway", "system", "m")
        assert rollback["changes"]["why"].startswith("guard: ")
        assert "structured-output validity" in rollback["changes"]["why"]
        assert rollback["changes"]["from"] == {"a": 80, "b": 20} and rollback["changes"]["to"] == {"a": 80, "b": 0}

        # an operator's change is recorded once, as the operator: no system event beside it
        r = await http.put(f"{gw.url}/admin/models/m/variants", json={"weights": [{"name": "b", "weight": 5}]},
                           headers=operator)
        assert r.status_code == 200, r.text
        await events(http, gw.url, headers, "variants.weights", at_least=2)
        await asyncio.sleep(0.5)  # time for a wrongly recorded system event to land too
        found = await events(http, gw.url, headers, "variants.weights", deadline_s=0)
        assert [(e["actor"], e["role"]) for e in found] == [("ops", "operator"), ("gateway", "system")]


async def test_a_refused_reload_is_recorded_without_what_the_file_quotes(tmp_path: Path, monkeypatch, caplog):
    headers = viewer(monkeypatch)
    path = tmp_path / "policy.yaml"
    good = {"store": {"kind": "sqlite", "path": str(tmp_path / "gateway.db")},
            "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9"}]}]}
    path.write_text(yaml.safe_dump(good))
    app = gateway_app(load_policy(path), policy_path=str(path))
    password, token = "Hunter2Passw0rd", "sk-Tok3nValue99"
    broken_values = {**good, "models": [{"name": "m", "backends": [{"url": f"ftp://u:{password}@10.0.0.1"}]}]}
    broken_yaml = f"models:\n- name: m\n  backends:\n  - url: http://127.0.0.1:9\n    api_key: {token}: x\n"
    async with serve_app(app) as url, httpx.AsyncClient(timeout=30) as http:
        reloader = PolicyReloader(app.state, str(path))
        path.write_text(yaml.safe_dump(broken_values))
        assert await reloader.reload("test") == INVALID
        path.write_text(broken_yaml)
        assert await reloader.reload("SIGHUP") == INVALID

        found = await events(http, url, headers, "policy.reload_refused", at_least=2)
        yaml_error, bad_value = found
        for event in found:
            assert (event["actor"], event["role"], event["target"]) == ("gateway", "system", str(path))
            assert event["changes"]["serving"] == app.state.snapshot.version
        assert bad_value["changes"]["why"] == "test" and yaml_error["changes"]["why"] == "SIGHUP"
        assert "models[0](name=m).backends[0].url: must be an http:// or https:// URL" in \
            bad_value["changes"]["reason"]
        assert "not valid YAML" in yaml_error["changes"]["reason"]
        assert "api_key: [redacted]" in yaml_error["changes"]["reason"]
        page = (await http.get(f"{url}/admin/audit", headers=headers)).text
        assert password not in page and token not in page and "Tok3n" not in page
        logged = "\n".join(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
        assert "keeps serving" in logged and password not in logged and "Tok3n" not in logged, logged
