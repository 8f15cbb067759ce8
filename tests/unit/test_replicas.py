import asyncio
import time
from dataclasses import replace

from backends.http1 import Client
from backends.replicas import (
    DOWN,
    PENDING,
    UNKNOWN,
    UP,
    AdaptiveLimit,
    HealthTimings,
    Replica,
    ReplicaSet,
    backoff,
    group_name,
    split_group,
)
from policies.compile import replicas_of
from policies.config import Model


def replica_set(threshold=1):
    replicas = [Replica(name=f"m-{i}", model="m", url=f"http://10.0.0.{i + 1}:8000", served_name="m")
                for i in range(2)]
    health = HealthTimings(failure_threshold=threshold, backoff_initial=1, backoff_max=8)
    changes = []
    return ReplicaSet({"m": replicas}, health, on_change=changes.append), changes


def test_backoff_doubles_up_to_the_cap():
    h = HealthTimings(backoff_initial=1, backoff_max=8)
    assert [backoff(h, n) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]


def test_a_replica_down_for_days_keeps_its_backoff_at_the_cap():
    # ~1,025 failures (a replica down ~17 h at a 60 s backoff) made 2.0 ** n overflow and ended the health loop
    h = HealthTimings(backoff_initial=1, backoff_max=60)
    assert [backoff(h, n) for n in (1_024, 1_025, 10**6)] == [60, 60, 60]


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


async def test_a_probe_answered_after_a_request_failed_does_not_bring_the_replica_back():
    """A probe sent before a request failed, answered 200 after: stale. The replica stays down until its backoff
    ends and a later probe passes, or one health interval after every request failure it would be routed again."""
    rs, _ = replica_set()
    r = rs.by_model["m"][0]
    rs.succeeded(r)

    class Client:
        def __init__(self) -> None:
            self.asked, self.answer = asyncio.Event(), asyncio.Event()

        async def get(self, url, timeout):
            self.asked.set()
            await self.answer.wait()
            return 200, b""

    client = Client()
    probe = asyncio.create_task(rs.check(client, r, timeout=1))
    await client.asked.wait()
    rs.failed(r, "HTTP 503")  # a request fails while the probe is out
    client.answer.set()
    assert await probe  # the backend did answer 200...
    assert r.state == DOWN and not r.routable  # ...to a probe older than the failure
    later = Client()
    later.answer.set()
    assert await rs.check(later, r, timeout=1) and r.state == UP  # a probe sent after the failure counts


def spec(name, url, cap=None, source="kubernetes"):
    return Replica(name=name, model="m", url=url, served_name="m", cap=cap, source=source)


def test_apply_adds_pending_replicas_keeps_the_others_and_drains_the_removed():
    rs, changes = replica_set()
    held = rs.by_model["m"]  # the admission queue holds this very list
    kept, gone = held
    kept.state, kept.in_flight = UP, 2
    gone.in_flight = 1
    rs.apply("m", [spec("m-0", kept.url, cap=4), spec("m-9", "http://10.0.0.9:8000")])
    assert rs.by_model["m"] is held and [r.name for r in held] == ["m-0", "m-9"]
    assert held[0] is kept and kept.state == UP and kept.in_flight == 2 and kept.cap == 4 and kept.limit == 4
    new = held[1]
    assert new.state == PENDING and not new.routable  # no traffic before its first probe passes
    assert gone.draining and not gone.routable and rs.draining == [gone]
    assert gone in changes and new in changes
    drained = []
    rs.on_drained = drained.append
    rs.finish_drains()
    assert drained == [] and rs.draining == [gone]  # its request is still in flight
    gone.in_flight = 0
    rs.finish_drains()
    assert drained == [gone] and rs.draining == []
    rs.succeeded(new)
    assert new.state == UP and new.routable


def test_apply_with_a_new_url_under_the_same_name_replaces_the_replica():
    rs, _ = replica_set()
    old = rs.by_model["m"][0]
    rs.apply("m", [spec("m-0", "http://10.0.0.7:8000"), spec("m-1", rs.by_model["m"][1].url)])
    new = {r.name: r for r in rs.by_model["m"]}["m-0"]
    assert old.draining and new is not old and new.state == PENDING and new.url == "http://10.0.0.7:8000"


def test_adaptive_limit_keeps_what_it_learned_within_the_new_cap():
    rs, _ = replica_set()
    r = rs.by_model["m"][0]
    r.cap, r.adaptive, r.limit = 10, AdaptiveLimit(floor=2, target_ttft=1), 7.5
    rs.apply("m", [replace(r, cap=5), rs.by_model["m"][1]])
    assert r.limit == 5
    rs.apply("m", [replace(r, cap=20), rs.by_model["m"][1]])
    assert r.limit == 5  # learned, not reset to the cap


