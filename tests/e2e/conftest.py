"""Two real `vllm serve` processes (CPU, tiny model) and a real gateway process in front, once per session.

  alpha -> vLLM A (served as tiny-a)        beta -> vLLM B (served as tiny-b)
  duo   -> both A and B: two replicas of one public model (each backend names its own served model)

Needs `scripts/setup_e2e.sh` (`make e2e-setup`; `make test` runs it). Without the vLLM venv or the model a bare
`pytest` skips these tests, naming that target, and `make test` fails them: a skipped end-to-end test is not a
passing one (tests/support/needs.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.needs import missing
from tests.support.probes import metric_sum, wait_http_ok
from tests.e2e.vllm_procs import (
    VLLMServer,
    default_model_dir,
    default_vllm_venv,
    free_port,
    kv_events_args,
    running_servers,
    start_many,
    stop_all,
)

REPO = Path(__file__).resolve().parents[2]
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
POOLING_ARGS = ("--runner", "pooling", "--convert", "embed")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
    # Sweeps run before every other end-to-end test: the shared servers below (and their gateway) start on
    # first use, so a sweep's server then has the machine's cores to itself instead of sharing one with a
    # shared server, and nobody pays for stopping and restarting those (~20-55 s each).
    sweeps = [item for item in items if item.get_closest_marker("sweep")]
    if sweeps:
        rest = [item for item in items if not item.get_closest_marker("sweep")]
        first_e2e = next((i for i, item in enumerate(rest) if "tests/e2e/" in str(item.fspath)), len(rest))
        items[:] = rest[:first_e2e] + sweeps + rest[first_e2e:]


def uses_pool(item) -> bool:
    """Whether the test needs the session's pooling server (pooling_server)."""
    return bool({"pooling", "batch_policy"} & set(getattr(item, "fixturenames", ())))


def need_vllm(also: Path | None = None) -> None:
    """The vLLM CPU venv and the tiny model (and `also`, a marker file of more that setup_e2e.sh makes)."""
    venv, model = default_vllm_venv(), default_model_dir()
    if not (venv / "bin" / "vllm").exists() or not (model / "config.json").exists() or (also and not also.exists()):
        missing(f"the vLLM CPU venv ({venv}) and the tiny model ({model})", "e2e-setup")


