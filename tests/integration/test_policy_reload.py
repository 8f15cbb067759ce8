"""Hot reload of the policy file under streaming load: nothing fails while models, caps, limits and backends
change, /v1/models follows within seconds, and a broken file leaves the old policy serving.

The file is mounted as a ConfigMap mounts it: `policy.yaml` is a symlink through `..data`, and an update
swaps `..data` to a new directory (the watched path itself never changes).
"""

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from openai import AsyncOpenAI

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.admin.auth import mint_token
from gateway.app import create_app
from policies.config import Admin, load_policy, parse_policy
from tests.support.gateway import AUTH, TEST_KEY, default_key_record
from tests.support.probes import metric_sum
from tests.support.probes import wait_http_ok
from tests.support.servers import free_port, serve_app

CLI = str(Path(sys.executable).with_name("llm-gateway"))

SIM = SimConfig(model="served", step_base_ms=5)


class ConfigMapDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "policy.yaml"
        self.n = 0

    def write(self, policy: dict | str) -> None:
        self.n += 1
        version = self.root / f"..v{self.n}"
        version.mkdir()
        (version / "policy.yaml").write_text(policy if isinstance(policy, str) else yaml.safe_dump(policy))
        link = self.root / "..data_tmp"
        link.symlink_to(version.name)
        os.replace(link, self.root / "..data")  # the atomic swap the kubelet does
        if not self.path.is_symlink():
            self.path.symlink_to("..data/policy.yaml")


def policy(store: str, models: list[dict]) -> dict:
    return {"store": {"kind": "sqlite", "path": store}, "health": {"interval": 0.2, "backoff_initial": 0.2},
            "models": models}


class Load:
    """Workers streaming chat completions until stopped (bounded); every failure is kept."""

    def __init__(self, url: str, model: str, workers: int = 4, api_key: str = TEST_KEY) -> None:
        self.client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=30)
        self.model, self.workers = model, workers
        self.done, self.failures = 0, []
        self.stop = asyncio.Event()

    async def worker(self) -> None:
        for _ in range(5000):  # bounded even if the test forgets to stop it
            if self.stop.is_set():
                return
            try:
                stream = await self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)
                chunks = [c async for c in stream]
                assert chunks, "empty stream"
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                self.failures.append(repr(exc))

    @contextlib.asynccontextmanager
    async def running(self):
        tasks = [asyncio.create_task(self.worker()) for _ in range(self.workers)]
        try:
            yield self
        finally:
            self.stop.set()
            await asyncio.gather(*tasks)
            await self.client.close()


