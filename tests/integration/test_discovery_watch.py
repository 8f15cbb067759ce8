"""Discovery watches when the network or the API server fails them: the real kubernetes client against kmock
behind a TCP proxy on loopback (tests/support/tcp_proxy.py), with short configured bounds so the tests take
seconds. A connection frozen without a close is noticed within the read timeout and the change made meanwhile
is applied; an API-server outage shows in /metrics and /admin/replicas, with one log line when the watch
breaks and one when it recovers (and no urllib3 retry warnings), while the last known replicas keep serving.
"""

import asyncio
import json
import contextlib
import logging
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import kmock
from kubernetes import client, config

from gateway.admin.auth import mint_token
from gateway.app import create_app
from policies.config import Admin, Policy
from tests.integration.test_discovery_kmock import NS, call, endpoint_slice, endpoints, kubeconfig, replica_names
from tests.integration.test_policy_reload import until
from tests.support.gateway import default_key_record
from tests.support.probes import metric_sum
from tests.support.servers import free_port, serve_app
from tests.support.tcp_proxy import tcp_proxy

READ_TIMEOUT = 2.0
WATCH = {"read_timeout": READ_TIMEOUT, "connect_timeout": 1.0, "relist_seconds": 120, "backoff_initial": 0.2,
         "backoff_max": 1.0}
# read timeout + one backoff step + one list, with room for a loaded 2-core machine
PORT = free_port()
BOUND = READ_TIMEOUT + WATCH["backoff_max"] + 4.0
A, B = "127.0.0.2", "127.0.0.3"  # nothing listens there: replicas are probed in the background, routing is not tested


@contextlib.asynccontextmanager
async def gateway_behind_proxy(monkeypatch, **watch):
    """kmock, a proxy in front of it, and a gateway discovering `m` from service `vllm` through the proxy."""
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", "s" * 40)
    viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer')}"}
    with tempfile.TemporaryDirectory(prefix="llmgw-watch-") as tmp:
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            target = urlsplit(str(server.url))
            direct = config.new_client_from_config(config_file=kubeconfig(Path(tmp) / "direct", str(server.url)))
            slices = client.DiscoveryV1Api(direct)
            await call(slices.create_namespaced_endpoint_slice, NS, endpoint_slice("vllm-abc", "vllm", [A], PORT))
            async with tcp_proxy(target.hostname, target.port, free_port()) as proxy:
                policy = Policy.model_validate({
                    "store": {"kind": "sqlite", "path": f"{tmp}/keys.db"},
                    "kubernetes": {"kubeconfig": kubeconfig(Path(tmp) / "kubeconfig", proxy.url),
                                   **WATCH, **watch},
                    "models": [{"name": "m", "discovery": {"kind": "kubernetes", "namespace": NS, "service": "vllm",
                                                           "port": "http"}}],
                })
                app = create_app(policy)
                await app.state.store.create_key(default_key_record())
                async with serve_app(app) as url, httpx.AsyncClient(headers=viewer, timeout=30) as http:
                    gw = app.state
                    await until(lambda: replica_names(gw, "m") == [f"m@{A}:{PORT}"], 30)
                    await until(lambda: watches_ok(gw), 30)  # the list is applied before its thread says synced
                    yield gw, url, http, proxy, slices


def watches_ok(gw) -> bool:
    """Every discovery watch has synced: its thread hands a list to the event loop, then marks itself synced."""
    return all(watcher.state == "ok" for _, _, watcher in gw.discovery.watches())


async def test_a_full_list_runs_every_relist_seconds_even_on_a_live_quiet_watch(monkeypatch):
    """The backstop for an event lost in transit: kmock never ends a watch and the read timeout is long, yet
    the watch is listed again every relist_seconds, without counting as a failure."""
    async with gateway_behind_proxy(monkeypatch, relist_seconds=1, read_timeout=30) as (gw, url, http, proxy, _):
        lists = lambda: sum(1 for r in proxy.requests if "endpointslices" in r and "watch=true" not in r)  # noqa: E731
        first = lists()
        await until(lambda: lists() >= first + 3, 15)
        [(_, _, watcher)] = gw.discovery.watches()
        assert watcher.state == "ok" and watcher.failures == 0


def watch_states(replicas: dict) -> list[str]:
    return [w["state"] for w in replicas["_watches"]]


async def test_a_watch_frozen_without_a_close_is_noticed_and_the_change_applied_within_its_bound(monkeypatch):
    async with gateway_behind_proxy(monkeypatch) as (gw, url, http, proxy, slices):
        await until(lambda: proxy.open_watches() >= 1, 10)  # the watch is streaming through the proxy
        assert proxy.freeze() >= 1
        frozen, requests = time.monotonic(), len(proxy.requests)
        await call(slices.patch_namespaced_endpoint_slice, "vllm-abc", NS, {"endpoints": endpoints([A, B])})
        while replica_names(gw, "m") != [f"m@{A}:{PORT}", f"m@{B}:{PORT}"]:
            assert time.monotonic() - frozen < BOUND, f"the change was not applied within {BOUND} s of the freeze"
            await asyncio.sleep(0.05)
        # it came through a new connection: the frozen stream was given up (on a random phase of its read
        # timeout: kmock's watches are quiet, so each one also times out every READ_TIMEOUT s)
        assert any("endpointslices" in r and "watch=true" not in r for r in proxy.requests[requests:])
        # and the watch goes on: a later change comes through the new connection at once
        await call(slices.patch_namespaced_endpoint_slice, "vllm-abc", NS, {"endpoints": endpoints([B])})
        await until(lambda: replica_names(gw, "m") == [f"m@{B}:{PORT}"], READ_TIMEOUT)
        watches = (await http.get(f"{url}/admin/replicas")).json()["_watches"]
        assert [(w["model"], w["source"], w["watch"], w["state"]) for w in watches] == \
            [("m", "kubernetes", f"endpointslices of {NS}/vllm", "ok")]


