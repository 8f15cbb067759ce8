"""Overload benchmark: the same load at twice a backend's knee, sent directly and through the gateway.

    python -m tests.benchmarks.overload                      # simulator configured like the talk's GPU (knee 32)
    python -m tests.benchmarks.overload --vllm [--cap N]     # a real CPU vLLM (the cap measured by `knee` if not given)

Three closed-loop runs of streaming requests (every request produces the same number of tokens):
  1. direct to the backend at the knee's concurrency: the reference TTFT p99 and peak throughput;
  2. direct to the backend at twice that: what happens without a gateway (TTFT blows up);
  3. through the gateway with cap = knee, at twice the concurrency: the backend keeps its at-knee latency and
     throughput; the excess waits in the gateway's queue (x-gateway-queue-ms). "Backend TTFT" there is the
     client's TTFT minus the time it waited in the gateway's queue, i.e. what the backend itself delivered.
Passes when, in run 3, backend TTFT p99 <= 1.5x run 1's, throughput >= 95% of the peak, and no request
failed except with a clean 429. Prints the runs side by side; exit status 1 when a check fails.

    python -m tests.benchmarks.overload --classes            # priority classes at twice the knee

With --classes, run 3 is replaced by two closed loops at once through the gateway, each at the knee's
concurrency (2x in all): one with a key of class `interactive`, one with a key of class `batch`. Interactive
requests are served first from the queue, so their client-side TTFT (queue included) stays near the at-knee
value while batch requests absorb the wait. Passes when interactive TTFT p99 <= 1.5x run 1's, the two
together keep >= 95% of the peak throughput, and batch waited longer in the queue than interactive.
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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.probes import wait_http_ok  # noqa: E402
from tests.support.servers import free_port  # noqa: E402


@dataclass
class Run:
    name: str
    concurrency: int
    ttft: list[float] = field(default_factory=list)  # client-side
    backend_ttft: list[float] = field(default_factory=list)  # minus the gateway's queue wait
    queued: list[float] = field(default_factory=list)  # the gateway's queue wait
    tokens: int = 0
    ok: int = 0
    refused: int = 0  # clean 429s
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    unanswered: dict = field(default_factory=dict)  # worker -> when its request, still without a response, began

    def p(self, values: list[float], q: float) -> float | None:
        if not values:
            return None
        v = sorted(values)
        return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def one(client: httpx.AsyncClient, url: str, body: bytes, headers: dict, run: Run, measuring,
              worker: int = 0) -> None:
    start = time.perf_counter()
    first = None
    tokens = 0
    run.unanswered[worker] = start
    async with client.stream("POST", f"{url}/v1/chat/completions", content=body, headers=headers) as r:
        run.unanswered.pop(worker, None)
        if r.status_code == 429:
            await r.aread()
            if measuring():
                run.refused += 1
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            return
        if r.status_code != 200:
            text = (await r.aread())[:200]
            if measuring():
                run.failed.append(f"HTTP {r.status_code}: {text!r}")
            return
        queued = float(r.headers.get("x-gateway-queue-ms", "0")) / 1000
        if measuring():
            run.queued.append(queued)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            choices = event.get("choices")
            if choices and (choices[0].get("delta") or {}).get("content"):
                if first is None:
                    first = time.perf_counter() - start
                if measuring():
                    tokens += 1
    if first is not None and measuring():
        run.ok += 1
        run.tokens += tokens
        run.ttft.append(first)
        run.backend_ttft.append(first - queued)


async def closed_loop(url: str, model: str, key: str | None, concurrency: int, output_tokens: int,
                      warmup: float, duration: float, name: str, spread: float = 0.0) -> Run:
    """`concurrency` streams, each sending its next request when the last ends. With `spread`, each request
    asks for output_tokens x (1 +- spread) tokens (seeded per stream), so the streams do not end in lockstep."""
    run = Run(name, concurrency)
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    t0 = time.perf_counter() + warmup
    t1 = t0 + duration
    measuring = lambda: t0 <= time.perf_counter() <= t1  # noqa: E731

    async def worker(i: int) -> None:
        n = 0
        lengths = random.Random(f"{name}-{i}")
        while time.perf_counter() < t1:
            n += 1
            tokens = round(output_tokens * (1 + spread * (2 * lengths.random() - 1)))
            body = orjson.dumps({"model": model, "max_tokens": tokens, "ignore_eos": True, "stream": True,
                                 "messages": [{"role": "user", "content": f"{i}-{n} " + "tell me a story " * 40}]})
            try:
                await one(client, url, body, headers, run, measuring, i)
            except httpx.HTTPError as exc:
                if measuring():
                    run.failed.append(type(exc).__name__)

    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits, trust_env=False) as client:
        tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        await asyncio.sleep(warmup + duration)
        for task in tasks:
            task.cancel()  # requests still running at the end do not count
        await asyncio.gather(*tasks, return_exceptions=True)
    # a request still waiting for its response at the end waited at least this long (a class held back entirely
    # by a better one has no other queue figure)
    run.queued += [t1 - began for began in run.unanswered.values() if began < t1]
    run.seconds = duration
    return run


def start_gateway(backend_url: str, model: str, cap: int, work: Path,
                  priority_class: str | None = None, extra: dict | None = None) -> tuple[subprocess.Popen, str, str]:
    """The gateway in front of the backend with `cap`; `extra`: more policy sections (the batch benchmark's)."""
    secret = secrets.token_urlsafe(32)
    port = free_port()
    policy = {
        "listen": {"port": port},
        "store": {"kind": "sqlite", "path": str(work / "keys.db")},
        "timeouts": {"read": 300},
        "models": [{"name": model, "backends": [{"url": backend_url, "cap": cap}],
                    "queue": {"max_depth": 10_000, "max_wait": 120}}],
        **(extra or {}),
    }
    (work / "policy.yaml").write_text(yaml.safe_dump(policy))
    env = {**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret}
    cli = str(Path(sys.executable).with_name("llm-gateway"))
    proc = subprocess.Popen([cli, "serve", "--config", str(work / "policy.yaml"), "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/ready", proc, 60, "the gateway")
    from gateway.admin.auth import mint_token
    from policies.config import Admin

    token = mint_token(Admin(), 600, secret=secret)
    proc.admin_token = token  # for more keys (--classes)
    return proc, url, issue_key(url, token, priority_class)


def issue_key(url: str, token: str, priority_class: str | None = None) -> str:
    r = httpx.post(f"{url}/admin/keys", json={"name": f"overload-{priority_class or 'default'}",
                                              "priority_class": priority_class},
                   headers={"authorization": f"Bearer {token}"})
    r.raise_for_status()
    return r.json()["key"]


def table(runs: list[Run]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:,.0f}"

    rows = [["run", "concurrency", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "backend TTFT p99 ms",
             "queue p99 ms", "ok", "429", "failed"]]
    for r in runs:
        rows.append([r.name, str(r.concurrency), f"{r.throughput:,.0f}", ms(r.p(r.ttft, 50)), ms(r.p(r.ttft, 99)),
                     ms(r.p(r.backend_ttft, 99)), ms(r.p(r.queued, 99)), str(r.ok), str(r.refused),
                     str(len(r.failed))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


async def measure(backend_url: str, model: str, cap: int, args, work: Path) -> list[Run]:
    runs = [await closed_loop(backend_url, model, None, cap, args.output_tokens, args.warmup, args.duration,
                              "direct, at the knee", args.spread),
            await closed_loop(backend_url, model, None, 2 * cap, args.output_tokens, args.warmup, args.duration,
                              "direct, 2x the knee", args.spread)]
    proc, url, key = start_gateway(backend_url, model, cap, work)
    try:
        if args.classes:
            batch = issue_key(url, proc.admin_token, "batch")
            runs += await asyncio.gather(
                closed_loop(url, model, key, cap, args.output_tokens, args.warmup, args.duration,
                            "gateway, interactive half of 2x", args.spread),
                closed_loop(url, model, batch, cap, args.output_tokens, args.warmup, args.duration,
                            "gateway, batch half of 2x", args.spread))
        else:
            runs.append(await closed_loop(url, model, key, 2 * cap, args.output_tokens, args.warmup, args.duration,
                                          "gateway (cap = knee), 2x", args.spread))
    finally:
        proc.terminate()
        proc.wait(10)
    return runs


def verdict(runs: list[Run]) -> list[tuple[str, bool]]:
    if len(runs) == 4:
        return class_verdict(runs)
    knee, direct2x, gw = runs
    ref = knee.p(knee.ttft, 99)
    peak = max(knee.throughput, direct2x.throughput)
    return [
        (f"gateway backend TTFT p99 <= 1.5x at-knee ({ref * 1500:,.0f} ms)", gw.p(gw.backend_ttft, 99) <= 1.5 * ref),
        (f"gateway throughput >= 95% of peak ({0.95 * peak:,.0f} tok/s)", gw.throughput >= 0.95 * peak),
        ("no failures but clean 429s through the gateway", not gw.failed),
        ("direct at 2x shows the blow-up (TTFT p99 > 1.5x at-knee)", direct2x.p(direct2x.ttft, 99) > 1.5 * ref),
    ]


def class_verdict(runs: list[Run]) -> list[tuple[str, bool]]:
    knee, direct2x, interactive, batch = runs
    ref = knee.p(knee.ttft, 99)
    peak = max(knee.throughput, direct2x.throughput)
    both = interactive.throughput + batch.throughput
    return [
        (f"interactive TTFT p99 (queue included) <= 1.5x at-knee ({ref * 1500:,.0f} ms)",
         interactive.p(interactive.ttft, 99) <= 1.5 * ref),
        (f"both classes together >= 95% of peak ({0.95 * peak:,.0f} tok/s)", both >= 0.95 * peak),
        ("no failures but clean 429s through the gateway", not interactive.failed and not batch.failed),
        ("batch absorbs the queue (its queue p99 > interactive's)",
         (batch.p(batch.queued, 99) or 0) > (interactive.p(interactive.queued, 99) or 0)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", action="store_true", help="a real CPU vLLM instead of the simulator")
    parser.add_argument("--max-num-seqs", type=int, help="with --vllm: vLLM's batch cap (a smaller knee)")
    parser.add_argument("--cap", type=int, help="the backend's knee (default: 32 for the simulator, measured for vLLM)")
    parser.add_argument("--duration", type=float,
                        help="measured seconds per run; default 60 with --classes (its p99 needs a few hundred"
                             " answers per class), else 20")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--classes", action="store_true",
                        help="through the gateway, half the load interactive and half batch")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--spread", type=float,
                        help="each request asks for output tokens x (1 +- spread); default 0.5 with --classes (streams"
                             " of one length end in lockstep, and a class cannot go first when every slot frees at"
                             " once), else 0")
    args = parser.parse_args()
    if args.spread is None:
        args.spread = 0.5 if args.classes else 0.0
    if args.duration is None:
        args.duration = 60.0 if args.classes else 20.0
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        work = Path(tmp)
        if args.vllm:
            runs, label = run_vllm(args, work)
        else:
            runs, label = run_simulator(args, work)
    print(f"\n{label}\n\n{table(runs)}\n")
    checks = verdict(runs)
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": label, "runs": [r.__dict__ for r in runs],
                                               "checks": checks}, default=str, indent=2))
    return 0 if all(ok for _, ok in (checks if args.classes else checks[:3])) else 1


def run_simulator(args, work: Path) -> tuple[list[Run], str]:
    cap = args.cap or 32
    port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "tools.simulator", "--port", str(port), "--model", "sim",
                            "--preset", "reference-gpu", "--log-level", "warning"], cwd=REPO)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", sim, 30, "the simulator")
        runs = asyncio.run(measure(f"http://127.0.0.1:{port}", "sim", cap, args, work))
    finally:
        sim.terminate()
        sim.wait(10)
    return runs, f"simulator, reference-GPU preset (knee {cap}), {args.output_tokens} output tokens"


