"""`llm-gateway demo` (what `make run` starts): the embedded default, with nothing to install or configure, and
enough of the product switched on to look at.

Simulated vLLM servers run as child processes and the gateway serves them on 127.0.0.1:8080:
- qwen3-4b: two replicas, each capped at its knee (DEMO_CAP) behind a queue, so /scaling and
  llm_gateway_replicas_needed move under load; it carries a LoRA adapter (qwen3-4b-support, loaded on demand), and
  it overflows to a rented provider, which here is one more simulator on loopback that checks its own key (read
  from an environment variable the demo sets, as a real provider's is);
- llama-3.1-8b: two variants, the baseline and a canary at a small weight, under the variant guard;
- two API keys, one per data policy: `private_only` traffic never leaves the owned replicas, `allow_rented`
  spills to the rented provider when the queue would wait too long;
- the admin console at /console, signed in with the admin token the demo prints.
`--traffic` adds a light, steady mix of calls with a burst every few seconds (DemoTraffic), so that each console
page has something to show within a minute. Ctrl-C or SIGTERM stops all of it. The simulators stand in for GPUs
here only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from policies.config import Policy

log = logging.getLogger("gateway.demo")

QWEN, LLAMA, ADAPTER = "qwen3-4b", "llama-3.1-8b", "qwen3-4b-support"
QWEN_SERVED, LLAMA_SERVED = "Qwen/Qwen3-4B", "meta-llama/Llama-3.1-8B-Instruct"
RENTED_SERVED = "rented/qwen3-4b"  # the provider's own name for the model
RENTED_KEY_ENV = "LLM_GATEWAY_DEMO_RENTED_KEY"  # the rented provider's key, as a real one would be given
DEMO_CAP = 4  # in flight per replica: the knee the simulators are given (a real one is measured by `knee`)
CANARY_WEIGHT = 10  # the canary variant's share of llama-3.1-8b, in percent
# 20 ms a decode step (~50 tokens/s a stream, as an 8B model on one GPU): a call takes about a second, so a
# burst queues at the caps and the rented overflow has something to do, at little CPU per call
SIM_FLAGS = ["--step-base-ms", "20", "--max-num-seqs", "32"]


@dataclass(frozen=True, slots=True)
class Sim:
    """One simulated vLLM server the demo starts."""

    name: str
    served: str
    lora: bool = False
    api_key_env: str | None = None  # passed to it as VLLM_API_KEY (vLLM's own variable)


SIMS = [  # (owner: a model, a variant of one, or the rented provider)
    (QWEN, Sim(f"{QWEN}-sim-0", QWEN_SERVED, lora=True)),
    (QWEN, Sim(f"{QWEN}-sim-1", QWEN_SERVED, lora=True)),
    (f"{LLAMA}/baseline", Sim(f"{LLAMA}-baseline-0", LLAMA_SERVED)),
    (f"{LLAMA}/canary", Sim(f"{LLAMA}-canary-0", LLAMA_SERVED)),
    ("rented", Sim("rented-sim", RENTED_SERVED, api_key_env=RENTED_KEY_ENV)),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_simulators() -> tuple[list[subprocess.Popen[bytes]], dict[str, list[dict[str, Any]]]]:
    """Every simulator at once (they start in parallel); returns the processes and each owner's backends."""
    procs: list[subprocess.Popen[bytes]] = []
    owners: dict[str, list[dict[str, Any]]] = {}
    for owner, sim in SIMS:
        port = free_port()
        cmd = [sys.executable, "-m", "tools.simulator", "--host", "127.0.0.1", "--port", str(port),
               "--model", sim.served, "--log-level", "warning", *SIM_FLAGS, *(["--enable-lora"] if sim.lora else [])]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
        if sim.api_key_env:
            env["VLLM_API_KEY"] = os.environ[sim.api_key_env]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env))
        owners.setdefault(owner, []).append({"name": sim.name, "url": f"http://127.0.0.1:{port}"})
    return procs, owners