@pytest.fixture(autouse=True)
def _vllm_installed() -> None:
    """Every test here needs the vLLM CPU venv and the tiny model, whichever servers it starts."""
    need_vllm()


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory, request):
    need_vllm()
    model = default_model_dir()
    logs = tmp_path_factory.mktemp("vllm-logs")
    ports = (free_port(), free_port())
    servers = {
        # A also carries what the wider surface needs, so no extra generation server is started for it: tool
        # calls (auto tool choice, the hermes parser) and the Responses store (a stored response can be retrieved)
        # Both publish their KV cache events to a port of their own (test_kv_events_vllm.py binds them).
        "a": VLLMServer(model, "tiny-a", core=0, log_dir=logs, extra_args=TOOL_ARGS + kv_events_args(ports[0]),
                        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"}),
        "b": VLLMServer(model, "tiny-b", core=1, log_dir=logs, extra_args=kv_events_args(ports[1])),
    }
    for server, port in zip(servers.values(), ports):
        server.kv_events_port = port
    stop_capped()  # the sweeps ran first (pytest_collection_modifyitems); their server gives its core back
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the run's log shows each `vllm serve` starting
        items = request.session.items
        # The pooling server starts with them, when a test needs it: in the background it met every pause the
        # timing tests make and was still starting (a niced hog on core 1) when the canary guards judged TTFT
        pool = [pooling_server(request.config, tmp_path_factory)] if any(map(uses_pool, items)) else []
        # generous: on a busy 2-core machine two servers starting together have taken ~55 s each
        start_many([*servers.values(), *pool], timeout=240)
        if any("lora_vllms" in getattr(item, "fixturenames", ()) for item in items) \
                and (lora_adapters_dir() / ".lora-adapters-complete").exists():
            start_lora_servers(request.config, tmp_path_factory)  # warm up while the tests before theirs run
    yield servers
    stop_all(servers.values())


@contextlib.contextmanager
def others_paused(*keep: VLLMServer) -> Iterator[None]:
    """Every running server but `keep` paused (SIGSTOP) for the block, and resumed however it ends."""
    others = [other for other in running_servers() if other not in keep]
    for other in others:
        other.pause()
    try:
        yield
    finally:
        for other in others:
            other.resume()


def start_niced(server: VLLMServer) -> None:
    """Start `server` (not waited for) at nice 10, its whole process group: it warms up on the cores' idle time."""
    server.start()
    with contextlib.suppress(OSError):  # its own process group: the engine processes it spawns inherit it
        os.setpriority(os.PRIO_PGRP, server.proc.pid, 10)


@contextlib.contextmanager
def alone_on_core0(tmp_path_factory, name: str, extra_args: tuple[str, ...]) -> Iterator[VLLMServer]:
    """A vLLM of the test module's own (the tiny model served as `name` with `extra_args`) on core 0 alone: the
    shared servers, should any run, are paused while it does, and resumed however it ends."""
    need_vllm()
    model = default_model_dir()
    with others_paused():
        server = VLLMServer(model, name, core=0, extra_args=extra_args,
                            log_dir=tmp_path_factory.mktemp(f"vllm-{name}-logs"), log_requests=False)
        with started(server):
            yield server


# The `sweep` tests' server: `--max-num-seqs 8` (a knee within a CPU's reach) under vLLM's priority scheduler (the
# batch tests send priorities; requests without one are served in arrival order, as by the default scheduler).
CAPPED_ARGS = ("--scheduling-policy", "priority", "--max-num-seqs", "8")
_capped: list[VLLMServer] = []  # the one started, once per session


def stop_capped() -> None:
    """Stop the sweeps' server (the shared servers start after the sweeps; it must not share a core with them)."""
    stop_all(_capped)
    _capped.clear()


@pytest.fixture(scope="session", autouse=True)
def _stop_capped_at_the_end() -> Iterator[None]:
    yield
    stop_capped()


@pytest.fixture(scope="module")
def capped_vllm(tmp_path_factory, request):
    """The sweeps' server (CAPPED_ARGS) alone on core 0: one process for every module that asks for it (knee,
    caps, batch fill, scaling: ~15-30 s of start each saved), started on first use and stopped when the shared servers start;
    any other running server is paused while a module uses it. For `sweep` tests, which load it to saturation."""
    need_vllm()
    if not _capped or not _capped[0].is_running():
        stop_capped()
        server = VLLMServer(default_model_dir(), "tiny-knee", core=0, extra_args=CAPPED_ARGS,
                            log_dir=tmp_path_factory.mktemp("vllm-tiny-knee-logs"), log_requests=False)
        _capped.append(server)
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            server.start()
            server.wait_ready(240)
    with others_paused(_capped[0]):
        yield _capped[0]


@contextlib.contextmanager
def started(server: VLLMServer, timeout: float = 240) -> Iterator[VLLMServer]:
    """A server of the test's own: started, waited for (bounded), stopped however the test ends."""
    server.start()
    try:
        server.wait_ready(timeout)
        yield server
    finally:
        server.stop()


def pooling_server(config, tmp_path_factory) -> VLLMServer:
    """The tiny model as a pooling model on core 1, made once per session (not started) and stopped when the
    session ends. `vllm_servers` starts it with the shared servers when a test in the run needs it;
    `ready_pooling_server` starts it where that did not happen."""
    server = getattr(config, "_pooling_server", None)
    if server is None:
        server = VLLMServer(default_model_dir(), "tiny-pool", core=1,
                            log_dir=tmp_path_factory.mktemp("vllm-pool-logs"), extra_args=POOLING_ARGS)
        config._pooling_server = server
        config.add_cleanup(lambda: stop_all([server]))
    return server


def ready_pooling_server(config, tmp_path_factory) -> VLLMServer:
    """The pooling server, started if it is not running and waited for (bounded: a server that never answers
    fails the test, not the run)."""
    server = pooling_server(config, tmp_path_factory)
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        start_many([server], timeout=240)  # starts it unless it runs, waits for it, stops it if it never answers
    return server


LORA_ARGS = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8")


def lora_adapters_dir() -> Path:
    """The adapters scripts/build_lora_adapters.py builds for the tiny model (setup_e2e.sh)."""
    return default_model_dir().with_name(default_model_dir().name + "-loras")


def start_lora_servers(config, tmp_path_factory) -> dict[str, VLLMServer]:
    """test_lora_vllm.py's two servers (the tiny model with LORA_ARGS and run-time adapter loading, on cores 0 and
    1), started (not waited for) once per session, as the pooling server is: in the background, niced, as soon as
    the shared servers are ready, so their ~40 s start overlaps the tests before that module's instead of being
    waited for. The module stops them when it ends; the session's end stops them if it never ran."""
    servers = getattr(config, "_lora_servers", None)
    if servers is None:
        logs = tmp_path_factory.mktemp("vllm-lora-logs")
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        servers = {key: VLLMServer(default_model_dir(), f"tiny-lora-base-{key}", core=core, log_dir=logs,
                                   extra_args=LORA_ARGS, env=env)
                   for key, core in (("a", 0), ("b", 1))}
        config._lora_servers = servers
        config.add_cleanup(lambda: stop_all(servers.values()))
        for server in servers.values():
            start_niced(server)
    return servers


def e2e_policy(servers: dict[str, VLLMServer], port: int) -> dict:
    a, b = servers["a"], servers["b"]
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "health": {"interval": 1, "backoff_initial": 0.5, "backoff_max": 2},
        "timeouts": {"connect": 2, "read": 120},
        "models": [
            {"name": "alpha", "served_name": "tiny-a", "backends": [{"url": a.base_url, "name": "vllm-a"}]},
            {"name": "beta", "served_name": "tiny-b", "backends": [{"url": b.base_url, "name": "vllm-b"}]},
            {"name": "duo", "backends": [
                {"url": a.base_url, "name": "duo-a", "served_name": "tiny-a"},
                {"url": b.base_url, "name": "duo-b", "served_name": "tiny-b"},
            ]},
        ],
    }


