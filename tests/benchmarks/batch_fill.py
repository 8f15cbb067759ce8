"""Batch fill benchmark: a Batch API batch of thousands of lines beside an interactive load, through one gateway.

    python -m tests.benchmarks.batch_fill                    # the simulator configured like the talk's GPU (knee 32)
    python -m tests.benchmarks.batch_fill --vllm             # a real CPU vLLM (tiny model, one core)

Two runs of the same interactive closed loop (streaming chat at `--interactive` concurrency, below the backend's
cap, so the backend has idle capacity), each `--duration` seconds:
  1. interactive alone: the reference TTFT p99, and from the own-or-rent report the backend's utilisation (time
     with a request in flight) and batch fill (requests in flight on average against its cap);
  2. the same load while a batch of `--lines` lines (submitted with the openai SDK) runs in the background at
     batch priority: interactive TTFT p99 again, the lines answered per second, utilisation and batch fill.
Passes when interactive TTFT p99 with the batch stays within `--bound` x its value alone, the batch made
progress, and no interactive request failed. Prints a table; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.benchmarks import overload  # noqa: E402
from tests.benchmarks.overload import closed_loop  # noqa: E402
from tests.support.probes import wait_http_ok  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

BUCKET = 5  # ledger seconds per bucket: the report's windows line up with the runs


def start_gateway(backend_url: str, model: str, cap: int, work: Path, concurrency: int):
    extra = {"ledger": {"bucket_seconds": BUCKET},
             "batch": {"files_dir": str(work / "files"), "concurrency": concurrency, "max_in_flight": concurrency,
                       "poll_seconds": 0.5}}
    proc, url, key = overload.start_gateway(backend_url, model, cap, work, extra=extra)
    return proc, url, proc.admin_token, key


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


async def measure(backend_url: str, model: str, cap: int, args, work: Path) -> dict:
    proc, url, token, key = start_gateway(backend_url, model, cap, work, args.batch_concurrency)
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
                await asyncio.sleep(1)

        watcher = asyncio.create_task(watch())
        beside = await closed_loop(url, model, key, args.interactive, args.output_tokens, args.warmup, args.duration,
                                   "interactive beside the batch")
        watcher.cancel()
        util_beside = utilisation(url, token, model, began + args.warmup, time.time())
        window = [(t, n) for t, n in counts if t >= began + args.warmup]
        rate = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]) if len(window) > 1 else 0.0
        final = await sdk.batches.retrieve(batch.id)
        await sdk.batches.cancel(batch.id)
        await sdk.close()
    finally:
        proc.terminate()
        proc.wait(30)
    return {"runs": [alone, beside], "utilisation": [util_alone, util_beside], "lines_per_second": rate,
            "lines_answered": final.request_counts.completed, "lines_failed": final.request_counts.failed}


def table(result: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:,.0f}"

    rows = [["run", "interactive streams", "interactive tok/s", "TTFT p50 ms", "TTFT p99 ms", "ok", "failed",
             "utilisation", "in flight / cap", "batch lines/s"]]
    for run, (util, fill), rate in zip(result["runs"], result["utilisation"], [None, result["lines_per_second"]]):
        rows.append([run.name, str(run.concurrency), f"{run.throughput:,.0f}", ms(run.p(run.ttft, 50)),
                     ms(run.p(run.ttft, 99)), str(run.ok), str(len(run.failed)), f"{util:.1%}", f"{fill:.1%}",
                     "-" if rate is None else f"{rate:,.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def checks(result: dict, bound: float) -> list[tuple[str, bool]]:
    alone, beside = result["runs"]
    ref = alone.p(alone.ttft, 99) or 0.0
    return [
        (f"interactive TTFT p99 beside the batch <= {bound}x alone ({ref * bound * 1000:,.0f} ms)",
         (beside.p(beside.ttft, 99) or 0.0) <= bound * ref),
        ("the batch ran lines from the idle capacity", result["lines_per_second"] > 0),
        ("the backend held more in flight with the batch (own-or-rent batch_fill)",
         result["utilisation"][1][1] > result["utilisation"][0][1]),
        ("no interactive request failed", not alone.failed and not beside.failed),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", action="store_true", help="a real CPU vLLM instead of the simulator")
    parser.add_argument("--cap", type=int, help="the backend's cap (default: 32 for the simulator, 16 for vLLM)")
    parser.add_argument("--interactive", type=int, help="interactive streams (default: a quarter of the cap)")
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--batch-concurrency", type=int,
                        help="batch.concurrency and max_in_flight (default: the cap minus the interactive streams)")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--output-tokens", type=int, default=64, help="per interactive request")
    parser.add_argument("--batch-tokens", type=int, default=32, help="per batch line")
    parser.add_argument("--bound", type=float, default=1.5, help="allowed interactive TTFT p99 ratio")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    cap = args.cap or (16 if args.vllm else 32)
    args.interactive = args.interactive or max(1, cap // 4)
    args.batch_concurrency = args.batch_concurrency or max(1, cap - args.interactive)
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
              f" lines of {args.batch_tokens} tokens, {args.batch_concurrency} in flight")
    print(f"\n{label}\n\n{table(result)}\n\nbatch: {result['lines_answered']} lines answered, "
          f"{result['lines_failed']} failed by the end of the second run\n")
    verdict = checks(result, args.bound)
    for text, ok in verdict:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": label, **result, "runs": [r.__dict__ for r in
                                                                                   result["runs"]],
                                               "checks": verdict}, default=str, indent=2))
    return 0 if all(ok for _, ok in verdict) else 1


if __name__ == "__main__":
    sys.exit(main())