async def test_an_api_server_outage_shows_in_metrics_and_admin_and_recovers_with_one_line_each_way(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, "urllib3")
    caplog.set_level(logging.INFO, "gateway.discovery")
    labels = {"model": "m", "source": "kubernetes", "watch": f"endpointslices of {NS}/vllm"}

    async def up() -> float:
        return metric_sum((await http.get(f"{url}/metrics")).text, "llm_gateway_discovery_watch_up", **labels)

    async with gateway_behind_proxy(monkeypatch) as (gw, url, http, proxy, slices):
        assert await up() == 1
        assert watch_states((await http.get(f"{url}/admin/replicas")).json()) == ["ok"]
        synced = metric_sum((await http.get(f"{url}/metrics")).text,
                            "llm_gateway_discovery_watch_last_sync_timestamp_seconds", **labels)
        assert time.time() - 60 < synced <= time.time()
        caplog.clear()

        await proxy.down()  # the API server is gone: connections refused
        deadline = time.monotonic() + 30
        while await up() != 0:
            assert time.monotonic() < deadline, "the outage never showed in llm_gateway_discovery_watch_up"
            await asyncio.sleep(0.1)
        view = (await http.get(f"{url}/admin/replicas")).json()
        [watch] = view["_watches"]
        assert watch["state"] == "broken" and watch["broken_since"] and watch["error"]
        assert replica_names(gw, "m") == [f"m@{A}:{PORT}"]  # the last known endpoints keep serving
        await call(slices.patch_namespaced_endpoint_slice, "vllm-abc", NS, {"endpoints": endpoints([A, B])})
        failures = lambda text: metric_sum(text, "llm_gateway_discovery_watch_failures_total", **labels)  # noqa: E731
        first = failures((await http.get(f"{url}/metrics")).text)
        await asyncio.sleep(3)  # several retries, backed off (0.2 s doubling to at most 1 s)
        retried = failures((await http.get(f"{url}/metrics")).text)
        assert 2 <= retried - first <= 12, (first, retried)  # retrying, but not hammering the API server

        await proxy.up()
        await until(lambda: replica_names(gw, "m") == [f"m@{A}:{PORT}", f"m@{B}:{PORT}"], 10)
        await until(lambda: watches_ok(gw), 10)  # marked synced by its thread just after the list is applied
        assert await up() == 1
        assert watch_states((await http.get(f"{url}/admin/replicas")).json()) == ["ok"]

    lines = [r for r in caplog.records if r.name == "gateway.discovery" and "watch of" in r.getMessage()]
    assert [(r.levelname, r.getMessage().split(":")[0].split(" after")[0]) for r in lines] == [
        ("WARNING", f"watch of endpointslices of {NS}/vllm broke"),
        ("INFO", f"watch of endpointslices of {NS}/vllm recovered"),
    ], [r.getMessage() for r in lines]
    noisy = [r.getMessage() for r in caplog.records if r.name.startswith("urllib3") and r.levelno >= logging.WARNING]
    assert noisy == []


@contextlib.asynccontextmanager
async def api_server_that_goes_silent_after_a_bookmark():
    """A purpose-built API server: lists answer an empty EndpointSliceList; a watch gets one BOOKMARK, then
    nothing ever again, its connection left open (what a frozen flow looks like from the client). Yields its
    URL and the list of request paths it served."""
    served: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                served.append(path)
                if "watch=true" in path:
                    line = json.dumps({"type": "BOOKMARK", "object": {
                        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                        "metadata": {"resourceVersion": "7"}}}).encode() + b"\n"
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(line), line))
                    await writer.drain()
                    await asyncio.sleep(3600)
                body = json.dumps({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                   "metadata": {"resourceVersion": "5"}, "items": []}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", served
    finally:
        server.close()


async def test_silence_after_a_bookmark_is_a_hang_and_says_so(caplog, tmp_path):
    """A server that sends bookmarks and then goes silent past the read timeout is presumed dead: a warning
    (the watch broke), a relist, and a recovery line once the list answers."""
    from backends.sources.kubernetes import KubernetesSource, api_client
    from backends.sources.watch import WatchTimings

    caplog.set_level(logging.INFO, "gateway.discovery")
    async with api_server_that_goes_silent_after_a_bookmark() as (server, served):
        api = api_client(kubeconfig(tmp_path / "kubeconfig", server))
        source = KubernetesSource(api, NS, "vllm", None, WatchTimings(read_timeout=1, backoff_initial=0.1,
                                                                     backoff_max=0.3))
        emitted = []
        source.start(emitted.append)
        [watcher] = source.watchers()
        try:
            # the thread logs "recovered" after the relist, then opens the next watch: wait for both
            await until(lambda: any("recovered" in r.getMessage() for r in caplog.records)
                        and sum("watch=true" in p for p in served) >= 2, 15)
        finally:
            source.stop()
    assert emitted and emitted[0] == []
    assert watcher.failures >= 1 and sum("watch=true" in p for p in served) >= 2
    assert "allowWatchBookmarks=true" in next(p for p in served if "watch=true" in p)
    messages = [r.getMessage() for r in caplog.records if "watch of" in r.getMessage()]
    assert "no event or bookmark for 1 s on an open watch" in messages[0] and "broke" in messages[0]
    assert "recovered" in messages[1]
