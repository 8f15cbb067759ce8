"""`llm-gateway demo` (what `make run` starts): the embedded default, with nothing to install or configure.

Three simulated vLLM servers run as child processes (two replicas of one model, one of another) and the gateway
serves them on 127.0.0.1:8080. Ctrl-C or SIGTERM stops all of it. The simulators stand in for GPUs here only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

from policies.config import Policy

log = logging.getLogger("gateway.demo")

DEMO_MODELS = [
    # public name, aliases, served name, replicas
    ("qwen3-4b", ["qwen"], "Qwen/Qwen3-4B", 2),
    ("llama-3.1-8b", ["llama"], "meta-llama/Llama-3.1-8B-Instruct", 1),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_simulators() -> tuple[list[subprocess.Popen], list[dict]]:
    procs, models = [], []
    for name, aliases, served, replicas in DEMO_MODELS:
        backends = []
        for i in range(replicas):
            port = free_port()
            cmd = [sys.executable, "-m", "backends.simulator", "--host", "127.0.0.1", "--port", str(port),
                   "--model", served, "--log-level", "warning"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
            backends.append({"name": f"{name}-sim-{i}", "url": f"http://127.0.0.1:{port}"})
        models.append({"name": name, "aliases": aliases, "served_name": served, "backends": backends})
    return procs, models


@contextlib.contextmanager
def quiet_httpx() -> Iterator[None]:
    """httpx logs every request it sends at INFO; a start-up probe that passed is a DEBUG line (as the gateway's
    own health checks log only a backend going down or coming back)."""
    logger = logging.getLogger("httpx")
    level = logger.level
    logger.setLevel(max(logging.WARNING, logger.getEffectiveLevel()))
    try:
        yield
    finally:
        logger.setLevel(level)


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    with quiet_httpx():
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulated backends did not start: {sorted(pending)}")
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a simulated backend exited during start-up")
            for url in list(pending):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        log.debug("simulated backend %s answered its health check", url)
                        pending.discard(url)
            time.sleep(0.1)


DEMO_LIMITS = {"requests_per_minute": 600, "tokens_per_minute": 200_000, "max_concurrent": 16}


async def issue_demo_key(store_path: str) -> str:
    """A key for the demo, written straight into the demo's store before the gateway opens it."""
    from policies.keys import KeyLimits, KeyRecord, hash_key, new_key, new_key_id
    from policies.store import open_store

    store = open_store("sqlite", path=store_path)
    key_id = new_key_id()
    key = new_key(key_id)
    try:
        await store.create_key(KeyRecord(id=key_id, name="demo", owner="make run", created_at=time.time(),
                                         hash=hash_key(key), limits=KeyLimits(**DEMO_LIMITS)))
    finally:
        await store.close()
    return key


def banner(base: str, key: str, admin_token: str) -> str:
    return f"""
llm-gateway demo: simulated vLLM backends behind the gateway at {base}
  models: {", ".join(f"{m[0]} ({m[3]} replica{'s' if m[3] > 1 else ''})" for m in DEMO_MODELS)}

  API key: {key}
  admin token (1 h, for /admin and `llm-gateway keys`): {admin_token}

  export OPENAI_API_KEY={key}
  curl {base}/v1/models -H "Authorization: Bearer $OPENAI_API_KEY"
  curl {base}/v1/chat/completions -H "Authorization: Bearer $OPENAI_API_KEY" -H 'content-type: application/json' \\
       -d '{{"model": "qwen3-4b", "messages": [{{"role": "user", "content": "Hello"}}], "stream": true}}'

  python -c 'from openai import OpenAI
  c = OpenAI(base_url="{base}/v1")  # reads OPENAI_API_KEY
  print(c.chat.completions.create(model="qwen3-4b", messages=[{{"role": "user", "content": "Hello"}}]))'

  also served (the README lists them all): /v1/responses, /v1/embeddings, /v1/messages (Anthropic),
  /tokenize, /rerank, /score, /pooling, /v1/audio/transcriptions and /translations, e.g.
  curl {base}/v1/audio/transcriptions -H "Authorization: Bearer $OPENAI_API_KEY" -F model=qwen3-4b -F file=@a.wav

  LLM_GATEWAY_ADMIN_TOKEN=<admin token> llm-gateway keys --url {base} list
  metrics: {base}/metrics   readiness: {base}/ready   API schema: {base}/schema   Ctrl-C stops everything.
"""


class Stop(Exception):
    """SIGTERM: end the demo as Ctrl-C does, simulators included. (uvicorn takes SIGTERM while it serves, then
    raises it again once it has shut down: with the default action that would end this process before it
    stops its simulators, leaving them running.)"""


def stop(_signum, _frame) -> None:
    raise Stop


def run_demo(host: str, port: int, log_level: str) -> int:
    import uvicorn

    from gateway.admin_auth import mint_token
    from gateway.app import create_app
    from gateway.logs import configure_logging
    from gateway.edge import uvicorn_options

    configure_logging(log_level)
    # The demo's admin secret lives only in this process unless the caller set one.
    os.environ.setdefault("LLM_GATEWAY_ADMIN_SECRET", secrets.token_urlsafe(32))
    state = tempfile.TemporaryDirectory(prefix="llm-gateway-demo-")
    signal.signal(signal.SIGTERM, stop)
    procs, models = start_simulators()
    try:
        wait_healthy([b["url"] for m in models for b in m["backends"]], procs)
        policy = Policy.model_validate({
            "listen": {"host": host, "port": port},
            "health": {"interval": 2},
            "store": {"kind": "sqlite", "path": f"{state.name}/keys.db"},
            "models": models,
        })
        key = asyncio.run(issue_demo_key(policy.store.path))
        admin_token = mint_token(policy.admin, 3600)
        config = uvicorn.Config(create_app(policy), host=host, port=port, log_level=log_level, access_log=False,
                                proxy_headers=False,  # the gateway decides whom to trust (network.trusted_proxies)
                                **uvicorn_options(policy.server))
        server = uvicorn.Server(config)
        print(banner(f"http://{host}:{port}", key, admin_token), flush=True)
        server.run()
    except (KeyboardInterrupt, Stop):  # Ctrl-C (or SIGTERM) is how the demo is meant to end
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        state.cleanup()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(run_demo("127.0.0.1", 8080, "info"))
