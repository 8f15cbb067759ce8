"""Batch fill benchmark: a Batch API batch of thousands of lines beside an interactive load, through one gateway.

    python -m tests.benchmarks.batch_fill                    # the simulator configured like the talk's GPU (knee 32)
    python -m tests.benchmarks.batch_fill --vllm             # a real CPU vLLM (tiny model, one core)

Three runs, each `--duration` seconds after `--warmup`:
  1. interactive alone: a closed loop of streaming chat at `--interactive` concurrency, below the backend's cap,
     so the backend has idle capacity: the reference TTFT p50 and p99, and from the own-or-rent report the
     backend's utilisation (time with a request in flight) and fill (requests in flight on average against its
     cap);
  2. a batch of `--lines` lines (submitted with the openai SDK) alone: its lines per second and fill, within
     the slots the model's `queue.reserve` leaves it (`--reserve`; default the policy's, an eighth of the cap);
  3. the same interactive load while the batch goes on: TTFT p50 and p99 again, the batch's lines per second
     beside it, and the share of the capacity the interactive load leaves idle (1 - its fill alone) that the
     batch fills (the fill's rise over run 1), beside the most the reserve lets it fill.
Passes when interactive TTFT p50 and p99 beside the batch stay within `--bound` x their values alone, the batch
fills at least `--fill` of the idle capacity, and no interactive request failed. Prints a table; exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
import os
import secrets
import tempfile
import time
from pathlib import Path

import httpx
import openai
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from policies.admission import reserve_for  # noqa: E402
from tests.benchmarks.overload import closed_loop, issue_key  # noqa: E402
from tests.support.probes import wait_http_ok  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

BUCKET = 5  # ledger seconds per bucket: the report's windows line up with the runs


def start_gateway(backend_url: str, model: str, cap: int, work: Path, concurrency: int, reserve: int | None):
    """The gateway as overload.start_gateway starts it, with the batch settings and the model's reserve."""
    secret, port = secrets.token_urlsafe(32), free_port()
    queue = {"max_depth": 10_000, "max_wait": 120, **({} if reserve is None else {"reserve": reserve})}
    policy = {"listen": {"port": port}, "store": {"kind": "sqlite", "path": str(work / "keys.db")},
              "timeouts": {"read": 300}, "ledger": {"bucket_seconds": BUCKET},
              "models": [{"name": model, "backends": [{"url": backend_url, "cap": cap}], "queue": queue}],
              "batch": {"files_dir": str(work / "files"), "concurrency": concurrency, "max_in_flight": concurrency,
                        "poll_seconds": 0.5}}
    (work / "policy.yaml").write_text(yaml.safe_dump(policy))
    cli = str(Path(sys.executable).with_name("llm-gateway"))
    proc = subprocess.Popen([cli, "serve", "--config", str(work / "policy.yaml"), "--log-level", "warning"],
                            env={**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/ready", proc, 60, "the gateway")
    from gateway.admin_auth import mint_token
    from policies.config import Admin

    token = mint_token(Admin(), 600, secret=secret)
    return proc, url, token, issue_key(url, token)


def utilisation(url: str, token: str, model: str, since: float, until: float) -> tuple[float, float]:
    """(utilisation, batch fill) of the model over the run: the time its backend had a request in flight, and
    the requests in flight on average against its cap (the own-or-rent report's figures)."""
    start = int(since // BUCKET + 1) * BUCKET  # whole buckets inside the run
    end = int(until // BUCKET) * BUCKET
    r = httpx.get(f"{url}/admin/report", params={"window": max(BUCKET, end - start), "until": end},
                  headers={"authorization": f"Bearer {token}"}, timeout=30)
    r.raise_for_status()
    figures = r.json()["models"][model]
    return figures["utilisation"], figures["batch_fill"]


def batch_lines(count: int, model: str, output_tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "max_tokens": output_tokens, "ignore_eos": True,
                                         "messages": [{"role": "user", "content": f"summarise document {n} " * 20}]}
                                }).encode() + b"\n" for n in range(count))


def rate_between(counts: list[tuple[float, int]], since: float, until: float) -> float:
    """Lines answered per second between two times, from the (time, lines answered) samples."""
    window = [(t, n) for t, n in counts if since <= t <= until]
    return (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]) if len(window) > 1 else 0.0


