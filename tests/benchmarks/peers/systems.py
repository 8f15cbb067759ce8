"""Starting each system under test, configured alike: one non-streaming model on the stand-in's JSON port,
one streaming model on its SSE port, everything on 127.0.0.1, the system pinned to its core.

- gateway: `llm-gateway serve` with its full pipeline (key auth, per-key and per-model rate limits set far
  above what the run sends, usage accounting, Prometheus metrics), SQLite store, default log level.
- LiteLLM proxy: `litellm --num_workers 1` with a master key (no database), as installed from PyPI.
- vllm-router: one router process per stand-in port (it routes to workers, not by model), round_robin policy.
- nginx: a plain reverse proxy with upstream keep-alive, buffering off on the streaming port (the floor).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tests.benchmarks.peers.install import CACHE, venv_python
from tests.benchmarks.peers.procs import Proc, Procs, http_ok, wait_until
from tests.benchmarks.peers.standin import MODEL, floor_conf, standin_conf

REPO = Path(__file__).resolve().parents[3]
LOAD_CORE, SUT_CORE = 0, 1
STREAM_MODEL = "bench-stream"
HIGH = {"requests_per_minute": 1_000_000_000, "tokens_per_minute": 1_000_000_000_000, "max_concurrent": 100_000}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class System:
    name: str
    json_url: str  # where non-streaming requests go (model `json_model`)
    sse_url: str  # where streaming requests go (model `sse_model`)
    json_model: str = MODEL
    sse_model: str = MODEL
    auth: str | None = None  # the Authorization header value
    procs: list[Proc] = field(default_factory=list)  # CPU time is the sum over these trees

    def cpu_seconds(self) -> float:
        return sum(p.cpu_seconds() for p in self.procs)

    def check_alive(self) -> None:
        for p in self.procs:
            if not p.alive():
                raise RuntimeError(f"{self.name}: {p.name} exited ({p.popen.returncode}):\n{p.log_tail()}")


@dataclass
class StandIn:
    json_port: int
    sse_port: int
    system: System


def start_standin(procs: Procs, work: Path) -> StandIn:
    json_port, sse_port = free_port(), free_port()
    conf = standin_conf(work / "standin", json_port, sse_port)
    proc = procs.start("standin", conf.command(), LOAD_CORE)
    for port in (json_port, sse_port):
        wait_until(http_ok(f"http://127.0.0.1:{port}/health"), proc, 20, "the stand-in backend")
    system = System("direct", f"http://127.0.0.1:{json_port}", f"http://127.0.0.1:{sse_port}", procs=[proc])
    return StandIn(json_port, sse_port, system)


def start_gateway(procs: Procs, work: Path, standin: StandIn, name: str = "gateway",
                  env_extra: dict[str, str] | None = None, args: list[str] | None = None,
                  routing: str | None = None, replicas: int = 1, redis_url: str | None = None,
                  store: dict | None = None, policy_extra: dict | None = None, variants: bool = False,
                  launcher: list[str] | None = None) -> System:
    """The gateway as `llm-gateway serve` runs it; returns once a key with very high limits is issued.
    `routing` names the routing profile; `replicas` > 1 lists the stand-in that many times per model, so the
    profile has candidates to score (they share one stand-in, so the backend's speed is the same).
    `redis_url`: the Redis store instead of SQLite, as N replicas run it (keys, limits and the backends' cap
    slots in Redis); each backend then has a cap far above the load, so every request takes a fleet slot.
    `store`: these store settings as they are (e.g. Redis behind Sentinel or a Cluster), no caps.
    `policy_extra` adds top-level sections to the policy (e.g. `ledger`). `variants`: each model as two variants
    (a: 80, b: 20) of the same stand-in, so every request is assigned one. `launcher`: the command that stands
    for `llm-gateway` (e.g. a module that changes one thing before running the CLI)."""
    from gateway.admin.auth import mint_token
    from policies.config import Admin

    dir = work / name
    dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    if store is None:
        store = {"kind": "redis", "url": redis_url, "prefix": f"bench-{name}:"} if redis_url else \
            {"kind": "sqlite", "path": str(dir / "keys.db")}
    cap = {"cap": 100_000} if redis_url else {}
    policy = {
        "listen": {"host": "127.0.0.1", "port": port},
        "store": store,
        "models": [
            {"name": MODEL, "limits": HIGH, "queue": {"max_depth": 10_000},
             "backends": [{"url": f"http://127.0.0.1:{standin.json_port}", **cap}] * replicas},
            {"name": STREAM_MODEL, "limits": HIGH, "queue": {"max_depth": 10_000},
             "backends": [{"url": f"http://127.0.0.1:{standin.sse_port}", **cap}] * replicas},
        ],
    }
    if variants:
        for model in policy["models"]:
            backends = model.pop("backends")
            model["variants"] = [{"name": "a", "weight": 80, "backends": backends},
                                 {"name": "b", "weight": 20, "backends": backends}]
    if routing is not None:
        policy["routing"] = {"default_profile": routing}
    policy.update(policy_extra or {})
    (dir / "policy.yaml").write_text(yaml.safe_dump(policy))
    secret = secrets.token_urlsafe(32)
    env = {**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret, **(env_extra or {})}
    cli = str(Path(sys.executable).with_name("llm-gateway"))
    proc = procs.start(name, [*(launcher or [cli]), "serve", "--config", str(dir / "policy.yaml"), *(args or [])], SUT_CORE,
                       env=env, cwd=dir)
    url = f"http://127.0.0.1:{port}"
    wait_until(http_ok(f"{url}/ready"), proc, 60, name)
    token = mint_token(Admin(), 3600, secret=secret)
    r = httpx.post(f"{url}/admin/keys", json={"name": "bench", "limits": HIGH},
                   headers={"authorization": f"Bearer {token}"}, timeout=10, trust_env=False)
    r.raise_for_status()
    return System(name, url, url, MODEL, STREAM_MODEL, f"Bearer {r.json()['key']}", [proc])


def start_redis(procs: Procs, work: Path) -> str:
    """Debian's redis-server on the load core (beside the stand-in: a server the gateway talks to, not part of
    the system under test), no persistence; its URL."""
    port = free_port()
    proc = procs.start("redis", ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                 "--appendonly", "no", "--dir", str(work)], LOAD_CORE)
    wait_until(lambda: _redis_ping(port), proc, 20, "redis-server")
    return f"redis://127.0.0.1:{port}/0"


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_litellm(procs: Procs, work: Path, standin: StandIn) -> System:
    dir = work / "litellm"
    dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    master = "sk-bench-" + secrets.token_hex(16)
    config = {
        "model_list": [
            {"model_name": MODEL, "litellm_params": {
                "model": f"openai/{MODEL}", "api_base": f"http://127.0.0.1:{standin.json_port}/v1", "api_key": "none"}},
            {"model_name": STREAM_MODEL, "litellm_params": {
                "model": f"openai/{MODEL}", "api_base": f"http://127.0.0.1:{standin.sse_port}/v1", "api_key": "none"}},
        ],
        "general_settings": {"master_key": master},
    }
    (dir / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HOME": str(dir)}  # no cost-map fetch
    env.pop("VIRTUAL_ENV", None)
    cli = str(venv_python("litellm").with_name("litellm"))
    proc = procs.start("litellm", [cli, "--config", str(dir / "config.yaml"), "--host", "127.0.0.1",
                                   "--port", str(port), "--num_workers", "1"], SUT_CORE, env=env, cwd=dir)
    url = f"http://127.0.0.1:{port}"
    wait_until(http_ok(f"{url}/health/liveliness"), proc, 120, "LiteLLM proxy")
    return System("LiteLLM", url, url, MODEL, STREAM_MODEL, f"Bearer {master}", [proc])


def start_router(procs: Procs, work: Path, standin: StandIn) -> System:
    cli = str(venv_python("router").with_name("vllm-router"))
    started = []
    for label, upstream in (("json", standin.json_port), ("sse", standin.sse_port)):
        port = free_port()
        proc = procs.start(f"vllm-router-{label}", [
            cli, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", f"http://127.0.0.1:{upstream}",
            "--policy", "round_robin", "--log-level", "warning", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port())], SUT_CORE, cwd=CACHE)
        started.append((proc, f"http://127.0.0.1:{port}"))
    for proc, url in started:
        wait_until(http_ok(f"{url}/health"), proc, 60, "vllm-router")
    (json_proc, json_url), (sse_proc, sse_url) = started
    return System("vllm-router", json_url, sse_url, procs=[json_proc, sse_proc])


def start_floor(procs: Procs, work: Path, standin: StandIn) -> System:
    json_port, sse_port = free_port(), free_port()
    conf = floor_conf(work / "floor", json_port, sse_port, standin.json_port, standin.sse_port)
    proc = procs.start("nginx", conf.command(), SUT_CORE)
    for port in (json_port, sse_port):
        wait_until(http_ok(f"http://127.0.0.1:{port}/health"), proc, 20, "nginx (floor)")
    return System("nginx", f"http://127.0.0.1:{json_port}", f"http://127.0.0.1:{sse_port}", procs=[proc])
