"""Replicas found in a cluster: the real kubernetes and kserve clients against kmock (a Kubernetes API server
for tests, over HTTP on loopback) serving EndpointSlice and InferenceService objects, and simulator processes
behind the endpoints. Under steady streaming load the endpoints scale 1 -> 3 -> 1: the new ones get traffic
within 5 s, nothing fails, streams on removed ones finish. A public address is refused; an InferenceService
that stops being Ready gets no new request.
"""

import asyncio
import contextlib
import logging
import tempfile
import time
from pathlib import Path

import httpx
import kmock
import yaml
from kubernetes import client, config

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.admin.auth import mint_token
from gateway.app import create_app
from policies.config import Admin, Policy
from tests.integration.test_policy_reload import Load, sim_served, until
from tests.integration.test_replica_flaps import completions
from tests.support.asgi import InFlight
from tests.support.gateway import AUTH, default_key_record
from tests.support.servers import free_port, serve_app

SIM = SimConfig(model="served", step_base_ms=25)  # 8-token streams of ~0.2 s: still running when a replica is removed
NS = "llm"


def kubeconfig(path: Path, server: str) -> str:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "gateway", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "kmock", "user": "gateway"}}],
    }))
    return str(path)


def endpoint_slice(name: str, service: str, addresses: list[str], port: int) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints(addresses),
    }


def endpoints(addresses: list[str]) -> list[dict]:
    return [{"addresses": [a], "conditions": {"ready": True, "serving": True, "terminating": False}}
            for a in addresses]


def inference_service(name: str, ready: bool) -> dict:
    return {
        "apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"predictor": {"model": {"modelFormat": {"name": "huggingface"}, "runtime": "kserve-vllmserver"}}},
        "status": {"url": f"http://{name}-{NS}.example.com",
                   "address": {"url": f"http://{name}-predictor.{NS}.svc.cluster.local"},
                   "conditions": [{"type": "PredictorReady", "status": "True"},
                                  {"type": "Ready", "status": "True" if ready else "False"}]},
    }


@contextlib.asynccontextmanager
async def cluster():
    with tempfile.TemporaryDirectory(prefix="llmgw-k8s-") as tmp:
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            path = kubeconfig(Path(tmp) / "kubeconfig", str(server.url).rstrip("/"))
            yield path, config.new_client_from_config(config_file=path), tmp


async def call(fn, *args):
    return await asyncio.to_thread(fn, *args)


def replica_names(gw, model: str) -> list[str]:
    return sorted(r.name for r in gw.replicas.by_model.get(model, []))