async def measure(backend_url: str, model: str, cap: int, args, work: Path) -> dict:
    proc, url, token, key = start_gateway(backend_url, model, cap, work, args.batch_concurrency, args.reserve)
    try:
        began = time.time()
        alone = await closed_loop(url, model, key, args.interactive, args.output_tokens, args.warmup, args.duration,
                                  "interactive alone")
        util_alone = utilisation(url, token, model, began + args.warmup, time.time())
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2, timeout=120)
        uploaded = await sdk.files.create(file=("lines.jsonl", io.BytesIO(batch_lines(
            args.lines, model, args.batch_tokens))), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        began = time.time()
        counts: list[tuple[float, int]] = []

        async def watch() -> None:
            while True:
                now = await sdk.batches.retrieve(batch.id)
                counts.append((time.time(), now.request_counts.completed + now.request_counts.failed))
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(args.warmup + args.duration)  # the batch alone
        between = time.time()
        util_batch = utilisation(url, token, model, began + args.warmup, between)
        rate_alone = rate_between(counts, began + args.warmup, between)
        beside = await closed_loop(url, model, key, args.interactive, args.output_tokens, args.warmup, args.duration,
                                   "interactive beside the batch")
        watcher.cancel()
        util_beside = utilisation(url, token, model, between + args.warmup, time.time())
        rate = rate_between(counts, between + args.warmup, time.time())
        final = await sdk.batches.retrieve(batch.id)
        await sdk.batches.cancel(batch.id)
        await sdk.close()
    finally:
        proc.terminate()
        proc.wait(30)
    return {"runs": [alone, beside], "utilisation": [util_alone, util_beside], "batch_alone": util_batch,
            "lines_per_second_alone": rate_alone, "lines_per_second": rate, "cap": cap,
            "reserve": reserve_for(cap, args.reserve),
            "lines_answered": final.request_counts.completed, "lines_failed": final.request_counts.failed}


def idle_share(result: dict) -> tuple[float, float]:
    """(the share of the capacity the interactive load leaves idle that the batch filled beside it, the most the
    reserve lets it fill), from the fill (requests in flight on average against the cap) of runs 1 and 3."""
    alone, beside = result["utilisation"][0][1], result["utilisation"][1][1]
    idle = max(1e-9, 1.0 - alone)
    allowed = max(0.0, 1.0 - result["reserve"] / result["cap"] - alone)
    return (beside - alone) / idle, allowed / idle


def table(result: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:,.0f}"

    rows = [["run", "interactive streams", "interactive tok/s", "TTFT p50 ms", "TTFT p99 ms", "ok", "failed",
             "utilisation", "in flight / cap", "batch lines/s"]]
    alone, beside = result["runs"]
    (util_alone, fill_alone), (util_beside, fill_beside) = result["utilisation"]
    util_batch, fill_batch = result["batch_alone"]
    for run, util, fill, rate in ((alone, util_alone, fill_alone, None),
                                  (None, util_batch, fill_batch, result["lines_per_second_alone"]),
                                  (beside, util_beside, fill_beside, result["lines_per_second"])):
        if run is None:
            rows.append(["batch alone", "0", "-", "-", "-", "-", "-", f"{util:.1%}", f"{fill:.1%}", f"{rate:,.1f}"])
            continue
        rows.append([run.name, str(run.concurrency), f"{run.throughput:,.0f}", ms(run.p(run.ttft, 50)),
                     ms(run.p(run.ttft, 99)), str(run.ok), str(len(run.failed)), f"{util:.1%}", f"{fill:.1%}",
                     "-" if rate is None else f"{rate:,.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def checks(result: dict, bound: float, fill: float) -> list[tuple[str, bool]]:
    alone, beside = result["runs"]
    out = []
    for q in (50, 99):
        ref = alone.p(alone.ttft, q) or 0.0
        out.append((f"interactive TTFT p{q} beside the batch <= {bound}x alone ({ref * bound * 1000:,.0f} ms)",
                    (beside.p(beside.ttft, q) or 0.0) <= bound * ref))
    share, allowed = idle_share(result)
    return out + [
        (f"the batch filled >= {fill:.0%} of the capacity the interactive load leaves idle ({share:.0%}; the"
         f" reserve of {result['reserve']} lets it fill {allowed:.0%})", share >= fill),
        ("the batch ran lines from the idle capacity", result["lines_per_second"] > 0),
        ("no interactive request failed", not alone.failed and not beside.failed),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", action="store_true", help="a real CPU vLLM instead of the simulator")
    parser.add_argument("--cap", type=int, help="the backend's cap (default: 32 for the simulator, 16 for vLLM)")
    parser.add_argument("--interactive", type=int, help="interactive streams (default: a quarter of the cap)")
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--batch-concurrency", type=int,
                        help="batch.concurrency and max_in_flight (default: the cap; the reserve bounds what runs)")
    parser.add_argument("--reserve", type=int, help="the model's queue.reserve (default: the policy's)")
    parser.add_argument("--fill", type=float, default=0.8, help="least share of the idle capacity the batch fills")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--output-tokens", type=int, default=64, help="per interactive request")
    parser.add_argument("--batch-tokens", type=int, default=32, help="per batch line")
    parser.add_argument("--bound", type=float, default=1.2, help="allowed interactive TTFT p50 and p99 ratio")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    cap = args.cap or (16 if args.vllm else 32)
    args.interactive = args.interactive or max(1, cap // 4)
    args.batch_concurrency = args.batch_concurrency or cap
    with tempfile.TemporaryDirectory(prefix="batch-fill-") as tmp:
        work = Path(tmp)
        if args.vllm:
            from tests.e2e.vllm_procs import VLLMServer

            server = VLLMServer(served_model_name="tiny", core=0, log_dir=work)
            server.start()
            try:
                server.wait_ready(180)
                result = asyncio.run(measure(server.base_url, "tiny", cap, args, work))
            finally:
                server.stop()
            label = f"real vLLM (CPU, one core; cap {cap})"
        else:
            port = free_port()
            sim = subprocess.Popen([sys.executable, "-m", "backends.simulator", "--port", str(port), "--model", "sim",
                                    "--preset", "reference-gpu", "--log-level", "warning"], cwd=REPO)
            try:
                wait_http_ok(f"http://127.0.0.1:{port}/health", sim, 30, "the simulator")
                result = asyncio.run(measure(f"http://127.0.0.1:{port}", "sim", cap, args, work))
            finally:
                sim.terminate()
                sim.wait(10)
            label = f"simulator, reference-GPU preset (cap {cap})"
    label += (f"; {args.interactive} interactive streams of {args.output_tokens} tokens; a batch of {args.lines}"
              f" lines of {args.batch_tokens} tokens, up to {args.batch_concurrency} in flight; reserve"
              f" {result['reserve']}")
    share, allowed = idle_share(result)
    print(f"\n{label}\n\n{table(result)}\n\nbatch: {result['lines_answered']} lines answered, "
          f"{result['lines_failed']} failed by the end of the last run; beside the interactive load it filled"
          f" {share:.0%} of the idle capacity (the reserve allows {allowed:.0%})\n")
    verdict = checks(result, args.bound, args.fill)
    for text, ok in verdict:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": label, **result, "runs": [r.__dict__ for r in
                                                                                   result["runs"]],
                                               "checks": verdict}, default=str, indent=2))
    return 0 if all(ok for _, ok in verdict) else 1


if __name__ == "__main__":
    sys.exit(main())
