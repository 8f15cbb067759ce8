"""The container image (Containerfile), built by scripts/build_image.sh and run with podman.

The image serves a chat completion through the real `openai` SDK against a simulator on a loopback port
(host network), with a key issued by its own admin API; it holds no compiler, pip or cache; it runs as a
non-root user; `podman stop` (SIGTERM to the gateway as PID 1) ends it cleanly.

Skipped only when this machine cannot run a container at all: the fixture proves it by running one from the
base image, and the skip quotes what failed. A build that fails is a failure, not a skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.support.needs import missing
from tests.support.probes import wait_http_ok
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "scripts" / "build_image.sh"
# Field notes: podman's default runtime (crun) fails on this VM's cgroups, and without explicit ulimits the
# container cannot start (setrlimit is refused).
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
RUN = [*PODMAN, "run", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "--network", "host"]


def build(*args: str) -> str:
    """Run the build script; its last stdout line is the image reference."""
    done = subprocess.run([str(BUILD), *args], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"{BUILD.name} {' '.join(args)} failed:\n{done.stderr[-4000:]}"
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def image() -> str:
    try:
        subprocess.run([*PODMAN, "version"], capture_output=True, timeout=60)
    except FileNotFoundError:  # `make test` installs it (scripts/setup_containers.sh); bare pytest may not
        missing("podman, buildah and mmdebstrap", "container-setup")
    base = build("--base-only")
    probe = subprocess.run([*RUN, "--rm", base, "true"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"this machine cannot run containers: `podman run {base} true` exited {probe.returncode}: "
                    f"{probe.stderr.strip()[-1000:]}")
    started = time.monotonic()
    ref = build()
    print(f"image {ref} ready in {time.monotonic() - started:.0f} s")
    return ref


def inspect(ref: str) -> dict:
    out = subprocess.run([*PODMAN, "image", "inspect", ref], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)[0]


def test_image_is_lean_and_unprivileged(image):
    config = inspect(image)["Config"]
    assert config["User"] == "10001:10001"
    assert config["Cmd"] == ["llm-gateway", "serve", "--config", "/etc/llm-gateway/policy.yaml"]
    assert not any("SECRET" in e or "TOKEN" in e or "KEY" in e for e in config.get("Env", []))
    script = ("id -u; for t in gcc cc c++ make pip pip3; do command -v $t || true; done; "
              "ls -d /root/.cache /var/cache/apt/archives/*.deb /opt/llm-gateway/bin/pip* /src /dist 2>/dev/null; "
              "python3 -c 'import matplotlib' 2>/dev/null && echo matplotlib; "
              "/opt/llm-gateway/bin/python -c 'import gateway.cli, uvloop, httptools, orjson' && echo imports-ok")
    out = subprocess.run([*RUN, "--rm", image, "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["10001", "imports-ok"], out.stdout


@pytest.fixture
def simulator() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tools.simulator", "--port", str(port), "--model", "m",
                             "--log-level", "warning"])
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc, 60, "the simulator")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def gateway_container(image: str, policy: dict, tmp_path: Path, mounts: dict[str, Path] | None = None
                      ) -> Iterator[tuple[str, str, Path]]:
    """The image serving `policy` (plus `mounts`, container path -> host file, read-only) on the host's network:
    yields its URL, an API key its own admin API issued, and its log. On leaving, `podman stop` sends SIGTERM
    to the gateway, PID 1: it must drain and exit 0 by itself; no secret may reach the log."""
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy))
    volumes = []
    for target, source in {"/etc/llm-gateway/policy.yaml": policy_file, **(mounts or {})}.items():
        source.chmod(0o644)  # read by the image's own user
        volumes += ["-v", f"{source}:{target}:ro"]
    secret = secrets.token_urlsafe(32)
    name = f"llm-gateway-test-{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "container.log"
    # `-e NAME` passes the secret from this process's environment: never on a command line or in the image.
    command = [*RUN, "--name", name, *volumes, "-e", "LLM_GATEWAY_ADMIN_SECRET", image]
    with open(log_path, "wb") as log:
        container = subprocess.Popen(command, env={**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret},
                                     stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{policy['listen']['port']}"
    try:
        wait_http_ok(f"{url}/health", container, 120, "the gateway's container")
        token = mint_token(Admin(), 600, secret=secret)
        r = httpx.post(f"{url}/admin/keys", json={"name": "image-test"},
                       headers={"authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 201, r.text
        key = r.json()["key"]
        yield url, key, log_path

        stop = subprocess.run([*PODMAN, "stop", "--time", "30", name], capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert container.wait(60) == 0, log_path.read_text()[-3000:]
    finally:
        if container.poll() is None:
            subprocess.run([*PODMAN, "kill", name], capture_output=True, timeout=60)
            container.wait(60)
        subprocess.run([*PODMAN, "rm", "--force", "--ignore", name], capture_output=True, timeout=60)
    text = log_path.read_text()
    assert "SIGTERM: draining" in text, text[-3000:]
    assert key not in text and secret not in text and token not in text


def wait_ready(url: str, models: dict[str, bool], log_path: Path, timeout: float) -> None:
    """Until /ready says every model has a replica up (as `models`); a failure quotes the container's log."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/ready", timeout=10).json().get("models") != models:
        assert time.monotonic() < deadline, f"not ready after {timeout:g} s:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.2)


