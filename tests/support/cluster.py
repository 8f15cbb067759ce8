"""Gateway replicas as separate processes on one real redis-server, in front of a simulated backend.

For the tests about what must hold across replicas (keys, revocation, global rate limits, Redis outages).
The simulator answers model `m`; `slow` makes each generated token take 20 ms, so requests stay in flight.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.support.probes import wait_http_ok
from tests.support.redis_server import RedisServer
from tests.support.servers import free_port, stop_processes

CLI = str(Path(sys.executable).with_name("llm-gateway"))


@dataclass
class Cluster:
    urls: list[str]
    redis: RedisServer
    env: dict[str, str]
    config: Path
    logs: list[Path] = field(default_factory=list)
    gateways: list[subprocess.Popen] = field(default_factory=list)  # one per url
    backend_url: str = ""  # the simulator

    @property
    def admin_token(self) -> str:
        return self.env["LLM_GATEWAY_ADMIN_TOKEN"]

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([CLI, *args], env=self.env, capture_output=True, text=True, timeout=30)

    def issue_key(self, **fields) -> str:
        r = httpx.post(f"{self.urls[0]}/admin/keys", json={"name": "test", **fields},
                       headers={"authorization": f"Bearer {self.admin_token}"}, timeout=10)
        r.raise_for_status()
        return r.json()["key"]

    def log_text(self) -> str:
        return "\n".join(p.read_text() for p in self.logs)


@contextlib.contextmanager
def cluster(tmp_path: Path, replicas: int = 2, slow: bool = False, backend: dict | None = None,
            sim_args: tuple[str, ...] = (), upstream: str | None = None, model: dict | None = None,
            redis_setup=RedisServer, **policy_overrides) -> Iterator[Cluster]:
    """`backend`: more settings of the one backend (e.g. its cap); `model`: more of the model (its queue);
    `sim_args`: more simulator flags; `upstream`: a backend already running (a real vLLM) instead of the
    simulator; `redis_setup` builds the Redis (a RedisServer, or a redis_ha set) with `with`; the policy reaches
    it by its `url`."""
    procs: list[subprocess.Popen] = []
    secret = secrets.token_urlsafe(32)
    env = {**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret, "PYTHONUNBUFFERED": "1"}
    with redis_setup() as redis:
        backend_url = upstream
        if upstream is None:
            sim_port = free_port()
            speed = ["--step-base-ms", "20", "--step-ms-per-seq", "0"] if slow else []
            procs.append(subprocess.Popen([sys.executable, "-m", "tools.simulator", "--port", str(sim_port),
                                           "--model", "m", "--log-level", "warning", *speed, *sim_args]))
            backend_url = f"http://127.0.0.1:{sim_port}"
        policy = {
            "store": {"kind": "redis", "url": redis.url},
            "health": {"interval": 0.5},
            "models": [{"name": "m", "backends": [{"url": backend_url, **(backend or {})}], **(model or {})}],
            **policy_overrides,
        }
        config = tmp_path / "policy.yaml"
        config.write_text(yaml.safe_dump(policy))
        result = Cluster([], redis, env, config, backend_url=backend_url)
        try:
            for i in range(replicas):
                port = free_port()
                log_path = tmp_path / f"gateway-{i}.log"
                with open(log_path, "wb") as log:
                    procs.append(subprocess.Popen([CLI, "serve", "--config", str(config), "--port", str(port)],
                                                  env=env, stdout=log, stderr=subprocess.STDOUT))
                result.gateways.append(procs[-1])
                result.urls.append(f"http://127.0.0.1:{port}")
                result.logs.append(log_path)
            for url, proc in zip(result.urls, result.gateways):
                wait_http_ok(f"{url}/ready", proc, 90, "a gateway replica")  # generous: a loaded 2-core CI
            env["LLM_GATEWAY_ADMIN_TOKEN"] = mint_token(Admin(), 600, secret=secret)
            yield result
        finally:
            stop_processes(procs)