def test_each_replica_owns_its_upstream_once_the_set_is_connected_and_so_does_each_that_joins():
    rs, _ = replica_set()
    first = rs.by_model["m"][0]
    assert first.upstream is None  # not serving yet
    client = Client(2.0, 2.0)
    rs.connect(client)
    assert all(r.upstream is not None and r.upstream.client is client for r in rs)
    assert first.upstream.origin.host_header == "10.0.0.1:8000"
    kept = first.upstream
    copy = replace(first, name="m-9", url="http://10.0.0.9:8000")  # a new replica made from another's settings
    rs.apply("m", [*rs.by_model["m"], copy])
    assert first.upstream is kept  # a replica that stays keeps its connection
    assert copy.upstream is not kept and copy.upstream.origin.host_header == "10.0.0.9:8000"


def test_backends_get_plain_settings_and_the_variant_naming_rule_is_one():
    model = Model.model_validate({"name": "chat", "variants": [
        {"name": "fp8", "weight": 100, "backends": [{"url": "http://10.0.0.1:8000", "cap": 8,
                                                      "adaptive": {"floor": 2, "target_ttft": 0.5}}]}]})
    (replica,) = replicas_of(model)
    assert replica.adaptive == AdaptiveLimit(floor=2, target_ttft=0.5)
    assert replica.group == group_name("chat", "fp8") == "chat#fp8" and split_group(replica.group) == ("chat", "fp8")
    assert group_name("chat", None) == "chat" and split_group("chat") == ("chat", None)


def test_variants_at_one_url_count_each_others_requests_as_their_servers_load():
    """Two variants (or adapter groups) served by one vLLM are two replica sets at one URL: a call's load level
    (call.load, the variant guard's comparable load) is every request in flight to that server."""
    url, other = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    base = Replica(name="m#a-0", model="m", url=url, served_name="m", variant="a")
    same = Replica(name="m#b-0", model="m", url=url, served_name="m", variant="b")
    alone = Replica(name="m#b-1", model="m", url=other, served_name="m", variant="b")
    rs = ReplicaSet({"m#a": [base], "m#b": [same, alone]}, HealthTimings())
    base.in_flight, same.in_flight, alone.in_flight = 13, 3, 5
    assert base.peers == (same,) and same.peers == (base,) and alone.peers == ()
    assert same.server_in_flight == base.server_in_flight == 16 and alone.server_in_flight == 5
    rs.apply("m#b", [spec("m#b-1", other)])  # variant b leaves the shared server: its load is its own again
    assert base.peers == () and base.server_in_flight == 13
    rs.apply("m#b", [spec("m#b-1", other), spec("m#b-2", url)])
    joined = {r.name: r for r in rs.by_model["m#b"]}["m#b-2"]
    assert base.peers == (joined,) and joined.peers == (base,)
    rs.remove_model("m#a")
    assert joined.peers == ()


def test_remove_model_drains_all_its_replicas():
    rs, _ = replica_set()
    replicas = list(rs.by_model["m"])
    rs.remove_model("m")
    assert "m" not in rs.by_model and all(r.draining for r in replicas) and rs.ready() == {}


async def test_pending_replica_is_probed_between_rounds_and_drained_connections_close():
    closed = asyncio.Event()

    async def serve(reader, writer):
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            if await reader.read(0) == b"" and reader.at_eof():
                break
        closed.set()

    async def serve_until_eof(reader, writer):
        try:
            await serve(reader, writer)
        except asyncio.IncompleteReadError:
            closed.set()

    server = await asyncio.start_server(serve_until_eof, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Client(2.0, 2.0)
    rs = ReplicaSet({"m": []}, HealthTimings(interval=60))
    rs.apply("m", [spec("m-a", f"http://127.0.0.1:{port}")])
    loop = asyncio.create_task(rs.run_checks(client, timeout=2.0))
    try:
        async with asyncio.timeout(10):
            while rs.by_model["m"][0].state != UP:
                await asyncio.sleep(0.05)
        assert client.idle  # the probe's connection is pooled
        drained = asyncio.Event()
        rs.on_drained = lambda replica: drained.set()
        rs.apply("m", [])
        async with asyncio.timeout(10):
            await drained.wait()
            await closed.wait()  # the server saw its pooled connection close
        assert not client.idle
    finally:
        loop.cancel()
        server.close()