class GatewayProcess:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path, key: str, mint=None) -> None:
        self.url, self.proc, self.log, self.key = url, proc, log, key
        self.mint = mint  # role -> an admin API token of that role

    def admin_token(self, role: str = "admin") -> str:
        return self.mint(role)

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(httpx.get(f"{self.url}/metrics").text, name, **labels)


@contextlib.contextmanager
def gateway_process(policy: dict, work: Path) -> Iterator[GatewayProcess]:
    """The gateway as users run it: `llm-gateway serve --config FILE` with `policy`, in its own process, with
    an app's key issued; stopped on exit. The policy's listen port must be free."""
    config = work / "policy.yaml"
    config.write_text(yaml.safe_dump(policy))
    log = work / "gateway.log"
    cli = str(Path(sys.executable).with_name("llm-gateway"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLM_GATEWAY_ADMIN_SECRET": secrets.token_urlsafe(32)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([cli, "serve", "--config", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                cwd=work, env=env)
    url = f"http://127.0.0.1:{policy['listen']['port']}"
    try:
        try:
            wait_http_ok(f"{url}/ready", proc, 30, "the gateway")
        except AssertionError as exc:
            pytest.fail(f"{exc}:\n" + log.read_text()[-3000:])
        # an app's key, issued the way an admin does it: a token from the CLI, then `keys create`
        def mint(role: str) -> str:
            return subprocess.run([cli, "admin-token", "--config", str(config), "--ttl", "1h", "--role", role],
                                  env=env, check=True, capture_output=True, text=True).stdout.strip()

        token = mint("admin")
        created = subprocess.run([cli, "keys", "--url", url, "--token", token, "--json", "create", "--name", "e2e"],
                                 check=True, capture_output=True, text=True)
        yield GatewayProcess(url, proc, log, json.loads(created.stdout)["key"], mint)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="session")
def gateway(vllm_servers, tmp_path_factory):
    with gateway_process(e2e_policy(vllm_servers, free_port()), tmp_path_factory.mktemp("gateway")) as gw:
        yield gw


@pytest.fixture(scope="session")
def pooling(tmp_path_factory, request):
    """The tiny model served as a pooling model (embeddings, /pooling, /score, /rerank) and a gateway in front
    (model `pool`): one more server, once per session, usually started already with the shared servers."""
    need_vllm()
    server = ready_pooling_server(request.config, tmp_path_factory)
    policy = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "health": {"interval": 1, "backoff_initial": 0.5, "backoff_max": 2},
        "timeouts": {"connect": 2, "read": 120},
        "models": [{"name": "pool", "served_name": "tiny-pool", "backends": [{"url": server.base_url}]}],
    }
    try:
        with gateway_process(policy, tmp_path_factory.mktemp("pool-gateway")) as gw:
            yield gw
    finally:
        stop_all([server])