def demo_policy(host: str, port: int, state_dir: str, owners: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The demo's policy file, as a dict (`llm-gateway check` reads the same shape from YAML)."""
    cost = {"per_hour": 2.5}  # one GPU's rent, for the own-or-rent report

    def owned(backends: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**b, "cap": DEMO_CAP, "cost": cost} for b in backends]

    rented = owners["rented"][0]["url"]
    return {
        "listen": {"host": host, "port": port},
        "health": {"interval": 2},
        "store": {"kind": "sqlite", "path": f"{state_dir}/keys.db"},
        "ledger": {"report_every_seconds": 5},
        # Secure cookies reach a browser over plain HTTP on loopback only; a demo listening wider serves HTTP
        "console": {"enabled": True, "secure_cookie": host in ("127.0.0.1", "localhost", "::1")},
        "providers": [{
            "name": "rented", "base_url": f"{rented}/v1", "api_key_env": RENTED_KEY_ENV,
            "models": {QWEN: RENTED_SERVED}, "price_per_million_tokens": {"input": 0.6, "output": 2.4},
            "allow_private_address": True,  # a stand-in on loopback; a real provider is a public address
        }],
        "models": [
            {"name": QWEN, "aliases": ["qwen"], "served_name": QWEN_SERVED, "backends": owned(owners[QWEN]),
             "queue": {"max_depth": 64, "max_wait": 20},
             "overflow": {"provider": "rented", "when_wait_exceeds": 0.5},
             "autoscaling": {"smoothing_seconds": 15},
             "lora": {"adapters": [{"name": ADAPTER, "path": f"{state_dir}/adapters/support"}], "max_loras": 2}},
            {"name": LLAMA, "aliases": ["llama"], "served_name": LLAMA_SERVED,
             "queue": {"max_depth": 64, "max_wait": 20},
             "autoscaling": {"smoothing_seconds": 15},
             "variants": [
                 {"name": "baseline", "weight": 100 - CANARY_WEIGHT, "backends": owned(owners[f"{LLAMA}/baseline"])},
                 {"name": "canary", "weight": CANARY_WEIGHT, "backends": owned(owners[f"{LLAMA}/canary"])},
             ],
             "guard": {"baseline": "baseline", "min_samples": 20}},
        ],
    }


def write_adapter(state_dir: str) -> None:
    """The adapter's directory, as vLLM reads one (the simulator checks only that adapter_config.json is there)."""
    folder = Path(state_dir, "adapters", "support")
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                             "base_model_name_or_path": QWEN_SERVED}))


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


def wait_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
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
DATA_POLICIES = ("private_only", "allow_rented")


async def issue_demo_keys(store_path: str) -> dict[str, str]:
    """One key per data policy, written straight into the demo's store before the gateway opens it."""
    from policies.keys import KeyLimits, KeyRecord, hash_key, new_key, new_key_id
    from policies.store import open_store

    store = open_store("sqlite", path=store_path)
    keys = {}
    try:
        for data_policy in DATA_POLICIES:
            key_id = new_key_id()
            keys[data_policy] = new_key(key_id)
            await store.create_key(KeyRecord(id=key_id, name=f"demo {data_policy}", owner="make run",
                                             created_at=time.time(), hash=hash_key(keys[data_policy]),
                                             data_policy=data_policy, limits=KeyLimits(**DEMO_LIMITS)))
    finally:
        await store.close()
    return keys