async def test_endpoints_scale_up_and_down_under_load_and_a_public_address_is_refused(caplog):
    caplog.set_level(logging.INFO, "gateway.discovery")
    port = free_port()
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    async with cluster() as (kubeconfig_path, api, tmp), \
            serve_app(simulator(SIM), port=port, host=hosts[0]), \
            serve_app(simulator(SIM), port=port, host=hosts[1]) as s2, \
            serve_app(simulator(SIM), port=port, host=hosts[2]) as s3:
        slices = client.DiscoveryV1Api(api)
        await call(slices.create_namespaced_endpoint_slice, NS, endpoint_slice("vllm-abc", "vllm", hosts[:1], port))
        policy = Policy.model_validate({
            "store": {"kind": "sqlite", "path": f"{tmp}/keys.db"},
            "health": {"interval": 0.5, "backoff_initial": 0.2},
            "kubernetes": {"kubeconfig": kubeconfig_path},
            "models": [{"name": "m", "served_name": "served",
                        "discovery": {"kind": "kubernetes", "namespace": NS, "service": "vllm", "port": "http",
                                      "cap": 8}}],
        })
        app = create_app(policy)
        gw = app.state
        await gw.store.create_key(default_key_record())
        async with serve_app(app) as url, httpx.AsyncClient(headers=AUTH, timeout=30) as http:
            await until(lambda: gw.replicas.ready().get("m"), 30)
            assert replica_names(gw, "m") == [f"m@{hosts[0]}:{port}"]
            assert gw.replicas.by_model["m"][0].source == "kubernetes"
            async with Load(url, "m", workers=6).running() as load:
                await until(lambda: load.done >= 10, 30)

                await call(slices.patch_namespaced_endpoint_slice, "vllm-abc", NS, {"endpoints": endpoints(hosts)})
                scaled = time.monotonic()
                for sim in (s2, s3):  # the new endpoints get traffic within 5 s
                    while await sim_served(http, sim) == 0:
                        assert time.monotonic() - scaled < 5, f"{sim} got no request within 5 s"
                        await asyncio.sleep(0.1)

                draining_seen = asyncio.Event()

                async def watch_drain():
                    while not draining_seen.is_set():
                        if any(r.in_flight for r in gw.replicas.draining):
                            draining_seen.set()
                        await asyncio.sleep(0.005)

                watcher = asyncio.create_task(watch_drain())
                await call(slices.patch_namespaced_endpoint_slice, "vllm-abc", NS, {"endpoints": endpoints(hosts[:1])})
                await until(lambda: replica_names(gw, "m") == [f"m@{hosts[0]}:{port}"], 5)
                await until(lambda: not gw.replicas.draining, 10)  # their streams finished, then they closed
                watcher.cancel()
                assert draining_seen.is_set()  # streams were still running on the removed replicas
                counts = [await sim_served(http, s) for s in (s2, s3)]
                before = load.done
                await until(lambda: load.done >= before + 20, 30)
                assert [await sim_served(http, s) for s in (s2, s3)] == counts  # nothing new reached them

                await call(slices.create_namespaced_endpoint_slice, NS,
                           endpoint_slice("vllm-public", "vllm", ["8.8.8.8"], port))
                await until(lambda: f"m@8.8.8.8:{port}" in gw.discovery.refused.get("m", {}), 5)
                assert replica_names(gw, "m") == [f"m@{hosts[0]}:{port}"]
                assert await metric(http, url, "llm_gateway_egress_refused_total", host="8.8.8.8") == 1
            assert load.failures == [] and load.done > 40
            assert any("8.8.8.8" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
            text = (await http.get(f"{url}/metrics")).text
            assert 'llm_gateway_replicas{model="m",source="kubernetes",state="up"} 1.0' in text


async def test_inference_service_not_ready_gets_no_new_requests():
    port = free_port()
    async with cluster() as (kubeconfig_path, api, tmp), serve_app(simulator(SIM), port=port, host="127.0.0.5") as s:
        custom = client.CustomObjectsApi(api)
        isvc = ("serving.kserve.io", "v1beta1", NS, "inferenceservices")
        await call(custom.create_namespaced_custom_object, *isvc, inference_service("chat", ready=True))
        await call(client.DiscoveryV1Api(api).create_namespaced_endpoint_slice, NS,
                   endpoint_slice("chat-predictor-x1", "chat-predictor", ["127.0.0.5"], port))
        policy = Policy.model_validate({
            "store": {"kind": "sqlite", "path": f"{tmp}/keys.db"},
            "health": {"interval": 0.5, "backoff_initial": 0.2},
            "kubernetes": {"kubeconfig": kubeconfig_path},
            "models": [{"name": "chat", "served_name": "served",
                        "discovery": {"kind": "kserve", "namespace": NS, "inference_service": "chat"}}],
        })
        app = create_app(policy)
        gw = app.state
        await gw.store.create_key(default_key_record())
        body = {"model": "chat", "prompt": "x", "max_tokens": 2}
        async with serve_app(app) as url, httpx.AsyncClient(headers=AUTH, timeout=30) as http:
            # the first time, the watch thread imports the kserve SDK: seconds, more on a busy machine
            await until(lambda: gw.replicas.ready().get("chat"), 90)
            assert gw.replicas.by_model["chat"][0].source == "kserve"
            assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200
            served = await sim_served(http, s)

            await call(custom.patch_namespaced_custom_object, "serving.kserve.io", "v1beta1", NS,
                       "inferenceservices", "chat", {"status": inference_service("chat", ready=False)["status"]})
            await until(lambda: not gw.replicas.by_model["chat"], 5)
            ready = await http.get(f"{url}/ready")  # the model has nothing to serve, in every gateway pod alike
            assert ready.status_code == 200 and ready.json()["models"] == {"chat": False}
            refused = await http.post(f"{url}/v1/completions", json=body)
            assert refused.status_code == 503 and refused.json()["error"]["message"]
            assert await sim_served(http, s) == served

            await call(custom.patch_namespaced_custom_object, "serving.kserve.io", "v1beta1", NS,
                       "inferenceservices", "chat", {"status": inference_service("chat", ready=True)["status"]})
            await until(lambda: gw.replicas.ready().get("chat"), 30)
            assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200


async def metric(http, url, name, **labels) -> float:
    from tests.support.probes import metric_sum

    return metric_sum((await http.get(f"{url}/metrics")).text, name, **labels)


def discovered(kubeconfig_path: str, tmp: str, cap: int | None = None) -> Policy:
    found = {"kind": "kubernetes", "namespace": NS, "service": "vllm", "port": "http"}
    return Policy.model_validate({
        "store": {"kind": "sqlite", "path": f"{tmp}/keys.db"},
        "health": {"interval": 0.5, "backoff_initial": 0.2},
        "kubernetes": {"kubeconfig": kubeconfig_path},
        "models": [{"name": "m", "served_name": "served", "discovery": {**found, "cap": cap} if cap else found}],
    })


async def test_cap_holds_when_the_slice_is_deleted_and_recreated_under_load():
    """Cap 8, 20 clients: the slice deleted and at once recreated (and again after 50 and 300 ms) brings back
    the draining replica with its requests in flight, so the backend never holds more than 8."""
    port, host = free_port(), "127.0.0.6"
    backend = InFlight(simulator(SimConfig(model="served", step_base_ms=10, step_ms_per_seq=0, max_num_seqs=64)))
    async with cluster() as (kubeconfig_path, api, tmp), serve_app(backend, port=port, host=host):
        slices = client.DiscoveryV1Api(api)
        await call(slices.create_namespaced_endpoint_slice, NS, endpoint_slice("vllm-abc", "vllm", [host], port))
        app = create_app(discovered(kubeconfig_path, tmp, cap=8))
        gw = app.state
        await gw.store.create_key(default_key_record())
        statuses: list[int] = []
        stop = asyncio.Event()
        async with serve_app(app) as url, httpx.AsyncClient(headers=AUTH, timeout=60) as http:
            await until(lambda: gw.replicas.ready().get("m"), 30)

            # ~1.5 s each: still in flight when the recreated endpoint has passed its probe
            clients = [asyncio.create_task(completions(http, url, stop, statuses, max_tokens=150)) for _ in range(20)]
            await until(lambda: backend.now == 8, 30)
            for gap in (0, 0.05, 0.3):
                await call(slices.delete_namespaced_endpoint_slice, "vllm-abc", NS)
                if gap:
                    await asyncio.sleep(gap)
                await call(slices.create_namespaced_endpoint_slice, NS,
                           endpoint_slice("vllm-abc", "vllm", [host], port))
                await until(lambda: gw.replicas.ready().get("m"), 10)
                await asyncio.sleep(1)
            stop.set()
            await asyncio.gather(*clients)
    assert backend.served > 16
    assert backend.peak <= 8  # counted at the backend, across every delete and recreate
    assert 200 in statuses


async def test_refused_endpoints_show_in_admin_replicas_and_count_per_event(monkeypatch):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", "s" * 40)
    viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer')}"}
    port, host = free_port(), "127.0.0.7"
    async with cluster() as (kubeconfig_path, api, tmp), serve_app(simulator(SIM), port=port, host=host):
        slices = client.DiscoveryV1Api(api)
        await call(slices.create_namespaced_endpoint_slice, NS, endpoint_slice("vllm-abc", "vllm", [host], port))
        app = create_app(discovered(kubeconfig_path, tmp))
        gw = app.state
        async with serve_app(app) as url, httpx.AsyncClient(timeout=30) as http:
            await until(lambda: gw.replicas.ready().get("m"), 30)
            await call(slices.create_namespaced_endpoint_slice, NS,
                       endpoint_slice("vllm-public", "vllm", ["8.8.8.8"], port))
            await until(lambda: gw.discovery.refused.get("m"), 10)
            replicas = (await http.get(f"{url}/admin/replicas", headers=viewer)).json()["m"]
            assert [(r["name"], r["state"], r["reason"]) for r in replicas if r["state"] == "refused"] == \
                [(f"m@8.8.8.8:{port}", "refused", "outside network.private_cidrs")]
            assert [r["name"] for r in replicas if r["state"] != "refused"] == [f"m@{host}:{port}"]
            assert await metric(http, url, "llm_gateway_egress_refused_total", host="8.8.8.8") == 1

            for n in (2, 3):  # every event that still reports it counts it again (not once per process)
                await call(slices.patch_namespaced_endpoint_slice, "vllm-abc", NS,
                           {"metadata": {"labels": {"kubernetes.io/service-name": "vllm", "event": str(n)}}})
                for _ in range(200):  # bounded: until the event reached the gateway
                    if await metric(http, url, "llm_gateway_egress_refused_total", host="8.8.8.8") == n:
                        break
                    await asyncio.sleep(0.05)
                assert await metric(http, url, "llm_gateway_egress_refused_total", host="8.8.8.8") == n

            await call(slices.delete_namespaced_endpoint_slice, "vllm-public", NS)
            await until(lambda: not gw.discovery.refused.get("m"), 10)
            replicas = (await http.get(f"{url}/admin/replicas", headers=viewer)).json()["m"]
            assert [r["state"] for r in replicas] == ["up"]
