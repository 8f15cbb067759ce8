"""Two gateway processes on one real redis-server: keys issued by the CLI, revoked and rotated everywhere.

Everything runs as separate processes, as in production: redis-server, a simulated backend, two
`llm-gateway serve` replicas, and the `llm-gateway` CLI. The clients are the openai SDK and plain httpx.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.support.probes import wait_http_ok
from tests.support.redis_server import RedisServer
from tests.support.servers import free_port

CLI = str(Path(sys.executable).with_name("llm-gateway"))
CACHE_SECONDS = 1.0
HELLO = [{"role": "user", "content": "hi"}]


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=30)


def works(url: str, key: str) -> bool:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)
    try:
        return bool(client.chat.completions.create(model="m", messages=HELLO, max_tokens=2).choices)
    except openai.AuthenticationError:
        return False


def wait(predicate, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s")


@pytest.fixture
def cluster(tmp_path):
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secrets.token_urlsafe(32), "PYTHONUNBUFFERED": "1"}
    with RedisServer() as redis:
        sim_port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "backends.simulator", "--port", str(sim_port),
                                       "--model", "m", "--log-level", "warning"]))
        policy = {
            "store": {"kind": "redis", "url": redis.url},
            "auth": {"cache_seconds": CACHE_SECONDS},
            "health": {"interval": 0.5},
            "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{sim_port}"}]}],
        }
        config = tmp_path / "policy.yaml"
        config.write_text(yaml.safe_dump(policy))
        urls = []
        try:
            for i in range(2):
                port = free_port()
                log = open(tmp_path / f"gateway-{i}.log", "wb")
                procs.append(subprocess.Popen([CLI, "serve", "--config", str(config), "--port", str(port)],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
                urls.append(f"http://127.0.0.1:{port}")
            for url, proc in zip(urls, procs[1:]):
                wait_http_ok(f"{url}/ready", proc, 30, "a gateway replica")
            token = cli("admin-token", "--config", str(config), "--ttl", "10m", env=env).stdout.strip()
            yield urls, redis, {**env, "LLM_GATEWAY_ADMIN_TOKEN": token}, tmp_path
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def test_cli_keys_work_on_every_replica_and_revocation_reaches_all(cluster):
    (one, two), redis, env, _ = cluster
    created = cli("keys", "--url", one, "--json", "create", "--name", "svc", "--models", "m", env=env)
    assert created.returncode == 0, created.stderr
    key, key_id = json.loads(created.stdout)["key"], json.loads(created.stdout)["record"]["id"]
    assert works(one, key) and works(two, key)  # issued on one replica, valid on the other at once

    listing = cli("keys", "--url", two, "list", env=env)
    assert listing.returncode == 0 and "svc" in listing.stdout and key_id in listing.stdout
    assert key not in listing.stdout and key.split("-")[2] not in listing.stdout
    shown = cli("keys", "--url", two, "--json", "show", key_id, env=env)
    assert json.loads(shown.stdout)["models"] == ["m"]

    revoked = cli("keys", "--url", one, "revoke", key_id, env=env)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    took = wait(lambda: not works(two, key), CACHE_SECONDS + 2)  # two had it cached; the bound holds
    assert not works(one, key)
    assert took <= CACHE_SECONDS + 1
    for log in cluster[3].glob("gateway-*.log"):
        text = log.read_text()
        assert "request_id=" in text and key not in text and env["LLM_GATEWAY_ADMIN_TOKEN"] not in text


def test_rotation_grace_across_replicas(cluster):
    (one, two), redis, env, _ = cluster
    old = json.loads(cli("keys", "--url", one, "--json", "create", "--name", "rot", env=env).stdout)
    rotated = cli("keys", "--url", two, "--json", "rotate", old["record"]["id"], "--grace", "3s", env=env)
    new = json.loads(rotated.stdout)["key"]
    assert works(one, new) and works(two, new) and works(one, old["key"]) and works(two, old["key"])
    time.sleep(3.1)
    assert not works(one, old["key"]) and not works(two, old["key"])
    assert works(two, new)


def test_keys_survive_a_redis_restart_and_an_outage_is_a_clear_503(cluster):
    (one, two), redis, env, tmp_path = cluster
    key = json.loads(cli("keys", "--url", one, "--json", "create", "--name", "durable", env=env).stdout)["key"]
    redis.restart()  # append-only file: the key comes back with the server
    time.sleep(CACHE_SECONDS)
    assert works(one, key) and works(two, key)

    redis.stop()
    time.sleep(CACHE_SECONDS)  # past the cache: the replicas must ask the store
    r = httpx.post(f"{two}/v1/chat/completions", json={"model": "m", "messages": HELLO},
                   headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
    assert httpx.get(f"{one}/health").status_code == 200
    admin = cli("keys", "--url", one, "list", env=env)
    assert admin.returncode == 1 and "503" in admin.stderr

    redis.start()
    wait(lambda: works(one, key) and works(two, key), 10)
    for log in tmp_path.glob("gateway-*.log"):
        assert "Traceback" not in log.read_text()
