"""Every admin act lands in the audit log with its author, time, address and changes, never a secret: read
through GET /admin/audit (filters, pages), the `llm-gateway audit` CLI and the structured log line; on Redis,
an act on one gateway replica is read on another."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from gateway.admin.auth import mint_token
from gateway.app import create_app
from gateway.reload import OK, PolicyReloader
from policies.config import Admin, load_policy
from tests.support.cluster import cluster
from tests.support.servers import serve_app

SECRET = "a" * 40
CLI = str(Path(sys.executable).with_name("llm-gateway"))


def policy(tmp: Path, weight_b: int = 50) -> dict:
    return {"store": {"kind": "sqlite", "path": str(tmp / "gateway.db")},
            "network": {"trusted_proxies": ["127.0.0.1/32"]},
            "models": [{"name": "m", "variants": [
                {"name": "a", "weight": 50, "backends": [{"url": "http://127.0.0.1:9"}]},
                {"name": "b", "weight": weight_b, "backends": [{"url": "http://127.0.0.1:10"}]}]}]}


async def test_every_admin_act_is_recorded_with_its_author(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    caplog.set_level(logging.INFO, "llm_gateway.audit")
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy(tmp_path)))
    app = create_app(load_policy(path), policy_path=str(path))
    alice = mint_token(Admin(), 600, subject="alice")
    viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer', subject='vic')}"}
    headers = {"authorization": f"Bearer {alice}"}
    async with serve_app(app) as url, httpx.AsyncClient(timeout=30, headers=headers) as http:
        r = await http.post(f"{url}/admin/keys", json={"name": "one"}, headers={"x-forwarded-for": "203.0.113.9"})
        key, key_id = r.json()["key"], r.json()["record"]["id"]
        assert (await http.patch(f"{url}/admin/keys/{key_id}", json={"name": "two"})).status_code == 200
        rotated = (await http.post(f"{url}/admin/keys/{key_id}/rotate", json={"grace_seconds": 60})).json()["key"]
        assert (await http.post(f"{url}/admin/keys/{key_id}/revoke")).status_code == 200
        r = await http.put(f"{url}/admin/models/m/variants", json={"weights": [{"name": "b", "weight": 10}]})
        assert r.status_code == 200, r.text
        assert (await http.get(f"{url}/admin/keys", headers=viewer)).status_code == 200  # a read is no act
        path.write_text(yaml.safe_dump(policy(tmp_path, weight_b=20)))
        assert await PolicyReloader(app.state, str(path)).reload("test") == OK

        page = (await http.get(f"{url}/admin/audit", headers=viewer)).json()
        events = page["events"]
        assert [e["action"] for e in events] == ["policy.reload", "variants.weights", "key.revoke", "key.rotate",
                                                 "key.update", "key.create"]
        reload_, weights, revoke, rotate, update, create = events
        assert {(e["actor"], e["issuer"], e["role"]) for e in events[1:]} == {("alice", "llm-gateway", "admin")}
        assert reload_["actor"] == "gateway" and reload_["target"] == str(path)
        assert create["address"] == "203.0.113.9" and update["address"] == "127.0.0.1"
        assert create["target"] == key_id and create["changes"]["name"] == "one"
        assert update["changes"] == {"name": {"from": "one", "to": "two"}}
        assert rotate["changes"]["grace_seconds"] == 60 and "previous_valid_until" in rotate["changes"]
        assert revoke["changes"]["revoked"] == {"from": False, "to": True}
        assert weights["target"] == "m" and weights["changes"] == {"b": {"from": 50.0, "to": 10.0}}
        assert events == sorted(events, key=lambda e: e["at"], reverse=True)

        async def audit(**params) -> httpx.Response:
            return await http.get(f"{url}/admin/audit", params=params)

        assert [e["action"] for e in (await audit(target=key_id)).json()["events"]] == \
            ["key.revoke", "key.rotate", "key.update", "key.create"]
        assert len((await audit(actor="alice")).json()["events"]) == 5
        window = {"since": rotate["at"], "until": rotate["at"] + 1}
        assert (await audit(action="key.rotate", **window)).json()["events"] == [rotate]
        first = (await audit(limit=2)).json()
        second = (await audit(limit=2, before=first["next"])).json()
        assert [e["action"] for e in first["events"] + second["events"]] == [e["action"] for e in events[:4]]
        for bad in ({"limit": 501}, {"limit": 0}, {"before": "x' OR 1=1"}, {"since": "yesterday"}):
            r = await audit(**bad)
            assert r.status_code == 400 and r.json()["error"]["message"], bad

        cli = await asyncio.to_thread(subprocess.run, [CLI, "audit", "--url", url, "--token", alice, "--target",
                                                       key_id], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        lines = cli.stdout.splitlines()
        assert lines[0].split()[:3] == ["TIME", "ACTOR", "FROM"] and len(lines) == 5
        assert "key.create" in lines[4] and "alice (admin)" in lines[4] and "203.0.113.9" in lines[4]

    logged = [json.loads(r.getMessage())["audit"] for r in caplog.records if r.name == "llm_gateway.audit"
              and r.levelno == logging.INFO]
    assert [e["action"] for e in reversed(logged)] == [e["action"] for e in events]
    everything = json.dumps(page) + cli.stdout + "\n".join(r.getMessage() for r in caplog.records)
    for secret in (key, rotated, alice, SECRET, key.split("-")[-1], rotated.split("-")[-1]):
        assert secret not in everything


def test_acts_on_one_replica_are_read_on_another(tmp_path):
    with cluster(tmp_path, replicas=2) as c:
        (one, two), cli = c.urls, c.cli
        created = cli("keys", "--url", one, "--json", "create", "--name", "svc")
        assert created.returncode == 0, created.stderr
        key, key_id = json.loads(created.stdout)["key"], json.loads(created.stdout)["record"]["id"]
        assert cli("keys", "--url", one, "revoke", key_id).returncode == 0
        shown = cli("audit", "--url", two, "--json", "--target", key_id)
        assert shown.returncode == 0, shown.stderr
        events = json.loads(shown.stdout)["events"]
        assert [(e["action"], e["actor"], e["address"]) for e in events] == \
            [("key.revoke", "admin", "127.0.0.1"), ("key.create", "admin", "127.0.0.1")]
        logs = c.log_text()
        assert '"action":"key.create"' in logs and key_id in logs
        assert key not in logs and key.split("-")[-1] not in logs and c.admin_token not in logs


async def test_team_acts_and_a_team_admins_acts_are_recorded(tmp_path, monkeypatch):
    """A team created, changed and deleted is in the log with its admin; a key a team admin issues names the team
    admin (role team_admin, its team) as its author."""
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy(tmp_path)))
    app = create_app(load_policy(path), policy_path=str(path))
    admin = {"authorization": f"Bearer {mint_token(Admin(), 600, subject='alice')}"}
    lead = {"authorization": f"Bearer {mint_token(Admin(), 600, role='team_admin', subject='tia', team='red')}"}
    async with serve_app(app) as url, httpx.AsyncClient(timeout=30, headers=admin) as http:
        r = await http.post(f"{url}/admin/teams", json={"name": "red", "limits": {"requests_per_minute": 60}})
        assert r.status_code == 201, r.text
        r = await http.patch(f"{url}/admin/teams/red", json={"limits": {"requests_per_minute": 30}})
        assert r.status_code == 200, r.text
        r = await http.post(f"{url}/admin/keys", json={"name": "red-app"}, headers=lead)
        assert r.status_code == 201, r.text
        key_id = r.json()["record"]["id"]
        assert r.json()["record"]["team"] == "red"
        assert (await http.post(f"{url}/admin/keys/{key_id}/revoke", headers=lead)).status_code == 200
        assert (await http.delete(f"{url}/admin/teams/red")).status_code == 200

        events = (await http.get(f"{url}/admin/audit")).json()["events"]
        assert [(e["action"], e["target"], e["actor"]) for e in events] == [
            ("team.delete", "red", "alice"), ("key.revoke", key_id, "tia"), ("key.create", key_id, "tia"),
            ("team.update", "red", "alice"), ("team.create", "red", "alice")]
        by_action = {e["action"]: e for e in events}
        assert by_action["team.update"]["changes"]["limits"]["from"]["requests_per_minute"] == 60
        assert by_action["team.update"]["changes"]["limits"]["to"]["requests_per_minute"] == 30
        assert (by_action["key.create"]["role"], by_action["key.create"]["team"]) == ("team_admin", "red")
        assert by_action["key.create"]["changes"]["team"] == "red"
