"""LoRA benchmark: adapter-affine against adapter-blind routing on the same two real CPU vLLM servers.

    python -m tests.benchmarks.lora                     # what `make bench-lora` runs (~4 min)
    python -m tests.benchmarks.lora --requests 300 --rounds 1 --workers 6

Two `vllm serve` processes of the tiny model (scripts/build_tiny_model.py), each pinned to its own core, run
with `--enable-lora --max-loras N --max-lora-rank 8` and run-time loading; the three adapters of
scripts/build_lora_adapters.py are declared on one model of a real `llm-gateway serve` with `lora.max_loras: N`
(--max-loras, default 1: two slots in all for three adapters, so the gateway must choose what to unload). The
gateway is started afresh for each profile and round, after both servers' adapters are unloaded (each run starts
cold), with `routing: {default_profile: P}`:
- default: adapter-affine (lora-affinity 8, then prefix-affinity, vllm-queue, least-in-flight);
- least-in-flight: adapter-blind (the replica with the fewest requests in flight, loading wherever it lands).

The workload (seeded, the same under every profile): --workers closed-loop clients send --requests streamed chat
requests in all (--max-tokens tokens, ignore_eos), each naming one model drawn from a skewed mix (--mix: the
base and the three adapters), with a think time uniform in --think seconds between two of a worker's requests.
Per profile: requests, errors, TTFT p50/p99 (client side, through the gateway), the gateway's adapter loads and
unloads (llm_gateway_lora_events_total) and the wall time. Results go to .cache/bench/lora-<time>.json. The
rounds alternate the profiles (A B A B ...) so a drift of the machine falls on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.e2e.vllm_procs import VLLMServer, default_model_dir, free_port, start_many, stop_all
from tests.support.probes import metric_sum, wait_http_ok

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = ("tiny-lora-a", "tiny-lora-b", "tiny-lora-c")
BASE = "tiny-lora-base"
PROFILES = ("default", "least-in-flight")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="per profile and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=1, help="vLLM's --max-loras and the policy's max_loras")
    parser.add_argument("--mix", default="0.1,0.5,0.25,0.15", help="shares of the base and the three adapters")
    parser.add_argument("--think", default="0,0.2", help="seconds between two requests of a worker (min,max)")
    parser.add_argument("--seed", type=int, default=7)
    return parser.parse_args(argv)


def gateway(servers: list[VLLMServer], profile: str, work: Path, args: argparse.Namespace) -> tuple:
    loras = default_model_dir().with_name(default_model_dir().name + "-loras")
    port = free_port()
    policy = {
        "listen": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": str(work / f"keys-{profile}-{port}.db")},
        "timeouts": {"read": 300},
        "routing": {"default_profile": profile},
        "models": [{"name": BASE, "queue": {"max_depth": 10_000, "max_wait": 300},
                    "backends": [{"url": s.base_url, "name": f"vllm-{i}", "served_name": s.served_model_name}
                                 for i, s in enumerate(servers)],
                    "lora": {"adapters": [{"name": a, "path": str(loras / a)} for a in ADAPTERS],
                             "max_loras": args.max_loras, "refresh_seconds": 1, "load_timeout": 120}}],
    }
    path = work / f"policy-{profile}-{port}.yaml"
    path.write_text(yaml.safe_dump(policy))
    secret = secrets.token_urlsafe(32)
    cli = Path(sys.executable).with_name("llm-gateway")
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "gateway"]
    log = open(work / f"gateway-{profile}-{port}.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([*command, "serve", "--config", str(path), "--log-level", "warning"],
                            env={**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret}, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/ready", proc, 60, "the gateway")
    from gateway.admin.auth import mint_token
    from policies.config import Admin

    token = mint_token(Admin(), 600, secret=secret)
    r = httpx.post(f"{url}/admin/keys", json={"name": "bench-lora"}, headers={"authorization": f"Bearer {token}"},
                   trust_env=False)
    r.raise_for_status()
    return proc, url, r.json()["key"]


def unload_all(servers: list[VLLMServer]) -> None:
    for server in servers:
        data = httpx.get(f"{server.api_base}/models", timeout=30, trust_env=False).json()["data"]
        for entry in data:
            if entry.get("parent"):
                httpx.post(f"{server.api_base}/unload_lora_adapter", json={"lora_name": entry["id"]}, timeout=30,
                           trust_env=False)


def plan(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(model, think time before it) for every request, seeded."""
    rng = random.Random(args.seed)
    shares = [float(x) for x in args.mix.split(",")]
    low, high = (float(x) for x in args.think.split(","))
    models = (BASE, *ADAPTERS)
    return [(rng.choices(models, shares)[0], rng.uniform(low, high)) for _ in range(args.requests)]


