import asyncio
import subprocess
import sys

import pytest

from backends.replicas import HealthTimings, ReplicaSet
from backends.sources.base import Endpoint
from backends.sources.kserve import is_ready
from backends.sources.kubernetes import ready_endpoints
from policies.config import PolicyError, parse_policy
from policies.discovery import Discovery


def test_ready_endpoints_skip_not_ready_and_terminating_and_pick_the_named_port():
    slices = [
        {"ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                       {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                       {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
                       {"addresses": ["10.0.0.4"]}]},  # no conditions: ready, as Kubernetes reads it
        {"ports": [{"name": "http", "port": 8000}], "endpoints": [{"addresses": ["10.0.0.1"]}]},  # a duplicate
        {"ports": [{"name": "other", "port": 7000}], "endpoints": [{"addresses": ["10.0.0.9"]}]},
    ]
    assert ready_endpoints(slices, "http") == [Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.4", 8000)]
    assert ready_endpoints(slices[:1], None) == [Endpoint("10.0.0.1", 9000), Endpoint("10.0.0.4", 9000)]
    assert ready_endpoints(slices, 1234) == []


def test_inference_service_readiness_is_its_ready_condition():
    assert is_ready({"status": {"conditions": [{"type": "PredictorReady", "status": "True"},
                                               {"type": "Ready", "status": "True"}]}})
    assert not is_ready({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert not is_ready({"status": {}}) and not is_ready(None)


def test_discovery_settings_are_checked():
    with pytest.raises(PolicyError, match="needs `service`"):
        parse_policy("models: [{name: m, discovery: {kind: kubernetes, namespace: llm}}]")
    with pytest.raises(PolicyError, match="either a non-empty `backends` list or `discovery`"):
        parse_policy("models: [{name: m}]")
    with pytest.raises(PolicyError, match="namespace"):
        parse_policy("models: [{name: m, discovery: {kind: kserve, namespace: Not_DNS, inference_service: x}}]")


async def test_endpoints_become_replicas_and_public_addresses_are_refused():
    policy = parse_policy("models: [{name: m, served_name: s, discovery: {kind: kubernetes, namespace: llm, "
                          "service: vllm, cap: 4, health_path: /ready}}]")

    class Fake:
        kind = "kubernetes"

        def start(self, emit):
            self.emit = emit

        def stop(self):
            self.stopped = True

    fake = Fake()
    replicas = ReplicaSet({"m": []}, HealthTimings())
    refused = []
    discovery = Discovery(replicas, refused.append, source_factory=lambda config, kubeconfig: fake)
    discovery.sync(policy)
    fake.emit([Endpoint("10.1.2.3", 8000), Endpoint("8.8.8.8", 8000)])
    await asyncio.sleep(0.01)  # emitted from "another thread": applied on the loop
    [replica] = replicas.by_model["m"]
    assert (replica.name, replica.url, replica.cap, replica.health_path, replica.served_name, replica.source) == \
        ("m@10.1.2.3:8000", "http://10.1.2.3:8000", 4, "/ready", "s", "kubernetes")
    assert refused == ["8.8.8.8"]
    fake.emit([Endpoint("8.8.8.8", 8000)])
    await asyncio.sleep(0.01)
    assert replicas.by_model["m"] == [] and refused == ["8.8.8.8"] * 2  # counted at every event that reports it
    [shown] = discovery.refused["m"].values()  # listed (for /admin/replicas) with its reason while reported
    assert (shown.name, shown.reason) == ("m@8.8.8.8:8000", "outside network.private_cidrs")
    discovery.sync(policy)  # a reload is no new event: not counted again
    assert refused == ["8.8.8.8"] * 2
    fake.emit([])
    await asyncio.sleep(0.01)
    assert discovery.refused["m"] == {}
    discovery.sync(parse_policy("models: [{name: n, backends: [{url: 'http://10.0.0.1'}]}]"))
    assert fake.stopped and discovery.running == {}


async def test_a_source_that_cannot_start_leaves_the_model_empty_and_says_why(caplog):
    policy = parse_policy("models: [{name: m, discovery: {kind: kubernetes, namespace: llm, service: vllm}}]")

    def no_cluster(config, kubeconfig):
        raise RuntimeError("Service host/port is not set")

    replicas = ReplicaSet({"m": []}, HealthTimings())
    discovery = Discovery(replicas, source_factory=no_cluster)
    discovery.sync(policy)
    assert discovery.running == {} and replicas.by_model["m"] == []
    assert "model m: discovery (kubernetes) cannot reach the Kubernetes API" in caplog.text


def test_the_kserve_sdk_imports_under_the_gateways_own_command_line():
    """kserve parses sys.argv when imported; `llm-gateway serve --config FILE` made it exit (its
    --configure_logging takes `--config` as an abbreviation), killing the watch thread. A fresh process, as the
    gateway's own, with the gateway's argv: the import succeeds and argv is left as it was."""
    script = ("import sys; sys.argv = ['llm-gateway', 'serve', '--config', '/etc/llm-gateway/policy.yaml']\n"
              "from backends.sources.kserve import import_kserve\n"
              "print(import_kserve().KServeClient.__name__, sys.argv[1:])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["KServeClient", "['serve',", "'--config',", "'/etc/llm-gateway/policy.yaml']"]


async def test_a_discovered_variant_fills_its_own_replica_set():
    from policies.compile import replica_set

    policy = parse_policy("""
models:
  - name: m
    served_name: s
    variants:
      - {name: bf16, weight: 90, backends: [{url: "http://10.0.0.1:8000"}]}
      - {name: fp8, weight: 10, served_name: s-fp8,
         discovery: {kind: kserve, namespace: llm, inference_service: m-fp8, cap: 8}}
""")

    class Fake:
        def start(self, emit):
            self.emit = emit

        def stop(self):
            pass

    fake = Fake()
    replicas = replica_set(policy)
    discovery = Discovery(replicas, source_factory=lambda config, kubeconfig: fake)
    discovery.sync(policy)
    assert list(discovery.models) == ["m#fp8"]
    fake.emit([Endpoint("10.1.2.3", 8000)])
    await asyncio.sleep(0.01)
    [replica] = replicas.by_model["m#fp8"]
    assert (replica.name, replica.model, replica.variant, replica.group, replica.served_name, replica.cap) == \
        ("m#fp8@10.1.2.3:8000", "m", "fp8", "m#fp8", "s-fp8", 8)
    assert [r.name for r in replicas.by_model["m#bf16"]] == ["m-bf16-0"]  # the static variant is untouched


def test_a_watch_that_dies_of_any_exception_is_restarted_with_backoff_and_says_so_once_each_way(caplog):
    """SystemExit (importing the kserve SDK once raised it in the watch thread) ended the thread silently:
    the watch was stale from then on. Every death is retried with growing pauses; one line says it broke,
    one that it recovered; the state says which."""
    import logging
    import threading
    import time

    from backends.sources.watch import Watcher, WatchTimings

    caplog.set_level(logging.DEBUG, "gateway.discovery")
    deaths = [SystemExit(2), RuntimeError("boom"), KeyboardInterrupt(), ValueError("bad")]
    runs, healed = [], threading.Event()

    def body(stopped):
        runs.append(time.monotonic())
        if deaths:
            raise deaths.pop(0)
        watcher.synced()
        healed.set()
        stopped.wait()

    watcher = Watcher("test", body, WatchTimings(backoff_initial=0.05, backoff_max=0.2))
    assert watcher.state == "starting"
    watcher.start()
    try:
        assert healed.wait(10), f"the watch was not restarted after each death: {len(runs)} runs"
        assert watcher.thread.is_alive() and watcher.state == "ok" and watcher.failures == 4
        pauses = [b - a for a, b in zip(runs, runs[1:])]
        assert pauses[0] >= 0.025 and pauses[-1] >= 0.1  # 0.05 doubling, capped at 0.2, each 50-100% of it
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
        assert [level for level, _ in lines] == ["WARNING", "INFO"], lines
        assert "watch of test broke: SystemExit: 2" in lines[0][1] and "recovered" in lines[1][1]
    finally:
        watcher.stop()
        watcher.thread.join(5)
    assert not watcher.thread.is_alive()


def test_backoff_is_exponential_capped_and_jittered():
    from backends.sources.watch import WatchTimings

    timings = WatchTimings(backoff_initial=0.5, backoff_max=30)
    for failures, ceiling in ((1, 0.5), (2, 1), (3, 2), (7, 30), (500, 30)):
        pauses = {timings.backoff(failures) for _ in range(50)}
        assert all(ceiling / 2 <= p <= ceiling for p in pauses) and len(pauses) > 1