async def until(predicate, timeout: float) -> None:
    """Wait for a condition of the gateway's own state (generous bounds: the machine is shared)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def models_listed(http, url) -> set[str]:
    return {m["id"] for m in (await http.get(f"{url}/v1/models")).json()["data"]}


async def test_reload_under_load_changes_models_caps_limits_and_backends(caplog, monkeypatch):
    caplog.set_level(logging.INFO, "gateway.reload")
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", "s" * 40)
    viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer')}"}
    with tempfile.TemporaryDirectory(prefix="llmgw-reload-") as tmp:
        files = ConfigMapDir(Path(tmp))
        store = f"{tmp}/keys.db"
        async with serve_app(simulator(SIM)) as s1, serve_app(simulator(SIM)) as s2, \
                serve_app(simulator(SIM)) as s3:
            m = {"name": "m", "served_name": "served", "backends": [{"url": s1, "name": "a", "cap": 2},
                                                                     {"url": s2, "name": "b"}]}
            n = {"name": "n", "served_name": "served", "backends": [{"url": s3, "name": "c"}]}
            files.write(policy(store, [m]))
            app = create_app(load_policy(files.path), policy_path=str(files.path))
            gw = app.state
            await gw.store.create_key(default_key_record())
            async with serve_app(app) as url, httpx.AsyncClient(headers=AUTH, timeout=30) as http:
                await until(lambda: gw.replicas.ready()["m"], 10)
                first = gw.snapshot.version
                async with Load(url, "m").running() as load:
                    await until(lambda: load.done >= 10, 30)

                    files.write(policy(store, [m, n]))  # add a model
                    started = time.monotonic()
                    while "n" not in await models_listed(http, url):
                        assert time.monotonic() - started < 5, "/v1/models did not list the new model in 5 s"
                        await asyncio.sleep(0.1)
                    await until(lambda: gw.replicas.ready().get("n"), 10)  # probed, then routable
                    answer = await http.post(f"{url}/v1/completions",
                                             json={"model": "n", "prompt": "x", "max_tokens": 2})
                    assert answer.status_code == 200, answer.text

                    m["backends"][0]["cap"] = 5  # change a cap
                    n["limits"] = {"requests_per_minute": 1}  # change a model's rate limits
                    files.write(policy(store, [m, n]))
                    await until(lambda: gw.replicas.by_model["m"][0].limit == 5, 5)
                    metrics = (await http.get(f"{url}/metrics")).text
                    assert metric_sum(metrics, "llm_gateway_backend_limit", backend="a") == 5
                    codes = [(await http.post(f"{url}/v1/completions",
                                              json={"model": "n", "prompt": "x", "max_tokens": 2})).status_code
                             for _ in range(2)]
                    assert codes == [200, 429]

                    served_by_b = await sim_served(http, s2)
                    m["backends"] = m["backends"][:1]  # remove a backend
                    files.write(policy(store, [m, n]))
                    await until(lambda: [r.name for r in gw.replicas.by_model["m"]] == ["a"], 5)
                    await until(lambda: not gw.replicas.draining, 10)  # its streams finished
                    after_drain = await sim_served(http, s2)
                    before = load.done
                    await until(lambda: load.done >= before + 10, 30)
                    assert await sim_served(http, s2) == after_drain >= served_by_b  # nothing new reached it

                    version = gw.snapshot.version
                    files.write("models: [{name: m, backends: [{url: 'http://10.0.0.1', cpa: 3}]}]\n")
                    await until(lambda: metric_sum_sync(app, "llm_gateway_policy_reload_total",
                                                             result="invalid") == 1, 5)
                    assert gw.snapshot.version == version != first
                    live = (await http.get(f"{url}/admin/policy", headers=viewer)).json()
                    assert live["version"] == version and live["models"] == ["m", "n"]
                    assert live["loaded_at"] > time.time() - 60
                    replicas = (await http.get(f"{url}/admin/replicas", headers=viewer)).json()
                    assert [(r["name"], r["source"], r["state"], r["draining"]) for r in replicas["m"]] == \
                        [("a", "static", "up", False)]
                    before = load.done
                    await until(lambda: load.done >= before + 5, 30)  # the old policy keeps serving
                    view = (await http.get(f"{url}/v1/models")).json()
                    assert {d["id"] for d in view["data"]} == {"m", "n"}

                assert load.failures == []
                assert load.done > 30
                assert metric_sum_sync(app, "llm_gateway_policy_reload_total", result="ok") == 3
                refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
                assert refused and "cpa" in refused[0] and "unknown field" in refused[0]


async def sim_served(http, sim) -> float:
    return metric_sum((await http.get(f"{sim}/metrics")).text, "vllm:request_success_total")


def metric_sum_sync(app, name, **labels) -> float:
    from prometheus_client import generate_latest

    return metric_sum(generate_latest(app.state.metrics.registry).decode(), name, **labels)


async def test_sighup_reloads_a_real_gateway_process_under_load_and_a_broken_file_keeps_the_old(tmp_path):
    secret = "r" * 40
    env = {**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret, "PYTHONUNBUFFERED": "1"}
    ports = [free_port() for _ in range(3)]
    sims = [subprocess.Popen([sys.executable, "-m", "tools.simulator", "--port", str(p), "--model", "served",
                              "--log-level", "warning", "--step-base-ms", "5"]) for p in ports[:2]]
    url = f"http://127.0.0.1:{ports[2]}"
    backends = [{"url": f"http://127.0.0.1:{p}", "name": n} for p, n in zip(ports, "ab")]
    base = {"listen": {"host": "127.0.0.1", "port": ports[2]}, "health": {"interval": 0.5, "backoff_initial": 0.2},
            "store": {"kind": "sqlite", "path": str(tmp_path / "k.db")}}
    config = tmp_path / "policy.yaml"
    config.write_text(yaml.safe_dump({**base, "models": [{"name": "m", "served_name": "served",
                                                          "backends": backends}]}))
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log:
        gateway = subprocess.Popen([CLI, "serve", "--config", str(config)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        for p, sim in zip(ports, sims):
            wait_http_ok(f"http://127.0.0.1:{p}/health", sim, 60, "the simulator")
        wait_http_ok(f"{url}/ready", gateway, 60, "the gateway")
        admin = {"authorization": f"Bearer {mint_token(Admin(), 600, secret=secret)}"}
        async with httpx.AsyncClient(timeout=30) as http:
            key = (await http.post(f"{url}/admin/keys", json={"name": "reload"}, headers=admin)).json()["key"]
            auth = {"authorization": f"Bearer {key}"}
            first = (await http.get(f"{url}/admin/policy", headers=admin)).json()["version"]
            async with Load(url, "m", api_key=key).running() as load:
                await until(lambda: load.done >= 10, 30)
                models = [{"name": "m", "served_name": "served", "limits": {"requests_per_minute": 100000},
                           "backends": [{**backends[0], "cap": 3}, backends[1]]},
                          {"name": "n", "served_name": "served", "backends": [{**backends[1], "name": "n-b"}]}]
                config.write_text(yaml.safe_dump({**base, "models": models}))
                gateway.send_signal(signal.SIGHUP)
                started = time.monotonic()
                while {d["id"] for d in (await http.get(f"{url}/v1/models", headers=auth)).json()["data"]} \
                        != {"m", "n"}:
                    assert time.monotonic() - started < 5, "/v1/models did not follow the file within 5 s"
                    await asyncio.sleep(0.1)

                models[0]["backends"] = models[0]["backends"][:1]  # remove a backend
                config.write_text(yaml.safe_dump({**base, "models": models}))
                gateway.send_signal(signal.SIGHUP)

                async def only_a() -> bool:
                    replicas = (await http.get(f"{url}/admin/replicas", headers=admin)).json()
                    return [(r["name"], r["draining"]) for r in replicas["m"]] == [("a", False)]

                deadline = time.monotonic() + 10
                while not await only_a():
                    assert time.monotonic() < deadline, "the removed backend did not drain"
                    await asyncio.sleep(0.1)
                live = (await http.get(f"{url}/admin/policy", headers=admin)).json()["version"]

                config.write_text("models: [{name: m, backends: [{url: 'http://10.0.0.1', cpa: 3}]}]\n")
                gateway.send_signal(signal.SIGHUP)
                deadline = time.monotonic() + 10
                while b"refused" not in log_path.read_bytes():
                    assert time.monotonic() < deadline, "the broken file was not refused"
                    await asyncio.sleep(0.1)
                assert (await http.get(f"{url}/admin/policy", headers=admin)).json()["version"] == live != first
                before = load.done
                await until(lambda: load.done >= before + 10, 30)  # the old policy keeps serving
            assert load.failures == [] and load.done > 20
            metrics = (await http.get(f"{url}/metrics")).text
            assert metric_sum(metrics, "llm_gateway_policy_reload_total", result="invalid") >= 1
            assert metric_sum(metrics, "llm_gateway_policy_reload_total", result="ok") == 2
    finally:
        gateway.terminate()
        gateway.wait(30)
        for sim in sims:
            sim.terminate()
            sim.wait(30)
    text = log_path.read_text()
    assert "cpa: unknown field" in text and "keeps serving" in text, text[-3000:]


async def test_a_file_rewritten_in_place_in_two_parts_is_applied_only_whole(caplog):
    """The first part is itself a valid policy that lacks model `n`: `n` must never vanish while the file is
    written (no 404/503 for it), and the whole file applies once it is complete."""
    caplog.set_level(logging.INFO, "gateway.reload")
    with tempfile.TemporaryDirectory(prefix="llmgw-inplace-") as tmp:
        path = Path(tmp) / "policy.yaml"
        store = f"{tmp}/keys.db"
        async with serve_app(simulator(SIM)) as s1, serve_app(simulator(SIM)) as s2:
            def text(cap: int) -> tuple[str, str]:
                head = yaml.safe_dump(policy(store, [{"name": "m", "served_name": "served",  # `models:` last
                                                      "backends": [{"url": s1, "name": "a", "cap": cap}]}]),
                                      sort_keys=False)
                tail = yaml.safe_dump([{"name": "n", "served_name": "served",
                                        "backends": [{"url": s2, "name": "c"}]}])
                return head, tail
            head, tail = text(2)
            path.write_text(head + tail)
            assert [m.name for m in load_policy(path).models] == ["m", "n"]
            app = create_app(load_policy(path), policy_path=str(path))
            gw = app.state
            await gw.store.create_key(default_key_record())
            async with serve_app(app) as url, httpx.AsyncClient(headers=AUTH, timeout=30) as http:
                await until(lambda: gw.replicas.ready().get("n") and gw.replicas.ready().get("m"), 10)
                codes: list[int] = []
                stop = asyncio.Event()

                async def ask_n() -> None:
                    for _ in range(2000):
                        if stop.is_set():
                            return
                        answer = await http.post(f"{url}/v1/completions",
                                                 json={"model": "n", "prompt": "x", "max_tokens": 2})
                        codes.append(answer.status_code)
                        await asyncio.sleep(0.02)

                asker = asyncio.create_task(ask_n())
                head, tail = text(5)
                assert [m.name for m in load_policy_text(head).models] == ["m"]  # the first part alone is valid
                with open(path, "w", encoding="utf-8") as f:  # in place: same inode, as an editor or a script
                    f.write(head)
                    f.flush()
                    await asyncio.sleep(1.5)
                    f.write(tail)
                await until(lambda: gw.replicas.by_model["m"][0].limit == 5, 15)
                await asyncio.sleep(0.5)
                stop.set()
                await asyncio.wait_for(asker, 30)
                assert [m.name for m in gw.snapshot.policy.models] == ["m", "n"]
                assert codes and set(codes) == {200}, [c for c in codes if c != 200]
                assert metric_sum_sync(app, "llm_gateway_policy_reload_total", result="ok") == 1


def load_policy_text(text: str):
    return parse_policy(text, "part")


RESTART_CHANGES = {  # one valid change of each read-once setting (policies/snapshot.py NEEDS_RESTART)
    "listen": {"listen": {"host": "127.0.0.1", "port": 1}},
    "server": {"server": {"max_body_bytes": 1 << 20}},
    "timeouts": {"timeouts": {"connect": 3.0}},
    "upstream": {"upstream": {"max_body_bytes": 1 << 20}},
    "health": {"health": {"interval": 0.3, "backoff_initial": 0.2}},
    "store": {"store": "other.db"},
    "auth": {"auth": {"cache_seconds": 7}},
    "admin": {"admin": {"leeway_seconds": 3}},
    "tracing": {"tracing": {"sampling_ratio": 0.5}},
    "caps": {"caps": {"lease_seconds": 20}},
    "ledger": {"ledger": {"bucket_seconds": 120}},
    "kubernetes": {"kubernetes": {"kubeconfig": "/nonexistent/kubeconfig"}},
    "routing.scrape": {"routing": {"scrape": {"interval": 0.5}}},
    "rate_limits.on_store_failure": {"rate_limits": {"on_store_failure": {"requests": "fail_closed"}}},
    "rate_limits.lease_seconds": {"rate_limits": {"lease_seconds": 600}},
    "batch.enabled": {"batch": {"enabled": False}},
    "batch.files_dir": {"batch": {"files_dir": "/nonexistent/batch-files"}},
}


async def test_each_restart_only_setting_is_refused_by_name_and_priorities_apply_to_queued_waiters(caplog):
    from gateway.reload import INVALID, OK, PolicyReloader
    from policies.snapshot import NEEDS_RESTART

    assert set(RESTART_CHANGES) == set(NEEDS_RESTART), \
        "give each setting in NEEDS_RESTART one valid change in RESTART_CHANGES (tests/integration/test_policy_reload.py)"
    caplog.set_level(logging.INFO, "gateway.reload")
    with tempfile.TemporaryDirectory(prefix="llmgw-classes-") as tmp:
        path = Path(tmp) / "policy.yaml"
        async with serve_app(simulator(SimConfig(model="served", step_base_ms=100))) as sim:
            def base() -> dict:
                return {**policy(f"{tmp}/keys.db", [{"name": "m", "served_name": "served",
                                                     "backends": [{"url": sim, "name": "a", "cap": 1}]}]),
                        "health": {"interval": 0.2, "backoff_initial": 0.2}}
            path.write_text(yaml.safe_dump(base()))
            app = create_app(load_policy(path), policy_path=str(path))
            gw = app.state
            await gw.store.create_key(default_key_record())
            reloader = PolicyReloader(gw, str(path))
            async with serve_app(app) as url, httpx.AsyncClient(headers=AUTH, timeout=60) as http:
                await until(lambda: gw.replicas.ready().get("m"), 10)
                version = gw.snapshot.version
                for name, change in RESTART_CHANGES.items():
                    changed = base()
                    for key, value in change.items():
                        changed[key] = ({**changed.get(key, {}), **value} if isinstance(value, dict) else
                                        {**changed[key], "path": f"{tmp}/{value}"})
                    path.write_text(yaml.safe_dump(changed))
                    caplog.clear()
                    assert await reloader.reload("test") == INVALID, name
                    assert gw.snapshot.version == version, name
                    refused = " ".join(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
                    assert name in refused and "restart" in refused, (name, refused)

                # priorities: a waiter already queued moves to its class's new rank and is served
                body = {"model": "m", "prompt": "x", "max_tokens": 30, "ignore_eos": True}
                first = asyncio.create_task(http.post(f"{url}/v1/completions", json=body))
                queue = gw.snapshot.admission.queues["m"]
                await until(lambda: queue.replicas[0].in_flight == 1, 10)
                second = asyncio.create_task(http.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}))
                await until(lambda: queue.depth == 1, 10)
                changed = base()
                changed["priorities"] = {"default": "interactive", "hold": 0, "classes": [
                    {"name": "bulk", "max_wait": 60}, {"name": "interactive", "max_wait": 45}]}
                path.write_text(yaml.safe_dump(changed))
                assert await reloader.reload("test") == OK
                live = gw.snapshot.admission.queues["m"]
                assert live is queue and [c.name for c in live.classes] == ["bulk", "interactive"]
                assert live.priorities.hold == 0 and live.classes[1].max_wait == 45
                waiter = live.line.head()
                assert waiter is not None and waiter.rank == 1  # interactive is now second
                answers = await asyncio.wait_for(asyncio.gather(first, second), 60)
                assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]


async def test_a_reload_turns_the_console_on_and_off():
    """The console's settings are read from the live policy on each request: a reload applies them at once."""
    from gateway.reload import OK, PolicyReloader

    with tempfile.TemporaryDirectory(prefix="llmgw-console-") as tmp:
        path = Path(tmp) / "policy.yaml"
        base = policy(f"{tmp}/keys.db", [{"name": "m", "backends": [{"url": "http://127.0.0.1:9"}]}])
        path.write_text(yaml.safe_dump(base))
        app = create_app(load_policy(path), policy_path=str(path))
        reloader = PolicyReloader(app.state, str(path))
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.get("/console/signin")).status_code == 404
            path.write_text(yaml.safe_dump({**base, "console": {"enabled": True, "page_size": 20}}))
            assert await reloader.reload("test") == OK
            assert (await http.get("/console/signin")).status_code == 200
            assert app.state.policy.console.page_size == 20
            path.write_text(yaml.safe_dump(base))
            assert await reloader.reload("test") == OK
            assert (await http.get("/console/signin")).status_code == 404