async def run(url: str, key: str, requests: list[tuple[str, float]], args: argparse.Namespace) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)
    records: list[dict] = []

    async def one(client: httpx.AsyncClient, model: str) -> dict:
        body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the standard library"}],
                "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}
        started = time.perf_counter()
        ttft = None
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                return {"model": model, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    ttft = time.perf_counter() - started
        return {"model": model, "ttft": ttft, "e2e": time.perf_counter() - started}

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            while True:
                try:
                    model, think = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await asyncio.sleep(think)
                try:
                    records.append(await one(client, model))
                except httpx.HTTPError as exc:
                    records.append({"model": model, "error": f"{type(exc).__name__}: {exc}"})

    await asyncio.gather(*(worker() for _ in range(args.workers)))
    return records


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(profile: str, records: list[dict], wall: float, metrics: str) -> dict:
    ttfts = [r["ttft"] for r in records if r.get("ttft") is not None]
    adapter_ttfts = [r["ttft"] for r in records if r.get("ttft") is not None and r["model"] != BASE]
    return {
        "profile": profile, "requests": len(records), "errors": sum(1 for r in records if "error" in r),
        "ttft_p50_ms": _ms(pct(ttfts, 50)), "ttft_p99_ms": _ms(pct(ttfts, 99)),
        "adapter_ttft_p50_ms": _ms(pct(adapter_ttfts, 50)), "adapter_ttft_p99_ms": _ms(pct(adapter_ttfts, 99)),
        "loads": metric_sum(metrics, "llm_gateway_lora_events_total", event="load"),
        "unloads": metric_sum(metrics, "llm_gateway_lora_events_total", event="unload"),
        "wall_s": round(wall, 1), "req_per_s": round(len(records) / wall, 2),
        "first_errors": [r["error"] for r in records if "error" in r][:3],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = REPO / ".cache" / "bench" / f"lora-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True, exist_ok=True)
    lora_args = ("--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", "8")
    servers = [VLLMServer(default_model_dir(), f"{BASE}-{i}", core=i, log_dir=work, extra_args=lora_args,
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, log_requests=False) for i in (0, 1)]
    requests = plan(args)
    results = []
    try:
        start_many(servers, timeout=240)
        for round_ in range(args.rounds):
            for profile in PROFILES if round_ % 2 == 0 else reversed(PROFILES):
                unload_all(servers)
                proc, url, key = gateway(servers, profile, work, args)
                try:
                    started = time.perf_counter()
                    records = asyncio.run(run(url, key, requests, args))
                    wall = time.perf_counter() - started
                    metrics = httpx.get(f"{url}/metrics", trust_env=False, timeout=30).text
                finally:
                    proc.terminate()
                    proc.wait(15)
                result = {"round": round_ + 1, **summary(profile, records, wall, metrics)}
                results.append(result)
                print(json.dumps(result), flush=True)
    finally:
        stop_all(servers)
    out = REPO / ".cache" / "bench" / f"{work.name}.json"
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print("\n| profile | round | requests | errors | TTFT p50 / p99 ms | adapters' TTFT p50 / p99 ms | loads |"
          " unloads | req/s |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['profile']} | {r['round']} | {r['requests']} | {r['errors']} | {r['ttft_p50_ms']} /"
              f" {r['ttft_p99_ms']} | {r['adapter_ttft_p50_ms']} / {r['adapter_ttft_p99_ms']} | {r['loads']:.0f} |"
              f" {r['unloads']:.0f} | {r['req_per_s']} |")
    print(f"results: {out}")
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