def banner(base: str, keys: dict[str, str], admin_token: str, traffic: bool) -> str:
    key, renter = keys["private_only"], keys["allow_rented"]
    load = ("sending a light mix of calls now (--traffic): every console page fills within a minute" if traffic
            else "`llm-gateway demo --traffic` (make run ARGS=--traffic) sends a light mix of calls to fill them")
    return f"""
llm-gateway demo: simulated vLLM backends behind the gateway at {base}
  models: {QWEN} (2 replicas, cap {DEMO_CAP} each, then a queue; LoRA adapter {ADAPTER}; overflow: rented)
          {LLAMA} (variants: baseline {100 - CANARY_WEIGHT} %, canary {CANARY_WEIGHT} %, under the variant guard)
  rented provider: one more simulator on loopback standing in for a public API (its key in ${RENTED_KEY_ENV})

  console: {base}/console
  admin token (8 h; paste it to sign in to the console; also for /admin and `llm-gateway keys`): {admin_token}
  pages: Fleet (replicas, caps, queues), Usage, Own or rent, Variants, Keys; {load}

  API keys, one per data policy:
  private_only key: {key}
      only ever served by the owned replicas: under a burst it waits in the queue
  allow_rented key: {renter}
      spills to the rented provider when the queue would wait over 0.5 s (x-gateway-served-by: rented)

  export OPENAI_API_KEY={key}
  curl {base}/v1/models -H "Authorization: Bearer $OPENAI_API_KEY"
  curl {base}/v1/chat/completions -H "Authorization: Bearer $OPENAI_API_KEY" -H 'content-type: application/json' \\
       -d '{{"model": "{QWEN}", "messages": [{{"role": "user", "content": "Hello"}}], "stream": true}}'
  (the adapter is a model of its own: "model": "{ADAPTER}"; the variant that answered {LLAMA} is in the
   x-gateway-variant response header: curl -i ...)

  python -c 'from openai import OpenAI
  c = OpenAI(base_url="{base}/v1")  # reads OPENAI_API_KEY
  print(c.chat.completions.create(model="{QWEN}", messages=[{{"role": "user", "content": "Hello"}}]))'

  also served (the README lists them all): /v1/responses, /v1/embeddings, /v1/messages (Anthropic),
  /tokenize, /rerank, /score, /pooling, /v1/audio/transcriptions and /translations, e.g.
  curl {base}/v1/audio/transcriptions -H "Authorization: Bearer $OPENAI_API_KEY" -F model={QWEN} -F file=@a.wav

  LLM_GATEWAY_ADMIN_TOKEN=<admin token> llm-gateway keys --url {base} list
  replicas needed at the knee: {base}/scaling   metrics: {base}/metrics   readiness: {base}/ready
  API schema: {base}/schema   Ctrl-C stops everything.
"""


