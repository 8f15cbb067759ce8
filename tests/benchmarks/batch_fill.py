"""Batch fill benchmark: a Batch API batch of thousands of lines beside an interactive load, through one gateway.

    python -m tests.benchmarks.batch_fill                    # the simulator configured like the talk's GPU (knee 32)
    python -m tests.benchmarks.batch_fill --vllm             # a real CPU vLLM it starts (tiny model, one core)
    python -m tests.benchmarks.batch_fill --url URL --model NAME   # a vLLM already running (e.g. on a GPU)
    python -m tests.benchmarks.batch_fill --no-preempt       # lines hold their slots to their end (batch.preempt off)

With --vllm (and --url) the backend schedules by priority (`--scheduling-policy priority`, `--max-num-seqs` the
cap, so nothing waits inside vLLM that the gateway let through) and the gateway sends each class's vLLM priority.
A batch line gives its slot to an interactive request that must wait for one (`batch.preempt`, on by default;
`--no-preempt` turns it off, so the same run can be measured both ways); the lines preempted are counted.
Four runs, each `--duration` seconds after `--warmup`:
  1. interactive alone: a closed loop of streaming chat at `--interactive` concurrency, below the backend's cap,
     so the backend has idle capacity: the reference TTFT p50 and p99, and from the own-or-rent report the
     backend's utilisation (time with a request in flight) and fill (requests in flight on average against its
     cap);
  2. a batch of `--lines` lines (submitted with the openai SDK: files.create, batches.create) alone: its lines
     per second and fill, within the slots the model's `queue.reserve` leaves it (`--reserve`; default the
     policy's, an eighth of the cap);
  3. the same interactive load while the batch goes on: TTFT p50 and p99 again, the batch's lines per second
     beside it, and the share of the idle capacity the batch used (below);
  4. the interactive load alone again, once the batch is cancelled: the reference is the mean of runs 1 and 4
     (each percentile), so a machine whose speed drifts during the runs (a shared CI machine: +-30%) moves the
     reference with it instead of blaming the drift on the batch.

Idle capacity, precisely: the cap is C slots; over a window of T seconds the interactive load alone holds S_i
slot-seconds (the ledger's held slot-seconds of run 1, scaled to T), so the idle capacity is C*T - S_i
slot-seconds. The batch's use of it is the slot-seconds held beside the interactive load beyond what the load
held alone (the ledger's held slot-seconds of run 3 less S_i; a closed loop holds its streams' slots all the
time, so the rise is the batch's). share = (fill_3 - fill_1) / (1 - fill_1), fills being held slot-seconds /
(C*T). The most the reserve R lets it use is (1 - R/C - fill_1) / (1 - fill_1). A slot is not a fixed amount of
work on every backend (on a CPU a decode step slows as more sequences run), so the table also gives the work
done: the batch's lines/s beside the load against its lines/s alone (all C-R slots), beside the share of
those slots the load leaves it, (C - R - C*fill_1) / (C - R).

Passes when interactive TTFT p50 and p99 beside the batch stay within `--bound` x their reference, the batch
uses at least `--fill` of the idle capacity, and no interactive request failed. Prints a table; exit status 1
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
from tests.benchmarks.routing import VLLM_HISTOGRAMS, histogram, histogram_delta, histogram_figures  # noqa: E402
from tests.e2e.vllm_procs import parse_metrics  # noqa: E402
from tests.support.probes import metric_sum, wait_http_ok  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

BUCKET = 1  # ledger seconds per bucket: the report's windows line up with the runs (short ones too)
# Where a request's time goes in each run, from each side's /metrics before and after it (means): vLLM's own
# (from its engine's arrival of a request: interactive and batch together), and the gateway's (arrival to the
# first streamed chunk, so interactive requests only; the queue wait of each class).
VLLM_TIMES = {**VLLM_HISTOGRAMS, "decode": "vllm:request_decode_time_seconds",
              "itl": "vllm:inter_token_latency_seconds"}
GATEWAY_TIMES = {"ttft": "llm_gateway_time_to_first_token_seconds",
                 "queue": ("llm_gateway_queue_wait_seconds", {"class": "interactive"}),
                 "batch queue": ("llm_gateway_queue_wait_seconds", {"class": "batch"})}


def start_gateway(backend_url: str, model: str, cap: int, work: Path, concurrency: int, reserve: int | None,
                  priority: bool = False, preempt: bool = True):
    """The gateway as overload.start_gateway starts it, with the batch settings and the model's reserve
    (`priority`: the backend schedules by priority, and is sent each class's vLLM priority; `preempt`:
    batch.preempt)."""
    secret, port = secrets.token_urlsafe(32), free_port()
    queue = {"max_depth": 10_000, "max_wait": 120, **({} if reserve is None else {"reserve": reserve})}
    backend = {"url": backend_url, "cap": cap, **({"scheduling_policy": "priority"} if priority else {})}
    policy = {"listen": {"host": "127.0.0.1", "port": port}, "store": {"kind": "sqlite", "path": str(work / "keys.db")},
              "timeouts": {"read": 300}, "ledger": {"bucket_seconds": BUCKET},
              "models": [{"name": model, "backends": [backend], "queue": queue}],
              "batch": {"files_dir": str(work / "files"), "concurrency": concurrency, "max_in_flight": concurrency,
                        "poll_seconds": 0.5, "preempt": preempt}}
    (work / "policy.yaml").write_text(yaml.safe_dump(policy))
    cli = Path(sys.executable).with_name("llm-gateway")  # the installed command; else the package's (a GPU site)
    argv = [str(cli)] if cli.exists() else [sys.executable, "-m", "gateway"]
    proc = subprocess.Popen([*argv, "serve", "--config", str(work / "policy.yaml"), "--log-level", "warning"],
                            env={**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/ready", proc, 60, "the gateway")
    from gateway.admin.auth import mint_token
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


def histogram_of(m: dict, name: str, labels: dict[str, str]) -> dict:
    """routing.histogram over the label sets that carry `labels` only."""
    return histogram({key: value for key, value in m.items() if labels.items() <= dict(key[1]).items()}, name)


async def snapshot(url: str, names: dict) -> dict:
    """The histograms `names` of the server at `url` ({} when it does not answer: the figures are then left out);
    read in a thread, so the client's event loop (timing the interactive requests) is not held."""
    def read() -> str:
        return httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text

    try:
        text = await asyncio.to_thread(read)
    except httpx.HTTPError:
        return {}
    m = parse_metrics(text)
    return {key: histogram(m, name) if isinstance(name, str) else histogram_of(m, *name)
            for key, name in names.items()}