def run_vllm(args, work: Path) -> tuple[list[Run], str]:
    from tests.e2e.vllm_procs import VLLMServer

    extra = ("--max-num-seqs", str(args.max_num_seqs)) if args.max_num_seqs else ()
    server = VLLMServer(served_model_name="tiny", core=0, log_dir=work, extra_args=extra)
    server.start()
    try:
        server.wait_ready(180)
        cap = args.cap or measured_cap(server.base_url)
        runs = asyncio.run(measure(server.base_url, "tiny", cap, args, work))
    finally:
        server.stop()
    seqs = f", --max-num-seqs {args.max_num_seqs}" if args.max_num_seqs else ""
    return runs, f"real vLLM (CPU, one core{seqs}; cap {cap}), {args.output_tokens} output tokens"


def measured_cap(url: str) -> int:
    from tools.knee.analysis import find_knee
    from tools.knee.report import points
    from tools.knee.run import run_sweep
    from tools.knee.sweep import SweepSpec

    spec = SweepSpec(url=url, model="tiny", levels=(1, 2, 4, 8, 16, 32, 64), output_tokens=32, duration=3,
                     warmup=1)
    result = asyncio.run(run_sweep(spec))
    knee = find_knee(points(result.levels))
    print(f"measured knee: {knee}", flush=True)
    if knee.recommended is None:
        raise SystemExit(f"no knee found: {knee.reason}")
    return knee.recommended


if __name__ == "__main__":
    sys.exit(main())
