#!/usr/bin/env python3
"""Closed-loop streaming load at fixed concurrency levels, direct to vLLM or through gateways, on loopback.

The overload comparison of tests/benchmarks/gpu/ (README.md there). --url takes one base URL or several,
comma-separated (several gateway processes in front of one vLLM): worker k of the level uses URL k mod n.
Through a gateway, `x-gateway-queue-ms` is subtracted from the client's TTFT to give the backend's own TTFT;
a 429 is a clean refusal (counted as `refused`), any other failure an error.

For each concurrency level C, C workers (spread over several client processes so the
client is never the bottleneck) send streaming /v1/completions requests back-to-back:
a fresh random 256-token prompt (token ids, so no prefix-cache hits and an exact length),
max_tokens 128, ignore_eos, greedy. Timeline of a level (shared wall clock):
  T0 .. T0+W        ramp-up, not measured
  T0+W .. T0+W+D    measured window: tokens counted by arrival time; requests that start
                    in it give TTFT/ITL/TPOT/e2e; requests completing in it give req/s
  after T0+W+D      no new requests; in-flight ones finish (bounded by --grace, then cancelled)
/metrics (vllm:num_requests_running / waiting / kv_cache_usage_perc) is sampled every 0.5 s
inside the window; vllm:generation_tokens_total gives a server-side tok/s cross-check.
Loopback targets only; every loop is bounded in time and count.
"""
import argparse
import asyncio
import json
import multiprocessing as mp
import random
import re
import statistics
import time
import urllib.request
from urllib.parse import urlparse


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


# ---------------------------------------------------------------- client process
async def _client_main(urls, model, conc, t0, stop_issue_at, hard_end, prompt_len, max_tokens,
                       seed, max_req_per_worker, vocab_lo, vocab_hi, api_key=None, offset=0):
    import aiohttp
    rng = random.Random(seed)
    recs = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=120)
    conn = aiohttp.TCPConnector(limit=conc + 4, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as sess:
        async def one(url):
            prompt = [rng.randrange(vocab_lo, vocab_hi) for _ in range(prompt_len)]
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            r = {"t0": time.time(), "ok": False, "chunks": [], "ntok": 0}
            prev = 0
            try:
                hdrs = {"authorization": f"Bearer {api_key}"} if api_key else {}
                async with sess.post(url + "/v1/completions", json=body, headers=hdrs) as resp:
                    q = resp.headers.get("x-gateway-queue-ms")
                    r["queue_s"] = float(q) / 1000 if q else 0.0
                    if resp.status == 429:
                        r["refused"] = True
                    if resp.status != 200:
                        r["err"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        r["t1"] = time.time()
                        return r
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        now = time.time()
                        ev = json.loads(data)
                        u = ev.get("usage")
                        if u and u.get("completion_tokens") is not None:
                            n = u["completion_tokens"] - prev
                            prev = u["completion_tokens"]
                        else:
                            n = 1 if ev.get("choices") else 0
                            prev += n
                        if n > 0:
                            r["chunks"].append((now, n))
                r["ok"] = True
                r["ntok"] = prev
            except asyncio.CancelledError:
                r["err"] = "cancelled (grace over)"
                r["cancelled"] = True
            except Exception as e:  # noqa: BLE001
                r["err"] = repr(e)[:200]
            r["t1"] = time.time()
            return r

        async def worker(k):
            url = urls[(offset + k) % len(urls)]
            for _ in range(max_req_per_worker):
                if time.time() >= stop_issue_at:
                    return
                r = await one(url)
                recs.append(r)
                if r.get("refused"):  # a clean 429: back off a little, as a client honouring Retry-After would
                    await asyncio.sleep(0.2)

        delay = t0 - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks = [asyncio.create_task(worker(k)) for k in range(conc)]
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, hard_end - time.time()))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
    return recs


def _client_proc(q, *args):
    try:
        import uvloop
        uvloop.install()
    except Exception:  # noqa: BLE001
        pass
    try:
        recs = asyncio.run(_client_main(*args))
        q.put(("ok", recs))
    except Exception as e:  # noqa: BLE001
        q.put(("err", repr(e)))


# ---------------------------------------------------------------- metrics
MET_RE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|nan)$")


def scrape(url):
    out = {}
    try:
        txt = urllib.request.urlopen(url + "/metrics", timeout=3).read().decode()
    except Exception:  # noqa: BLE001
        return out
    for ln in txt.splitlines():
        m = MET_RE.match(ln)
        if not m:
            continue
        name, val = m.group(1), m.group(3)
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                    "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                    "vllm:num_preemptions_total"):
            try:
                out[name] = out.get(name, 0.0) + float(val)
            except ValueError:
                pass
    return out


_NVML = None


def gpu_sample():
    """(util %, power W, sm clock MHz) of GPU 0 via NVML, or None."""
    global _NVML
    try:
        import pynvml
        if _NVML is None:
            pynvml.nvmlInit()
            _NVML = pynvml.nvmlDeviceGetHandleByIndex(0)
        u = pynvml.nvmlDeviceGetUtilizationRates(_NVML).gpu
        pw = pynvml.nvmlDeviceGetPowerUsage(_NVML) / 1000.0
        clk = pynvml.nvmlDeviceGetClockInfo(_NVML, pynvml.NVML_CLOCK_SM)
        return (u, pw, clk)
    except Exception:  # noqa: BLE001
        _NVML = False if _NVML is None else _NVML
        return None