def mean_times(before: dict, after: dict) -> dict[str, float | None]:
    """Each histogram's mean (ms) over what it counted between the two snapshots (None: nothing counted)."""
    return {key: histogram_figures(histogram_delta([before[key]], [after[key]]))["mean_ms"]
            for key in after if key in before}


class Times:
    """vLLM's and the gateway's histograms read when a run's measured window starts and when it ends; `by_run`
    keeps each run's means under its name."""

    def __init__(self, backend_url: str, gateway_url: str) -> None:
        self.urls = {"vllm": (backend_url, VLLM_TIMES), "gateway": (gateway_url, GATEWAY_TIMES)}
        self.by_run: dict[str, dict] = {}
        self.before: dict = {}

    async def read(self) -> dict:
        return {side: await snapshot(url, names) for side, (url, names) in self.urls.items()}

    async def start(self) -> None:
        self.before = await self.read()

    async def take(self, run: str) -> None:
        after = await self.read()
        self.by_run[run] = {side: mean_times(self.before.get(side, {}), after[side]) for side in after}

    async def during(self, loop, warmup: float):
        """Awaits the closed loop `loop` (a coroutine that warms up for `warmup` seconds, then measures), reading
        the histograms after its warm-up and at its end; returns its run."""
        async def after_warmup() -> None:
            await asyncio.sleep(warmup)
            await self.start()

        starting = asyncio.create_task(after_warmup())
        run = await loop
        await starting
        await self.take(run.name)
        return run


def batch_lines(count: int, model: str, output_tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "max_tokens": output_tokens, "ignore_eos": True,
                                         "messages": [{"role": "user", "content": f"summarise document {n} " * 20}]}
                                }).encode() + b"\n" for n in range(count))


