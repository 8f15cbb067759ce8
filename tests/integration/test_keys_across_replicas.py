"""Two gateway processes on one real redis-server: keys issued by the CLI, revoked and rotated everywhere.

Everything runs as separate processes, as in production: redis-server, a simulated backend, two
`llm-gateway serve` replicas, and the `llm-gateway` CLI. The clients are the openai SDK and plain httpx.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.support.cluster import cluster
CACHE_SECONDS = 1.0
HELLO = [{"role": "user", "content": "hi"}]


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
def pair(tmp_path):
    with cluster(tmp_path, replicas=2, auth={"cache_seconds": CACHE_SECONDS}) as c:
        yield c


def test_cli_keys_work_on_every_replica_and_revocation_reaches_all(pair):
    (one, two), cli = pair.urls, pair.cli
    created = cli("keys", "--url", one, "--json", "create", "--name", "svc", "--models", "m")
    assert created.returncode == 0, created.stderr
    key, key_id = json.loads(created.stdout)["key"], json.loads(created.stdout)["record"]["id"]
    assert works(one, key) and works(two, key)  # issued on one replica, valid on the other at once

    listing = cli("keys", "--url", two, "list")
    assert listing.returncode == 0 and "svc" in listing.stdout and key_id in listing.stdout
    assert key not in listing.stdout and key.split("-")[2] not in listing.stdout
    shown = cli("keys", "--url", two, "--json", "show", key_id)
    assert json.loads(shown.stdout)["models"] == ["m"]
    assert json.loads(shown.stdout)["priority_class"] is None  # the policy's default class
    changed = cli("keys", "--url", two, "--json", "update", key_id, "--priority-class", "batch",
                  "--client-priority", "yes")
    assert changed.returncode == 0, changed.stderr
    assert (json.loads(changed.stdout)["priority_class"], json.loads(changed.stdout)["client_priority"]) == \
        ("batch", True)
    assert "batch" in cli("keys", "--url", one, "list").stdout

    revoked = cli("keys", "--url", one, "revoke", key_id)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    took = wait(lambda: not works(two, key), CACHE_SECONDS + 2)  # two had it cached; the bound holds
    assert not works(one, key)
    assert took <= CACHE_SECONDS + 1
    logs = pair.log_text()
    assert "request_id=" in logs and key not in logs and pair.admin_token not in logs


def test_rotation_grace_across_replicas(pair):
    (one, two), cli = pair.urls, pair.cli
    old = json.loads(cli("keys", "--url", one, "--json", "create", "--name", "rot").stdout)
    rotated = cli("keys", "--url", two, "--json", "rotate", old["record"]["id"], "--grace", "3s")
    new = json.loads(rotated.stdout)["key"]
    assert works(one, new) and works(two, new) and works(one, old["key"]) and works(two, old["key"])
    time.sleep(3.1)
    assert not works(one, old["key"]) and not works(two, old["key"])
    assert works(two, new)


def test_keys_survive_a_redis_restart_and_an_outage_is_a_clear_503(pair):
    (one, two), cli, redis = pair.urls, pair.cli, pair.redis
    key = json.loads(cli("keys", "--url", one, "--json", "create", "--name", "durable").stdout)["key"]
    unseen = json.loads(cli("keys", "--url", one, "--json", "create", "--name", "unseen").stdout)["key"]
    redis.restart()  # append-only file: the key comes back with the server
    time.sleep(CACHE_SECONDS)
    assert works(one, key) and works(two, key)

    redis.stop()
    time.sleep(CACHE_SECONDS)  # past the cache: the replicas must ask the store
    # a key this replica verified (within auth.stale_seconds) still works while the store is away ...
    assert works(two, key)
    # ... one it never saw cannot be checked: a clear 503 that says when to retry
    r = httpx.post(f"{two}/v1/chat/completions", json={"model": "m", "messages": HELLO},
                   headers={"authorization": f"Bearer {unseen}"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
    assert int(r.headers["retry-after"]) >= 1
    assert httpx.get(f"{one}/health").status_code == 200
    admin = cli("keys", "--url", one, "list")
    assert admin.returncode == 1 and "503" in admin.stderr

    redis.start()
    wait(lambda: works(one, key) and works(two, key), 10)
    assert "Traceback" not in pair.log_text()