# ---------------------------------------------------------------- one level
def run_level(a, conc, label_seed):
    nproc = max(1, min(a.max_procs, (conc + a.per_proc - 1) // a.per_proc))
    split = [conc // nproc + (1 if i < conc % nproc else 0) for i in range(nproc)]
    t0 = time.time() + 1.5
    w0, w1 = t0 + a.warmup, t0 + a.warmup + a.measure
    hard_end = w1 + a.grace
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = []
    urls = a.url.split(",")
    offset = 0
    for i, c in enumerate(split):
        p = ctx.Process(target=_client_proc, args=(
            q, urls, a.model, c, t0, w1, hard_end, a.prompt_len, a.max_tokens,
            label_seed * 1000 + i, a.max_req_per_worker, a.vocab_lo, a.vocab_hi, a.api_key, offset), daemon=True)
        offset += c
        p.start()
        procs.append(p)
    # metrics sampling inside the window
    samples = []
    m_start = m_end = None
    while time.time() < w0:
        time.sleep(0.05)
    m_start = scrape(a.metrics_url or a.url)
    ms0 = time.time()
    gsamples = []
    while time.time() < w1:
        s = scrape(a.metrics_url or a.url)
        if s:
            samples.append(s)
        if _NVML is not False:
            g = gpu_sample()
            if g:
                gsamples.append(g)
        time.sleep(0.5)
    m_end = scrape(a.metrics_url or a.url)
    ms1 = time.time()
    recs, errs = [], []
    for _ in procs:
        try:
            kind, payload = q.get(timeout=max(5.0, hard_end - time.time() + 20))
        except Exception:  # noqa: BLE001
            errs.append("client process gave no result")
            continue
        if kind == "ok":
            recs.extend(payload)
        else:
            errs.append(payload)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    t_done = time.time()

    # ---- stats
    D = w1 - w0
    tok_in_win = sum(n for r in recs for (t, n) in r["chunks"] if w0 <= t < w1)
    started = [r for r in recs if w0 <= r["t0"] < w1]
    ok_started = [r for r in started if r["ok"] and r["chunks"]]
    completed_in_win = [r for r in recs if r["ok"] and w0 <= r["t1"] < w1]
    ttft = [r["chunks"][0][0] - r["t0"] for r in ok_started]
    bttft = [r["chunks"][0][0] - r["t0"] - r.get("queue_s", 0.0) for r in ok_started]
    qwait = [r.get("queue_s", 0.0) for r in ok_started]
    e2e = [r["t1"] - r["t0"] for r in ok_started]
    tpot = [(r["chunks"][-1][0] - r["chunks"][0][0]) / max(1, r["ntok"] - r["chunks"][0][1])
            for r in ok_started if r["ntok"] > 1]
    itl = []
    for r in ok_started:
        ch = r["chunks"]
        for j in range(1, len(ch)):
            itl.append((ch[j][0] - ch[j - 1][0]) / ch[j][1])
    ntoks = [r["ntok"] for r in ok_started]
    failed = [r for r in recs if not r["ok"] and not r.get("cancelled") and not r.get("refused")]
    refused = [r for r in recs if r.get("refused")]
    cancelled = [r for r in recs if r.get("cancelled")]
    running = [s.get("vllm:num_requests_running") for s in samples if "vllm:num_requests_running" in s]
    waiting = [s.get("vllm:num_requests_waiting") for s in samples if "vllm:num_requests_waiting" in s]
    kvk = "vllm:kv_cache_usage_perc"
    kv = [s.get(kvk, s.get("vllm:gpu_cache_usage_perc")) for s in samples
          if kvk in s or "vllm:gpu_cache_usage_perc" in s]
    srv_tok_s = None
    if m_start and m_end and "vllm:generation_tokens_total" in m_start and "vllm:generation_tokens_total" in m_end:
        srv_tok_s = (m_end["vllm:generation_tokens_total"] - m_start["vllm:generation_tokens_total"]) / (ms1 - ms0)
    preempt = None
    if m_start and m_end and "vllm:num_preemptions_total" in m_start and "vllm:num_preemptions_total" in m_end:
        preempt = m_end["vllm:num_preemptions_total"] - m_start["vllm:num_preemptions_total"]

    def ms(x):
        return None if x is None else round(1000 * x, 1)

    row = {
        "concurrency": conc, "client_procs": nproc, "window_s": round(D, 2),
        "out_tok_per_s": round(tok_in_win / D, 1),
        "server_gen_tok_per_s": None if srv_tok_s is None else round(srv_tok_s, 1),
        "req_per_s": round(len(completed_in_win) / D, 2),
        "requests_started_in_window": len(started), "requests_ok_started_in_window": len(ok_started),
        "requests_total": len(recs), "errors": len(failed), "refused_429": len(refused), "urls": len(urls), "cancelled_after_grace": len(cancelled),
        "error_samples": list({r.get("err") for r in failed})[:3] + errs[:3],
        "backend_ttft_p50_ms": ms(pct(bttft, 50)), "backend_ttft_p99_ms": ms(pct(bttft, 99)),
        "queue_wait_p50_ms": ms(pct(qwait, 50)), "queue_wait_p99_ms": ms(pct(qwait, 99)),
        "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p90_ms": ms(pct(ttft, 90)), "ttft_p99_ms": ms(pct(ttft, 99)),
        "itl_p50_ms": ms(pct(itl, 50)), "itl_p99_ms": ms(pct(itl, 99)),
        "tpot_p50_ms": ms(pct(tpot, 50)), "tpot_p99_ms": ms(pct(tpot, 99)),
        "e2e_p50_ms": ms(pct(e2e, 50)), "e2e_p99_ms": ms(pct(e2e, 99)),
        "per_stream_tok_per_s_p50": None if not tpot else round(1.0 / pct(tpot, 50), 1),
        "out_tokens_per_req_min": min(ntoks) if ntoks else None,
        "running_mean": None if not running else round(statistics.mean(running), 1),
        "running_max": None if not running else max(running),
        "waiting_mean": None if not waiting else round(statistics.mean(waiting), 1),
        "waiting_max": None if not waiting else max(waiting),
        "kv_usage_mean": None if not kv else round(statistics.mean(kv), 4),
        "kv_usage_max": None if not kv else round(max(kv), 4),
        "preemptions_in_window": preempt,
        "metric_samples": len(samples),
        "gpu_util_mean": None if not gsamples else round(statistics.mean(g[0] for g in gsamples), 1),
        "gpu_power_w_mean": None if not gsamples else round(statistics.mean(g[1] for g in gsamples), 1),
        "gpu_sm_clock_mhz_mean": None if not gsamples else round(statistics.mean(g[2] for g in gsamples)),
        "window_epoch": [round(w0, 3), round(w1, 3)],
        "level_wall_s": round(t_done - (t0 - 1.5), 1),
    }
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="one base URL, or several comma-separated")
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--api-key", default=None, help="sent as a bearer token (the gateway's API key)")
    ap.add_argument("--metrics-url", default=None, help="where vLLM's /metrics is, when --url is a gateway")
    ap.add_argument("--levels", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--measure", type=float, default=14.0)
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab-lo", type=int, default=4096)
    ap.add_argument("--vocab-hi", type=int, default=151000)
    ap.add_argument("--per-proc", type=int, default=48, help="target workers per client process")
    ap.add_argument("--max-procs", type=int, default=8)
    ap.add_argument("--max-req-per-worker", type=int, default=2000)
    ap.add_argument("--prewarm", type=int, default=32, help="unrecorded warm-up level (0=off)")
    ap.add_argument("--label", default="bf16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip remaining levels past this")
    a = ap.parse_args()
    for u in a.url.split(",") + ([a.metrics_url] if a.metrics_url else []):
        assert urlparse(u).hostname in ("127.0.0.1", "localhost", "::1"), "loopback only"
    t_start = time.time()
    args = dict(vars(a), api_key="(given)" if a.api_key else None)  # never the key itself in the record
    meta = {"label": a.label, "args": args, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    rows = []
    if a.prewarm:
        saved = (a.warmup, a.measure, a.grace)
        a.warmup, a.measure, a.grace = 1.0, 4.0, 15.0
        w = run_level(a, a.prewarm, 999)
        print("prewarm", json.dumps({k: w[k] for k in ("concurrency", "out_tok_per_s", "ttft_p50_ms", "errors")}), flush=True)
        meta["prewarm"] = w
        a.warmup, a.measure, a.grace = saved
        time.sleep(1.0)
    for i, c in enumerate(int(x) for x in a.levels.split(",")):
        est = a.warmup + a.measure + 6 + (10 if c >= 128 else 0)
        if time.time() - t_start + est > a.budget_s:
            print(f"skip level {c}: time budget", flush=True)
            meta.setdefault("skipped", []).append(c)
            continue
        row = run_level(a, c, i + 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump({"meta": meta, "rows": rows}, open(a.out, "w"), indent=1)
        time.sleep(1.5)
    meta["elapsed_s"] = round(time.time() - t_start, 1)
    json.dump({"meta": meta, "rows": rows}, open(a.out, "w"), indent=1)
    hdr = ["conc", "out tok/s", "srv tok/s", "req/s", "TTFT p50", "TTFT p99", "backend TTFT p99", "queue p99",
           "TPOT p50", "run mean", "wait max", "KV max", "err", "429"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        print("| " + " | ".join(str(x) for x in (
            r["concurrency"], r["out_tok_per_s"], r["server_gen_tok_per_s"], r["req_per_s"],
            r["ttft_p50_ms"], r["ttft_p99_ms"], r["backend_ttft_p99_ms"], r["queue_wait_p99_ms"], r["tpot_p50_ms"],
            r["running_mean"], r["waiting_max"], r["kv_usage_max"], r["errors"], r["refused_429"])) + " |")


if __name__ == "__main__":
    main()