def rate_between(counts: list[tuple[float, int]], since: float, until: float) -> float:
    """Lines answered per second between two times, from the (time, lines answered) samples."""
    window = [(t, n) for t, n in counts if since <= t <= until]
    return (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]) if len(window) > 1 else 0.0


async def measure(backend_url: str, model: str, cap: int, args, work: Path, priority: bool = False) -> dict:
    """The four runs of the module's docstring through a fresh gateway in front of `backend_url`."""
    proc, url, token, key = start_gateway(backend_url, model, cap, work, args.batch_concurrency, args.reserve,
                                          priority, preempt=not args.no_preempt)
    try:
        began = time.time()
        times = Times(backend_url, url)
        alone = await times.during(closed_loop(url, model, key, args.interactive, args.output_tokens, args.warmup,
                                               args.duration, "interactive alone"), args.warmup)
        ended = time.time()
        await asyncio.sleep(1.0)  # the requests the run's end cut off end in the gateway too, and are counted
        util_alone = utilisation(url, token, model, began + args.warmup, ended)
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2, timeout=120)
        uploaded = await sdk.files.create(file=("lines.jsonl", io.BytesIO(batch_lines(
            args.lines, model, args.batch_tokens))), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        began = time.time()
        counts: list[tuple[float, int]] = []

        async def watch() -> None:
            while True:  # ends when cancelled, after run 3
                now = await sdk.batches.retrieve(batch.id)
                counts.append((time.time(), now.request_counts.completed + now.request_counts.failed))
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(args.warmup)
        await times.start()
        await asyncio.sleep(args.duration)  # the batch alone
        await times.take("batch alone")
        between = time.time()
        rate_alone = rate_between(counts, began + args.warmup, between)
        beside = await times.during(closed_loop(url, model, key, args.interactive, args.output_tokens, args.warmup,
                                                args.duration, "interactive beside the batch"), args.warmup)
        until = time.time()
        rate = rate_between(counts, between + args.warmup, until)
        final = await sdk.batches.retrieve(batch.id)
        # The ledger counts a request's slot-seconds when it ends: the lines in flight when a run ends are counted
        # once they end, so the batch runs on for two lines' time (bounded) before the runs' fills are read.
        await asyncio.sleep(min(60.0, 2 * cap / max(rate, rate_alone, 0.1)))
        watcher.cancel()
        util_batch = utilisation(url, token, model, began + args.warmup, between)
        util_beside = utilisation(url, token, model, between + args.warmup, until)
        await sdk.batches.cancel(batch.id)
        deadline = time.monotonic() + 120  # the lines in flight end (cancelling stops them): bounded
        while (await sdk.batches.retrieve(batch.id)).status == "cancelling" and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await sdk.close()
        again = await times.during(closed_loop(url, model, key, args.interactive, args.output_tokens, args.warmup,
                                               args.duration, "interactive alone again"), args.warmup)
        preempted = preemptions(url, model)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"runs": [alone, beside, again], "utilisation": [util_alone, util_beside], "batch_alone": util_batch,
            "lines_per_second_alone": rate_alone, "lines_per_second": rate, "cap": cap,
            "reserve": reserve_for(cap, args.reserve), "interactive": args.interactive, "lines": args.lines,
            "lines_answered": final.request_counts.completed, "lines_failed": final.request_counts.failed,
            "preempt": not args.no_preempt, "preemptions": preempted, "times": times.by_run}


def preemptions(url: str, model: str) -> float:
    """Batch lines the gateway preempted for interactive requests (llm_gateway_batch_preemptions_total)."""
    return metric_sum(httpx.get(f"{url}/metrics", timeout=30).text, "llm_gateway_batch_preemptions_total",
                      model=model)


def reference(result: dict, q: int) -> float:
    """Interactive TTFT percentile `q` without a batch: the mean of the runs before and after it."""
    alone, _, again = result["runs"]
    return ((alone.p(alone.ttft, q) or 0.0) + (again.p(again.ttft, q) or 0.0)) / 2


def ttft_ratio(result: dict, q: int) -> float:
    beside = result["runs"][1]
    return (beside.p(beside.ttft, q) or 0.0) / max(1e-9, reference(result, q))


