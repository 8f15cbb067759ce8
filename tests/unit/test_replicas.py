import time

from backends.replicas import (
    DOWN,
    UNKNOWN,
    UP,
    HealthTimings,
    Replica,
    ReplicaSet,
    backoff,
)


def replica_set(threshold=1):
    replicas = [Replica(name=f"m-{i}", model="m", url=f"http://10.0.0.{i + 1}:8000", served_name="m")
                for i in range(2)]
    health = HealthTimings(failure_threshold=threshold, backoff_initial=1, backoff_max=8)
    changes = []
    return ReplicaSet({"m": replicas}, health, on_change=changes.append), changes


def test_backoff_doubles_up_to_the_cap():
    h = HealthTimings(backoff_initial=1, backoff_max=8)
    assert [backoff(h, n) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]


def test_failure_threshold_and_recovery():
    rs, changes = replica_set(threshold=2)
    r = rs.by_model["m"][0]
    assert r.state == UNKNOWN and r.routable
    rs.failed(r, "boom")
    assert r.state == UNKNOWN and not changes  # one failure is below the threshold
    rs.failed(r, "boom")
    assert r.state == DOWN and not r.routable and changes == [r]
    assert 0.5 < r.probe_at - time.monotonic() <= 2.0  # second failure: 2 s backoff
    rs.succeeded(r)
    assert r.state == UP and r.failures == 0
    assert rs.ready() == {"m": True}


def test_ready_needs_one_checked_replica_per_model():
    rs, _ = replica_set()
    assert rs.ready() == {"m": False}
    rs.failed(rs.by_model["m"][0], "x")
    assert rs.ready() == {"m": False}
    rs.succeeded(rs.by_model["m"][1])
    assert rs.ready() == {"m": True}


async def test_health_check_gets_the_replicas_health_path():
    """KServe's Hugging Face runtime has no /health; its backends name the path that says the model is ready."""
    from policies.compile import replicas_of
    from policies.config import parse_policy

    policy = parse_policy("models: [{name: m, backends: [{url: 'http://10.0.0.1'}, "
                          "{url: 'http://10.0.0.2', health_path: /v1/models/m}]}]")
    plain, kserve = replicas_of(policy.models[0])
    assert plain.health_path == "/health"

    class Client:
        asked: list[str] = []

        async def get(self, url, timeout):
            self.asked.append(url)
            return 200, b""

    rs = ReplicaSet({"m": [plain, kserve]}, HealthTimings())
    client = Client()
    assert await rs.check(client, kserve, timeout=1) and await rs.check(client, plain, timeout=1)
    assert client.asked == ["http://10.0.0.2/v1/models/m", "http://10.0.0.1/health"]