def base_policy(port: int) -> dict:
    return {
        "listen": {"host": "127.0.0.1", "port": port},  # the host's network: loopback is shared
        "server": {"drain_seconds": 1, "shutdown_timeout": 10},
        "health": {"interval": 0.5},
    }


def test_image_serves_a_chat_completion(image, simulator, tmp_path):
    policy = {**base_policy(free_port()), "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{simulator}"}]}]}
    with gateway_container(image, policy, tmp_path) as (url, key, log_path):
        wait_ready(url, {"m": True}, log_path, 60)
        client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=16)
        assert reply.model == "m" and reply.choices[0].message.content
        assert reply.usage.completion_tokens > 0
        chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=8, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "endpoint=chat/completions" in log_path.read_text()


async def test_image_discovers_replicas_with_the_kubernetes_and_kserve_clients(image, simulator, tmp_path):
    """The image carries the `discovery` extra: a policy whose models are a Service's EndpointSlices and a KServe
    InferenceService, read from kmock (a Kubernetes API server on the host's loopback) by the kubernetes client
    and the kserve SDK inside the container, gets both models served by the simulator behind them."""
    from kubernetes import client

    from tests.integration.test_discovery_kmock import NS, cluster, endpoint_slice, inference_service

    async with cluster() as (kubeconfig, api, _):
        slices = client.DiscoveryV1Api(api)
        for name, service in [("vllm-x1", "vllm"), ("chat-predictor-x1", "chat-predictor")]:
            await asyncio.to_thread(slices.create_namespaced_endpoint_slice, NS,
                                    endpoint_slice(name, service, ["127.0.0.1"], simulator))
        await asyncio.to_thread(client.CustomObjectsApi(api).create_namespaced_custom_object, "serving.kserve.io",
                                "v1beta1", NS, "inferenceservices", inference_service("chat", ready=True))
        policy = {
            **base_policy(free_port()),
            "kubernetes": {"kubeconfig": "/etc/llm-gateway/kubeconfig"},
            "models": [
                {"name": "k8s", "served_name": "m",
                 "discovery": {"kind": "kubernetes", "namespace": NS, "service": "vllm", "port": "http"}},
                {"name": "isvc", "served_name": "m",
                 "discovery": {"kind": "kserve", "namespace": NS, "inference_service": "chat"}},
            ],
        }

        def scenario() -> Path:
            mounts = {"/etc/llm-gateway/kubeconfig": Path(kubeconfig)}
            with gateway_container(image, policy, tmp_path, mounts) as (url, key, log_path):
                # both watches found the simulator; the kserve SDK's import alone takes seconds on a busy machine
                wait_ready(url, {"k8s": True, "isvc": True}, log_path, 180)
                client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
                for model in ("k8s", "isvc"):
                    reply = client.chat.completions.create(model=model, max_tokens=4,
                                                           messages=[{"role": "user", "content": "Hi"}])
                    assert reply.model == model and reply.usage.completion_tokens > 0
            return log_path

        text = (await asyncio.to_thread(scenario)).read_text()
    assert f"watching the endpoints of service {NS}/vllm" in text and f"watching inferenceservice {NS}/chat" in text
    assert "No module named" not in text and "Traceback" not in text, text[-3000:]