def work_share(result: dict) -> tuple[float, float]:
    """(the batch's lines/s beside the load over its lines/s alone, the share of its C-R slots the load leaves
    it): the work done against the slots, for backends where a slot is not a fixed amount of work."""
    cap, reserve, fill = result["cap"], result["reserve"], result["utilisation"][0][1]
    left = max(0.0, (cap - reserve - cap * fill) / max(1, cap - reserve))
    return result["lines_per_second"] / max(1e-9, result["lines_per_second_alone"]), left


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
    alone, beside, again = result["runs"]
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
    rows.append([again.name, str(again.concurrency), f"{again.throughput:,.0f}", ms(again.p(again.ttft, 50)),
                 ms(again.p(again.ttft, 99)), str(again.ok), str(len(again.failed)), "-", "-", "-"])
    return render(rows)


def render(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def times_table(result: dict) -> str:
    """Where the time goes, each run's means in ms: the client's interactive TTFT; the gateway's (arrival to the
    first streamed chunk: interactive only) and the queue wait of each class; vLLM's own TTFT, queue, prefill,
    decode and inter-token latency (from its engine's arrival of a request: batch lines and interactive
    requests together)."""
    runs = {run.name: run for run in result["runs"]}
    rows = [["run", "client TTFT", "gateway TTFT", "gateway queue", "batch queue", "vLLM TTFT", "vLLM queue",
             "vLLM prefill", "vLLM decode", "vLLM ITL"]]
    for name, sides in result.get("times", {}).items():
        run = runs.get(name)
        client = sum(run.ttft) / len(run.ttft) * 1000 if run is not None and run.ttft else None
        gw, vllm = sides.get("gateway", {}), sides.get("vllm", {})
        figures = [client, gw.get("ttft"), gw.get("queue"), gw.get("batch queue"),
                   *(vllm.get(k) for k in ("ttft", "queue", "prefill", "decode", "itl"))]
        rows.append([name, *("-" if v is None else f"{v:,.1f}" for v in figures)])
    return render(rows)


def checks(result: dict, bound: float, fill: float) -> list[tuple[str, bool]]:
    alone, beside, again = result["runs"]
    out = []
    for q in (50, 99):
        ref, ratio = reference(result, q), ttft_ratio(result, q)
        measured = ref > 0 and all(run.ttft for run in (alone, beside, again))  # no TTFT: nothing passes
        out.append((f"interactive TTFT p{q} beside the batch <= {bound}x without it ({ratio:.2f}x of"
                    f" {ref * 1000:,.0f} ms, the mean of the runs before and after)", measured and ratio <= bound))
    share, allowed = idle_share(result)
    return out + [
        (f"the batch filled >= {fill:.0%} of the capacity the interactive load leaves idle ({share:.0%}; the"
         f" reserve of {result['reserve']} lets it fill {allowed:.0%})", share >= fill),
        ("the batch ran lines from the idle capacity", result["lines_per_second"] > 0),
        ("the batch outlasted run 3 (else its fill beside the load is understated: raise --lines)",
         result["lines_answered"] + result["lines_failed"] < result["lines"]),
        ("no interactive request failed", not alone.failed and not beside.failed and not again.failed),
    ]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", action="store_true", help="a real CPU vLLM it starts instead of the simulator")
    parser.add_argument("--url", help="a vLLM already running here (scheduling by priority) instead of either")
    parser.add_argument("--model", default="tiny", help="its served model name (with --url)")
    parser.add_argument("--cap", type=int, help="the backend's cap (default: 32 for the simulator, 8 for vLLM)")
    parser.add_argument("--interactive", type=int, help="interactive streams (default: a quarter of the cap)")
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--batch-concurrency", type=int,
                        help="batch.concurrency and max_in_flight (default: the cap; the reserve bounds what runs)")
    parser.add_argument("--reserve", type=int, help="the model's queue.reserve (default: the policy's)")
    parser.add_argument("--no-preempt", action="store_true",
                        help="batch.preempt off: a batch line holds its slot to its end, whoever waits")
    parser.add_argument("--fill", type=float, default=0.8, help="least share of the idle capacity the batch fills")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--output-tokens", type=int,
                        help="per interactive request (default: 64 on the simulator, 16 on vLLM: more requests, so"
                             " more TTFTs to take percentiles of, on a CPU)")
    parser.add_argument("--batch-tokens", type=int, default=32, help="per batch line")
    parser.add_argument("--bound", type=float, default=1.2, help="allowed interactive TTFT p50 and p99 ratio")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    args.cap = args.cap or (8 if args.vllm or args.url else 32)
    args.interactive = args.interactive or max(1, args.cap // 4)
    args.output_tokens = args.output_tokens or (16 if args.vllm or args.url else 64)
    args.batch_concurrency = args.batch_concurrency or args.cap
    return args


def report(result: dict, args: argparse.Namespace, label: str) -> list[tuple[str, bool]]:
    """Prints the table and the checks (and writes --json); returns the checks."""
    label += (f"; {args.interactive} interactive streams of {args.output_tokens} tokens; a batch of {args.lines}"
              f" lines of {args.batch_tokens} tokens, up to {args.batch_concurrency} in flight; reserve"
              f" {result['reserve']}; preemption {'on' if result['preempt'] else 'off'}")
    share, allowed = idle_share(result)
    done, left = work_share(result)
    print(f"\n{label}\n\n{table(result)}\n\nbatch: {result['lines_answered']} lines answered, "
          f"{result['lines_failed']} failed by the end of run 3; beside the interactive load it used"
          f" {share:.0%} of the idle slot-seconds (the reserve allows {allowed:.0%}) and ran at {done:.0%} of its"
          f" lines/s alone (the load leaves it {left:.0%} of its slots); interactive TTFT p50"
          f" {ttft_ratio(result, 50):.2f}x, p99 {ttft_ratio(result, 99):.2f}x without the batch; lines preempted:"
          f" {result['preemptions']:,.0f}\n\nwhere the time goes (means, ms):\n\n{times_table(result)}\n", flush=True)
    verdict = checks(result, args.bound, args.fill)
    for text, ok in verdict:
        print(f"{'PASS' if ok else 'FAIL'}  {text}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": label, **result, "runs": [r.__dict__ for r in
                                                                                   result["runs"]],
                                               "idle_share": share, "idle_share_allowed": allowed,
                                               "lines_ratio": done, "slots_left": left,
                                               "ttft_ratio": {"p50": ttft_ratio(result, 50),
                                                              "p99": ttft_ratio(result, 99)},
                                               "checks": verdict}, default=str, indent=2))
    return verdict


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cap = args.cap
    with tempfile.TemporaryDirectory(prefix="batch-fill-") as tmp:
        work = Path(tmp)
        if args.url:
            result = asyncio.run(measure(args.url.rstrip("/"), args.model, cap, args, work, priority=True))
            label = f"vLLM at {args.url} (cap {cap})"
        elif args.vllm:
            from tests.e2e.vllm_procs import VLLMServer

            server = VLLMServer(served_model_name="tiny", core=0, log_dir=work, log_requests=False,
                                extra_args=("--scheduling-policy", "priority", "--max-num-seqs", str(cap)))
            server.start()
            try:
                server.wait_ready(240)
                result = asyncio.run(measure(server.base_url, "tiny", cap, args, work, priority=True))
            finally:
                server.stop()
            label = f"real vLLM (CPU, tiny model, one core; --scheduling-policy priority --max-num-seqs {cap}; cap {cap})"
        else:
            port = free_port()
            sim = subprocess.Popen([sys.executable, "-m", "tools.simulator", "--port", str(port), "--model", "sim",
                                    "--preset", "reference-gpu", "--log-level", "warning"], cwd=REPO)
            try:
                wait_http_ok(f"http://127.0.0.1:{port}/health", sim, 30, "the simulator")
                result = asyncio.run(measure(f"http://127.0.0.1:{port}", "sim", cap, args, work))
            finally:
                sim.terminate()
                sim.wait(10)
            label = f"simulator, reference-GPU preset (cap {cap})"
    verdict = report(result, args, label)
    return 0 if all(ok for _, ok in verdict) else 1


if __name__ == "__main__":
    sys.exit(main())