class DemoTraffic:
    """`--traffic`: a light, bounded, steady mix of calls from a thread of its own, for the console to show.

    Two callers, one per key, each one call at a time with a pause between (chat and streams on {QWEN}, the
    adapter, {LLAMA}'s variants), and every BURST_EVERY seconds a burst of BURST calls on {QWEN}, twice what
    its replicas' caps admit: the queue forms, the scaling signal rises, and the allow_rented key's share of
    the burst goes to the rented provider while the private_only key's waits. About three calls a second.
    """

    BURST_EVERY = 15.0
    BURST = 4 * DEMO_CAP
    PAUSE = 0.4
    REPORT_EVERY = 60.0

    def __init__(self, base: str, keys: dict[str, str]):
        self.base, self.keys = base, keys
        self.stopping = threading.Event()
        self.counts = {"owned": 0, "rented": 0, "failed": 0}
        self.thread = threading.Thread(target=self._run, name="demo-traffic", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        # its own calls are not news: the gateway's access log already has a line for each
        logging.getLogger("httpx").setLevel(logging.WARNING)
        asyncio.run(self._main())

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=2 * self.BURST)
        async with httpx.AsyncClient(base_url=self.base, timeout=60, limits=limits) as http:
            if not await self._ready(http):
                return
            tasks = [asyncio.create_task(self._caller(http, data_policy)) for data_policy in DATA_POLICIES]
            tasks += [asyncio.create_task(self._bursts(http)), asyncio.create_task(self._reports())]
            try:
                while not self.stopping.is_set():
                    await asyncio.sleep(0.2)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _ready(self, http: httpx.AsyncClient) -> bool:
        for _ in range(600):  # a minute at most
            if self.stopping.is_set():
                return False
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get("/ready")).status_code == 200:
                    return True
            await asyncio.sleep(0.1)
        log.warning("demo traffic: the gateway never became ready; sending nothing")
        return False

    async def _call(self, http: httpx.AsyncClient, data_policy: str, model: str, stream: bool = False,
                    max_tokens: int = 24) -> None:
        body = {"model": model, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"demo traffic for {model}: say something"}]}
        headers = {"authorization": f"Bearer {self.keys[data_policy]}"}
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
                await reply.aread()
                served_by = reply.headers.get("x-gateway-served-by", "owned")
                self.counts[served_by if reply.status_code == 200 else "failed"] += 1
        except httpx.HTTPError:
            self.counts["failed"] += 1

    async def _caller(self, http: httpx.AsyncClient, data_policy: str) -> None:
        mix = itertools.cycle([(QWEN, False), (ADAPTER, True), (LLAMA, True), (QWEN, True), (LLAMA, False)])
        for model, stream in mix:
            await self._call(http, data_policy, model, stream)
            await asyncio.sleep(self.PAUSE)

    async def _bursts(self, http: httpx.AsyncClient) -> None:
        await asyncio.sleep(2.0)
        while True:
            await asyncio.gather(*(self._call(http, DATA_POLICIES[i % 2], QWEN, stream=i % 3 == 0, max_tokens=48)
                                   for i in range(self.BURST)))
            await asyncio.sleep(self.BURST_EVERY)

    async def _reports(self) -> None:
        while True:
            await asyncio.sleep(self.REPORT_EVERY)
            log.info("demo traffic so far: %d calls served by the owned replicas, %d rented, %d failed",
                     self.counts["owned"], self.counts["rented"], self.counts["failed"])


class Stop(Exception):
    """SIGTERM: end the demo as Ctrl-C does, simulators included. (uvicorn takes SIGTERM while it serves, then
    raises it again once it has shut down: with the default action that would end this process before it
    stops its simulators, leaving them running.)"""


def stop(_signum: int, _frame: FrameType | None) -> None:
    raise Stop


def run_demo(host: str, port: int, log_level: str, traffic: bool = False) -> int:
    import uvicorn

    from gateway.admin.auth import mint_token
    from gateway.app import create_app
    from gateway.http.edge import uvicorn_options
    from gateway.logs import configure_logging

    configure_logging(log_level)
    # The demo's admin secret and the rented stand-in's key live only in this process (and its children)
    # unless the caller set them.
    os.environ.setdefault("LLM_GATEWAY_ADMIN_SECRET", secrets.token_urlsafe(32))
    os.environ.setdefault(RENTED_KEY_ENV, "rk-" + secrets.token_urlsafe(24))
    state = tempfile.TemporaryDirectory(prefix="llm-gateway-demo-")
    signal.signal(signal.SIGTERM, stop)
    procs, owners = start_simulators()
    load = None
    try:
        write_adapter(state.name)
        wait_healthy([b["url"] for backends in owners.values() for b in backends], procs)
        policy = Policy.model_validate(demo_policy(host, port, state.name, owners))
        keys = asyncio.run(issue_demo_keys(policy.store.path))
        admin_token = mint_token(policy.admin, 8 * 3600)
        config = uvicorn.Config(create_app(policy), host=host, port=port, log_level=log_level, access_log=False,
                                proxy_headers=False,  # the gateway decides whom to trust (network.trusted_proxies)
                                **uvicorn_options(policy.server))
        server = uvicorn.Server(config)
        print(banner(f"http://{host}:{port}", keys, admin_token, traffic), flush=True)
        if traffic:
            load = DemoTraffic(f"http://{host}:{port}", keys)
            load.start()
        server.run()
    except (KeyboardInterrupt, Stop):  # Ctrl-C (or SIGTERM) is how the demo is meant to end
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        if load is not None:
            load.stop()
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
