"""Gateway overhead against its peers, in one run on this machine: `python -m tests.benchmarks.peers.run`.

Installs what it needs once (tests/benchmarks/peers/install.py), starts a stand-in OpenAI backend (nginx
serving fixed bodies) and four systems in front of it: this gateway (full pipeline), LiteLLM proxy (1 worker,
master key), vllm-router and nginx as a plain reverse proxy (the floor). Each system runs on core 1; the load
generators and the stand-in on core 0. Then, for several rounds, each system in turn (the order rotates per
round; "direct" is the load generators against the stand-in itself, the reference and the proof that the
load side is not the bottleneck):

  c=64   wrk, 64 connections, non-streaming POSTs: requests/s, and CPU seconds per request of the system's
         processes (utime+stime from /proc/<pid>/stat over the measured window)
  c=1    wrk, 1 connection: latency p50/p99; "added" is the system's minus direct's in the same round
  stream 64 closed-loop streams x 256 token events (sse_client.py): token events/s, time to last byte

Figures are medians over rounds. Then a soak on a fresh gateway process (RSS after 10k and after 100k
requests at c=64), and, unless --no-profile, a py-spy profile of the gateway under the c=64 load. Prints one
markdown table (a column per system, ratios against each peer), the targets of the benchmark issue, and the
profile's top costs; writes everything as JSON under .cache/bench/.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def _in_project_venv() -> None:
    """Run under the project's venv (where the gateway is installed), whatever `python` started this."""
    if importlib.util.find_spec("gateway") and importlib.util.find_spec("httpx"):
        return
    venv = Path(__file__).resolve().parents[3] / ".venv" / "bin" / "python"
    if not venv.exists() or Path(sys.executable) == venv:
        raise SystemExit("the gateway is not importable here: create its venv first (make venv)")
    os.execv(str(venv), [str(venv), "-m", "tests.benchmarks.peers.run", *sys.argv[1:]])


if __name__ == "__main__":
    _in_project_venv()

import argparse
import atexit
import collections
import json
import platform
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx

from tests.benchmarks.peers import install
from tests.benchmarks.peers.ceilings import VARIANTS as CEILING_VARIANTS
from tests.benchmarks.peers.ceilings import ceilings_table, measure_ceilings
from tests.benchmarks.peers.load import run_wrk, write_script
from tests.benchmarks.peers.procs import Procs
from tests.benchmarks.peers.standin import TOKENS
from tests.benchmarks.peers.systems import (
    LOAD_CORE,
    SUT_CORE,
    System,
    free_port,
    start_floor,
    start_gateway,
    start_litellm,
    start_redis,
    start_router,
    start_standin,
)

REPO = Path(__file__).resolve().parents[3]
PEERS = ["LiteLLM", "vllm-router", "nginx"]
ROUTING_COMPARE = [  # (column, routing profile): two replicas per model, so the profile has a choice to make
    ("gateway x2 default routing", "default"),
    ("gateway x2 least-in-flight", "least-in-flight"),
]
STORE_COMPARE = [  # (column, Redis set-up from tests/support): the same gateway on each way to reach Redis
    ("gateway redis", "RedisServer"),
    ("gateway redis-sentinel", "SentinelSet"),
    ("gateway redis-cluster", "ClusterSet"),
]
LEDGER_COMPARE = [  # (column, policy sections): the same gateway without the cost ledger, for what it costs
    ("gateway no ledger", {"ledger": {"enabled": False}}),
]
VARIANTS = "gateway variants 80:20"  # --variants-compare: each model split over two variants
BASELINE = "gateway baseline tree"  # --baseline-tree: the same gateway from another source tree (a commit before)
TRACED = "gateway tracing 1.0"
PLAIN_EDGE = "gateway unbounded edge"  # --edge-compare: uvicorn's own httptools protocol, none of gateway/http/edge.py  # --tracing-compare: every call traced, exported to a local OTLP/HTTP sink
KNOBS = [  # (column, extra `llm-gateway serve` arguments, extra environment): settings, no code change
    ("gateway --log-level warning", ["--log-level", "warning"], {}),
    ("gateway PYTHONOPTIMIZE=1", [], {"PYTHONOPTIMIZE": "1"}),
]


@dataclass
class Samples:
    rps: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # CPU milliseconds per request at c=64
    p50: list[float] = field(default_factory=list)  # c=1, ms
    p99: list[float] = field(default_factory=list)
    added_p50: list[float] = field(default_factory=list)
    added_p99: list[float] = field(default_factory=list)
    events: list[float] = field(default_factory=list)  # token events/s
    cpu_us_event: list[float] = field(default_factory=list)  # CPU microseconds per SSE token event (64 streams)
    ttlb50: list[float] = field(default_factory=list)
    ttlb99: list[float] = field(default_factory=list)
    rss_mib: float | None = None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------- measuring


WARMUP_STREAMS = 8


def stream_round(system: System, args) -> dict:
    cmd = ["taskset", "-c", str(LOAD_CORE), sys.executable, "-m", "tests.benchmarks.peers.sse_client",
           "--url", system.sse_url, "--model", system.sse_model, "--concurrency", str(args.streams),
           "--duration", str(args.seconds), "--warmup-streams", str(WARMUP_STREAMS), "--expect", str(TOKENS),
           "--hard-timeout", str(args.stream_timeout)]
    if system.auth:
        cmd += ["--auth", system.auth]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              timeout=2 * args.stream_timeout + 30, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{system.name}: the streaming client did not finish in time") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{system.name}: streaming client failed: {proc.stderr[-1500:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["good"] == 0 or result["good"] < result["streams"]:
        raise RuntimeError(f"{system.name}: {result['streams'] - result['good']} bad streams: {result['errors']}")
    return result


def measure(system: System, samples: Samples, direct: dict | None, scripts: dict[str, Path], args) -> dict:
    """One round for one system; returns its raw figures (direct's are used to compute the added latency)."""
    script = scripts[system.name]
    url = system.json_url
    run_wrk(url, script, 64, args.warmup)
    system.check_alive()
    cpu0 = system.cpu_seconds()
    hi = run_wrk(url, script, 64, args.seconds)
    cpu = system.cpu_seconds() - cpu0
    run_wrk(url, script, 1, args.warmup)
    lo = run_wrk(url, script, 1, args.seconds)
    for label, result in (("c=64", hi), ("c=1", lo)):
        if result.errors or result.requests == 0:
            raise RuntimeError(f"{system.name} {label}: {result.errors} errors in {result.requests} requests")
    cpu0 = system.cpu_seconds()
    st = stream_round(system, args)
    cpu_us_event = (system.cpu_seconds() - cpu0) / ((st["streams"] + WARMUP_STREAMS) * TOKENS) * 1e6
    system.check_alive()
    return keep(samples, direct, {
        "rps": hi.rps, "p50": lo.p50_ms, "p99": lo.p99_ms, "events": st["token_events_per_s"],
        "cpu_ms": cpu / hi.requests * 1000, "cpu_us_event": cpu_us_event, "streams": st["good"],
        "ttlb50": st["ttlb_p50_ms"], "ttlb99": st["ttlb_p99_ms"]})


def keep(samples: Samples, direct: dict | None, got: dict) -> dict:
    """Add one round's figures of a system to its samples (the added latency against `direct`'s); returns them."""
    for name in ("rps", "cpu_ms", "p50", "p99", "events", "cpu_us_event", "ttlb50", "ttlb99"):
        getattr(samples, name).append(got[name])
    if direct is not None:
        samples.added_p50.append(got["p50"] - direct["p50"])
        samples.added_p99.append(got["p99"] - direct["p99"])
    return got


def soak(procs: Procs, work: Path, standin, args, rps_hint: float) -> dict:
    """A fresh gateway; RSS after `soak_first` and after `soak_total` requests (exact counts: wrk's Lua script
    stops at the number). Bounded by `soak_timeout`: past it, the figures say how many requests were sent."""
    gw = start_gateway(procs, work, standin, name="gateway-soak")
    proc = gw.procs[0]
    out: dict = {"connections": args.soak_connections, "rss_start_mib": proc.rss_bytes() / 2**20,
                 "complete": True}
    sent = 0
    deadline = time.monotonic() + args.soak_timeout
    try:
        for target, label in ((args.soak_first, "first"), (args.soak_total, "total")):
            while sent < target and time.monotonic() < deadline:
                remaining = target - sent
                cap = 60.0 if sent else 15.0  # a short first segment calibrates the rate at this concurrency
                seconds = min(cap, deadline - time.monotonic(), remaining / max(rps_hint, 50.0) * 1.1 + 1)
                script = write_script(work / "soak.lua", gw.auth, limit=remaining)
                result = run_wrk(gw.json_url, script, args.soak_connections, max(1.0, seconds))
                if result.errors:
                    raise RuntimeError(f"soak: {result.errors} errors")
                sent += result.requests
                rps_hint = result.rps or rps_hint
                gw.check_alive()
            time.sleep(0.5)  # let the last responses' accounting settle
            out[f"requests_{label}"] = sent
            out[f"rss_{label}_mib"] = proc.rss_bytes() / 2**20
            if sent < target:
                out["complete"] = False
                log(f"soak: only {sent:,} of {target:,} requests within {args.soak_timeout:.0f} s")
                break
    finally:
        procs.stop(proc)
    if "rss_total_mib" not in out:
        out["requests_total"], out["rss_total_mib"] = out["requests_first"], out["rss_first_mib"]
    out["growth_pct"] = (out["rss_total_mib"] / out["rss_first_mib"] - 1) * 100
    return out


def profile(system: System, scripts: dict[str, Path], work: Path, args) -> dict:
    """py-spy on the gateway while wrk keeps it at c=64 (or, with --profile-streams, the streaming client runs);
    self and inclusive time per function and per area."""
    pyspy = install.venv_python("tools").with_name("py-spy")
    pid = system.procs[0].pid
    raw = work / "profile.txt"
    spy = subprocess.Popen(
        ["taskset", "-c", str(LOAD_CORE), str(pyspy), "record", "--pid", str(pid), "--rate", "200",
         "--duration", str(args.profile_seconds), "--threads", "--format", "raw", "--output", str(raw),
         *(["--native"] if args.profile_native else ["--nonblocking"])],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        time.sleep(1.0)  # py-spy attaches
        if args.profile_streams:
            stream_round(system, argparse.Namespace(**{**vars(args), "seconds": args.profile_seconds + 1}))
        else:
            run_wrk(system.json_url, scripts[system.name], 64, args.profile_seconds + 1)
        _, err = spy.communicate(timeout=args.profile_seconds + 30)
    except subprocess.TimeoutExpired:
        os.killpg(spy.pid, signal.SIGKILL)
        spy.wait(5)
        return {"error": "py-spy did not finish"}
    finally:
        if spy.poll() is None:
            os.killpg(spy.pid, signal.SIGKILL)
            spy.wait(5)
    if spy.returncode != 0 or not raw.exists():
        return {"error": f"py-spy failed: {err.decode(errors='replace')[-500:]}"}
    if args.profile_native:
        shutil.copy(raw, REPO / ".cache" / "bench" / "profile-native.txt")
    return summarize_profile(raw.read_text())


AREAS = [  # first match wins, on the start of the frame's path (site-packages and stdlib prefixes removed)
    ("gateway: policies/ (auth, limits, admission, accounting)", ("policies/",)),
    ("gateway: gateway/ (routes, proxy, relay, metrics)", ("gateway/",)),
    ("gateway: backends/ (upstream, replicas)", ("backends/",)),
    ("httpx/httpcore/h11 (upstream client)", ("httpx/", "httpcore/", "h11/")),
    ("anyio (task groups, cancel scopes, streams)", ("anyio/",)),
    ("uvicorn (server, httptools glue)", ("uvicorn/",)),
    ("prometheus_client (metrics)", ("prometheus_client/",)),
    ("logging", ("logging/",)),
    ("asyncio (Python parts)", ("asyncio/",)),
    ("uuid/ipaddress/hashlib/enum (stdlib)", ("uuid.py", "ipaddress.py", "hashlib.py", "enum.py")),
    ("pydantic", ("pydantic",)),
    ("sqlite", ("sqlite3/",)),
]
LOOP = "event loop itself (uvloop's C code: epoll wait, socket syscalls, scheduling)"


def area(frame: str) -> str:
    """`frame` as _short gives it: 'name (path)'."""
    if frame.startswith("Runner.run "):  # time inside uvloop's C loop, below asyncio.run
        return LOOP
    path = frame.rpartition(" (")[2].rstrip(")")
    for name, prefixes in AREAS:
        if path.startswith(prefixes):
            return name
    return "other"


def summarize_profile(text: str, top: int = 15) -> dict:
    """py-spy raw output (one `frame;frame;... count` line per stack, first frame the thread) as percentages
    of all samples: self time by function and by area; inclusive time by function. Samples of threads other
    than the main one are one area each ("thread NAME"): the SQLite store's worker, say."""
    selfs: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    areas_self: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = "MainThread"
        if frames[0].startswith("thread "):
            thread = frames[0].split(": ", 1)[-1]
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += n
        leaf = _short(frames[-1])
        selfs[leaf] += n
        if thread != "MainThread":
            areas_self[f"thread {thread.rstrip('_0123456789')}"] += n
        else:
            areas_self[area(leaf)] += n
        for f in {_short(f) for f in frames}:
            incl[f] += n

    def pct(counter, k):
        return [(name, round(100 * v / total, 1)) for name, v in counter.most_common(k)] if total else []

    return {"samples": total, "self": pct(selfs, top), "inclusive": pct(incl, top + 10),
            "areas_self": pct(areas_self, 20)}


def _short(frame: str) -> str:
    """'handle (/x/y/gateway/proxy.py:85)' -> 'handle (gateway/proxy.py)'."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/lib/python3.11/", str(REPO) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{name} ({path})"


def uses(pid: int) -> dict[str, bool]:
    """Which event loop and HTTP parser the gateway process really loaded (uvicorn's `auto`)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return {}
    return {"uvloop": "uvloop/loop" in maps, "httptools": "httptools/parser" in maps}


def smoke(system: System) -> None:
    """One request of each kind, checked, before any load (a 401 must not pass for speed)."""
    headers = {"authorization": system.auth} if system.auth else {}
    with httpx.Client(timeout=30, trust_env=False) as client:
        r = client.post(f"{system.json_url}/v1/chat/completions", headers=headers,
                        json={"model": system.json_model, "messages": [{"role": "user", "content": "hi"}]})
        if r.status_code != 200 or not r.json().get("choices"):
            raise RuntimeError(f"{system.name}: non-streaming smoke request failed: {r.status_code} {r.text[:300]}")
        r = client.post(f"{system.sse_url}/v1/chat/completions", headers=headers,
                        json={"model": system.sse_model, "stream": True, "stream_options": {"include_usage": True},
                              "messages": [{"role": "user", "content": "hi"}]})
        events = r.text.count("data:") - r.text.count("data: [DONE]")
        if r.status_code != 200 or events < TOKENS:
            raise RuntimeError(f"{system.name}: streaming smoke request failed: {r.status_code}, {events} events")


# ---------------------------------------------------------------------------------------------- reporting


def fmt(v: float | None, digits: int = 0, suffix: str = "") -> str:
    if v is None:
        return "—"
    return f"{v:,.{digits}f}{suffix}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "—"
    r = a / b
    return f"{r:,.2f}x" if r < 100 else f"{r:,.0f}x"


def table(samples: dict[str, Samples], soak_result: dict | None) -> str:
    # gateway-redis: the Redis store; --knobs: the same gateway, other settings
    variants = [name for name in samples if name.startswith("gateway ") or name == "gateway-redis"]
    cols = ["direct", "gateway", *variants, *PEERS]
    m = {name: s for name, s in samples.items()}

    def row(label, get, digits=0, ratios=True):
        values = {c: get(m[c]) if c in m else None for c in cols}
        cells = [fmt(values[c], digits) for c in cols]
        rs = [ratio(values["gateway"], values[p]) if ratios else "—" for p in PEERS]
        return [label, *cells, *rs]

    rows = [
        row("requests/s, c=64, non-streaming", lambda s: median(s.rps)),
        row("added latency p50, c=1 (ms)", lambda s: median(s.added_p50) if s.added_p50 else None, 3),
        row("added latency p99, c=1 (ms)", lambda s: median(s.added_p99) if s.added_p99 else None, 3),
        row("latency p50 / p99, c=1 (ms, absolute)", lambda s: None, 3, ratios=False),
        row(f"SSE token events/s, 64 streams x {TOKENS}", lambda s: median(s.events)),
        row("stream time to last byte p50 (ms)", lambda s: median(s.ttlb50), 1),
        row("stream time to last byte p99 (ms)", lambda s: median(s.ttlb99), 1),
        row("CPU ms per request, c=64", lambda s: median(s.cpu_ms), 3),
        row("CPU µs per SSE token event, 64 streams", lambda s: median(s.cpu_us_event), 2),
        row("RSS after the rounds (MiB)", lambda s: s.rss_mib, 0),
    ]
    absolute = rows[3]
    for i, c in enumerate(cols):
        s = m.get(c)
        absolute[1 + i] = f"{median(s.p50):.3f} / {median(s.p99):.3f}" if s and s.p50 else "—"
    if soak_result:
        n1, n2 = soak_result["requests_first"], soak_result["requests_total"]
        blank = ["—"] * (len(cols) - 2 + len(PEERS))
        c = soak_result["connections"]
        rows.append([f"gateway soak (c={c}): RSS after {n1:,} / {n2:,} requests (MiB)", "—",
                     f"{soak_result['rss_first_mib']:.1f} / {soak_result['rss_total_mib']:.1f}", *blank])
        rows.append(["gateway soak: RSS growth", "—", f"{soak_result['growth_pct']:+.2f}%", *blank])
    header = ["figure (median of rounds)", "direct (stand-in)", *cols[1:], *(f"gateway ÷ {p}" for p in PEERS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def targets(samples: dict[str, Samples], soak_result: dict | None) -> list[tuple[str, bool | None, str]]:
    g, ll, vr = samples.get("gateway"), samples.get("LiteLLM"), samples.get("vllm-router")
    out: list[tuple[str, bool | None, str]] = []

    def check(label, value, goal, ok):
        out.append((label, ok, f"measured {value}, target {goal}"))

    if g and ll:
        r = median(g.rps) / median(ll.rps)
        check("requests/s >= 20x LiteLLM", f"{r:.1f}x", ">= 20x", r >= 20)
    if g and vr:
        r = median(g.rps) / median(vr.rps)
        check("requests/s >= 25% of vllm-router", f"{r * 100:.1f}%", ">= 25%", r >= 0.25)
    if g and g.added_p50:
        v = median(g.added_p50)
        check("added p50 at c=1 <= 0.5 ms", f"{v:.3f} ms", "<= 0.5 ms", v <= 0.5)
    if g and vr:
        r = median(g.events) / median(vr.events)
        check("streaming events/s >= 40% of vllm-router", f"{r * 100:.1f}%", ">= 40%", r >= 0.40)
    gr = samples.get("gateway-redis")
    if g and gr:
        r = median(gr.rps) / median(g.rps)
        check("requests/s with the Redis store >= 80% of the embedded store", f"{r * 100:.1f}%", ">= 80%", r >= 0.8)
    if soak_result:
        v = soak_result["growth_pct"]
        n1, n2 = soak_result["requests_first"], soak_result["requests_total"]
        check(f"RSS growth between {n1:,} and {n2:,} requests < 5%", f"{v:+.2f}%", "< 5%", v < 5)
    return out


def tracing_line(traced: Samples, plain: Samples, sink: dict | None) -> str:
    """Tracing on at ratio 1.0 against the same gateway with tracing off, measured in the same rounds."""
    rps = median(traced.rps) / median(plain.rps)
    events = median(traced.events) / median(plain.events) if median(plain.events) else float("nan")
    per_round_rps = ", ".join(f"{a / b:.0%}" for a, b in zip(traced.rps, plain.rps) if b)
    got = f"; the sink got {sink['exports']:,} exports, {sink['bytes'] / 2**20:.1f} MiB" if sink else ""
    return (f"{'MET   ' if rps >= 0.85 else 'MISSED'} tracing at ratio 1.0 within 15% of tracing off: "
            f"{median(traced.rps):,.0f} vs {median(plain.rps):,.0f} req/s at c=64 = {rps:.1%} (per round: "
            f"{per_round_rps}); SSE events/s {events:.1%}; added p50 at c=1 {median(traced.added_p50):.3f} vs "
            f"{median(plain.added_p50):.3f} ms; CPU ms per request {median(traced.cpu_ms):.3f} vs "
            f"{median(plain.cpu_ms):.3f}{got}")


def per_round(samples: dict[str, Samples]) -> str:
    """gateway ÷ each peer round by round (each pair measured minutes apart at most): the spread shows how far
    the machine's own drift moves the medians."""
    g = samples.get("gateway")
    lines = []
    for peer in PEERS:
        p = samples.get(peer)
        if not g or not p or len(g.rps) != len(p.rps):
            continue
        rps = " / ".join(f"{a / b:.2f}x" for a, b in zip(g.rps, p.rps, strict=True))
        events = " / ".join(f"{a / b:.2f}x" for a, b in zip(g.events, p.events, strict=True))
        lines.append(f"per round, gateway ÷ {peer}: requests/s {rps}; SSE events/s {events}")
    return "\n".join(lines)


def breakdown(rows: list[dict], gateway_cpu_ms: float | None) -> str:
    """The gateway's CPU per request at c=64 split by the ceilings: server, HTTP client, everything else."""
    by = {r["label"]: r["cpu_ms"] for r in rows}
    server = by.get("uvicorn: fixed reply (no upstream)")
    client = by.get("uvicorn + the gateway's client (backends/http1.py)")
    if not gateway_cpu_ms or server is None or client is None:
        return ""
    rest = gateway_cpu_ms - client
    return (f"where the gateway's {gateway_cpu_ms:.3f} CPU ms per request (c=64) go, by difference: "
            f"ASGI server (uvicorn) {server:.3f} ms ({100 * server / gateway_cpu_ms:.0f}%), "
            f"upstream call (backends/http1.py) {client - server:.3f} ms "
            f"({100 * (client - server) / gateway_cpu_ms:.0f}%), "
            f"the gateway's own code (pipeline, routing, metrics, logging, usage accounting) {rest:.3f} ms "
            f"({100 * rest / gateway_cpu_ms:.0f}%)")


def versions() -> dict[str, str]:
    def out(cmd):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
            return (p.stdout + p.stderr).strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired, IndexError):
            return "?"

    def pip_version(venv, dist):
        return out([str(install.venv_python(venv)), "-c",
                    f"import importlib.metadata as m; print(m.version('{dist}'))"])

    commit = out(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "gateway", "policies",
                            "backends"], capture_output=True, text=True, check=False).stdout.strip()
    return {"gateway": commit + (" + uncommitted changes" if dirty else ""),
            "litellm": pip_version("litellm", "litellm"), "vllm-router": pip_version("router", "vllm-router"),
            "nginx": out(["nginx", "-v"]), "wrk": out(["wrk", "-v"]), "python": platform.python_version()}


def machine() -> dict[str, str]:
    model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {"cores": str(os.cpu_count()), "cpu": model, "kernel": platform.release(),
            "memory_gib": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f}"}


# ---------------------------------------------------------------------------------------------- main


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds before each phase")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-timeout", type=float, default=120.0, help="bound on one streaming phase")
    p.add_argument("--soak-first", type=int, default=10_000)
    p.add_argument("--soak-total", type=int, default=100_000)
    p.add_argument("--soak-connections", type=int, default=4,
                   help="the soak's concurrency (the gateway's best throughput, so 100k requests fit the budget)")
    p.add_argument("--soak-timeout", type=float, default=420.0)
    p.add_argument("--no-soak", action="store_true")
    p.add_argument("--profile-seconds", type=int, default=8)
    p.add_argument("--profile-streams", action="store_true", help="profile under the streaming load instead")
    p.add_argument("--profile-native", action="store_true",
                   help="py-spy --native: C frames too (uvloop, httptools, syscalls); the raw profile is kept")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--systems", default="gateway,gateway-redis,LiteLLM,vllm-router,nginx",
                   help="comma-separated subset of gateway,gateway-redis (the Redis store, every request taking a"
                        " fleet-wide cap slot),LiteLLM,vllm-router,nginx")
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="extra argument for `llm-gateway serve` (repeatable), e.g. --gateway-arg=--log-level=warning")
    p.add_argument("--gateway-env", action="append", default=[], help="NAME=VALUE for the gateway (repeatable)")
    p.add_argument("--knobs", action="store_true",
                   help="also measure the gateway with settings that need no code change, as extra columns")
    p.add_argument("--routing-compare", action="store_true",
                   help="also measure the gateway with two replicas per model under the default routing profile and"
                        " under least-in-flight alone (what routing costs per request)")
    p.add_argument("--store-compare", action="store_true",
                   help="also measure the gateway on a standalone Redis, a Sentinel set and a Redis Cluster (each"
                        " built on core 0 from Debian's redis-server), as extra columns")
    p.add_argument("--ledger-compare", action="store_true",
                   help="also measure the gateway with the cost ledger switched off (what the ledger costs per"
                        " request)")
    p.add_argument("--tracing-compare", action="store_true",
                   help="also measure the gateway with tracing on at sampling ratio 1.0, exporting to a local OTLP/HTTP"
                        " sink on the load core (what tracing costs per request)")
    p.add_argument("--variants-compare", action="store_true",
                   help="also measure the gateway with each model split 80/20 over two variants of the same backend"
                        " (what variant assignment costs per request)")
    p.add_argument("--edge-compare", action="store_true",
                   help="also measure the gateway without its bounded edge (uvicorn's own httptools protocol): what"
                        " the client-side bounds cost per request, held to 5%%")
    p.add_argument("--baseline-tree", metavar="DIR",
                   help="also measure the gateway as the source tree DIR has it (e.g. `git archive` of the commit"
                        " before a change, unpacked), a column held to 3%% against this tree's")
    p.add_argument("--no-ceilings", action="store_true", help="skip the minimal-app ceilings (ceilings.py)")
    p.add_argument("--ceiling-seconds", type=float, default=2.0)
    p.add_argument("--out", help="write the results as JSON here (default .cache/bench/results-<time>.json)")
    p.add_argument("--dry-run", action="store_true",
                   help="install, start and measure nothing: every system on paper with made-up figures, so each"
                        " path through the options runs to its table in a second (tests/unit/test_bench_peers_args.py)")
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def start_store_variants(procs, work: Path, standin, env: dict, args) -> list[System]:
    """The gateway once per Redis set-up (their servers inherit this process's core, LOAD_CORE); each set-up
    is stopped at exit."""
    from tests.support import redis_ha, redis_server

    systems = []
    for label, setup in STORE_COMPARE:
        log(f"starting {label} on core {SUT_CORE} (its Redis on core {LOAD_CORE})")
        servers = getattr(redis_ha, setup, None) or getattr(redis_server, setup)
        servers = servers()
        atexit.register(servers.close)
        servers.start()
        systems.append(start_gateway(procs, work, standin, name=label.replace(" ", "-"), env_extra=env,
                                     args=args.gateway_arg, store={"kind": "redis", "url": servers.url}))
        systems[-1].name = label
    return systems


def within_10_percent(samples: dict[str, Samples], label: str, baseline: str, target: str,
                      floor: float = 0.9) -> None:
    """MET/MISSED lines: requests/s at c=64 and SSE token events/s of `label` against `baseline`, measured in the
    same rounds, with CPU per request and per event (less moved by the machine's drift)."""
    if label not in samples or baseline not in samples or not median(samples[baseline].rps):
        return
    a, b = samples[label], samples[baseline]
    ratio = median(a.rps) / median(b.rps)
    print(f"{'MET   ' if ratio >= floor else 'MISSED'} {target}: {median(a.rps):,.0f} vs {median(b.rps):,.0f} req/s"
          f" at c=64 = {ratio:.1%} (per round: " + ", ".join(f"{x / y:.0%}" for x, y in zip(a.rps, b.rps) if y)
          + f"); CPU ms per request {median(a.cpu_ms):.3f} vs {median(b.cpu_ms):.3f} (per round: "
          + ", ".join(f"{x / y:.0%}" for x, y in zip(a.cpu_ms, b.cpu_ms) if y) + ")")
    print(f"{'MET   ' if median(a.events) >= floor * median(b.events) else 'MISSED'} {target}, streaming: "
          f"{median(a.events):,.0f} vs {median(b.events):,.0f} SSE token events/s = "
          f"{median(a.events) / median(b.events):.1%} (per round: "
          + ", ".join(f"{x / y:.0%}" for x, y in zip(a.events, b.events) if y)
          + f"); CPU µs per event {median(a.cpu_us_event):.2f} vs {median(b.cpu_us_event):.2f} (per round: "
          + ", ".join(f"{x / y:.0%}" for x, y in zip(a.cpu_us_event, b.cpu_us_event) if y) + ")")


class Lab:
    """What a run does to this machine: install, pin cores, start the systems, load and measure them. `main` does
    all of it through one of these, so `--dry-run` can swap in `PaperLab` and leave the rest of `main` as it is."""

    install = staticmethod(install.ensure_all)
    start_standin = staticmethod(start_standin)
    start_gateway = staticmethod(start_gateway)
    start_litellm = staticmethod(start_litellm)
    start_router = staticmethod(start_router)
    start_floor = staticmethod(start_floor)
    start_redis = staticmethod(start_redis)
    start_store_variants = staticmethod(start_store_variants)
    smoke = staticmethod(smoke)
    measure = staticmethod(measure)
    profile = staticmethod(profile)
    soak = staticmethod(soak)
    measure_ceilings = staticmethod(measure_ceilings)

    def pin(self) -> None:
        if len(os.sched_getaffinity(0)) < 2 or not {LOAD_CORE, SUT_CORE} <= os.sched_getaffinity(0):
            raise SystemExit(f"needs cores {LOAD_CORE} and {SUT_CORE}: the load on one, the system under test on the"
                             " other")
        os.sched_setaffinity(0, {LOAD_CORE})  # this process and the load generators it starts stay off core 1

    def start_sink(self, procs: Procs) -> str:
        port = free_port()
        procs.start("otlp-sink", [sys.executable, "-m", "tests.benchmarks.peers.otlp_sink", str(port)], LOAD_CORE,
                    cwd=REPO)
        return f"http://127.0.0.1:{port}"

    def sink_stats(self, url: str) -> dict:
        return httpx.get(f"{url}/stats", timeout=10).json()

    def uses(self, system: System) -> dict[str, bool]:
        return uses(system.procs[0].pid)


class PaperLab(Lab):
    """--dry-run: nothing installed, started or loaded; systems without processes and figures made up from their
    names (the same on every run), so the tables, ratios and targets of every option are computed and printed."""

    def install(self) -> SimpleNamespace:
        return SimpleNamespace(did=[], seconds=0.0)

    def pin(self) -> None:
        pass

    def start_standin(self, procs: Procs, work: Path) -> SimpleNamespace:
        return SimpleNamespace(json_port=0, sse_port=0, system=self.start_gateway(procs, work, None, name="direct"))

    def start_gateway(self, procs: Procs, work: Path, standin, name: str = "gateway", **_options) -> System:
        return System(name, "http://127.0.0.1:9", "http://127.0.0.1:9")

    def start_litellm(self, procs: Procs, work: Path, standin) -> System:
        return self.start_gateway(procs, work, standin, name="LiteLLM")

    def start_router(self, procs: Procs, work: Path, standin) -> System:
        return self.start_gateway(procs, work, standin, name="vllm-router")

    def start_floor(self, procs: Procs, work: Path, standin) -> System:
        return self.start_gateway(procs, work, standin, name="nginx")

    def start_redis(self, procs: Procs, work: Path) -> str:
        return "redis://127.0.0.1:9"

    def start_store_variants(self, procs: Procs, work: Path, standin, env: dict, args) -> list[System]:
        return [self.start_gateway(procs, work, standin, name=label) for label, _ in STORE_COMPARE]

    def start_sink(self, procs: Procs) -> str:
        return "http://127.0.0.1:9"

    def sink_stats(self, url: str) -> dict:
        return {"exports": 1, "bytes": 1}

    def smoke(self, system: System) -> None:
        pass

    def uses(self, system: System) -> dict[str, bool]:
        return {"uvloop": False, "httptools": False}

    def measure(self, system: System, samples: Samples, direct: dict | None, scripts: dict[str, Path], args) -> dict:
        rps = 1000.0 + zlib.crc32(system.name.encode()) % 1000
        return keep(samples, direct, {"rps": rps, "p50": 1000 / rps, "p99": 2000 / rps, "events": 10 * rps,
                                      "cpu_ms": 1000 / rps, "cpu_us_event": 100 / rps, "streams": args.streams,
                                      "ttlb50": 100.0, "ttlb99": 200.0})

    def profile(self, system: System, scripts: dict[str, Path], work: Path, args) -> dict:
        return summarize_profile(f"MainThread;serve (gateway/proxy.py:1);finish (gateway/proxy.py:2) {args.rounds}")

    def soak(self, procs: Procs, work: Path, standin, args, rps_hint: float) -> dict:
        return {"connections": args.soak_connections, "rss_start_mib": 50.0, "complete": True,
                "requests_first": args.soak_first, "rss_first_mib": 60.0, "requests_total": args.soak_total,
                "rss_total_mib": 60.5, "growth_pct": 0.8}

    def measure_ceilings(self, procs: Procs, work: Path, standin, seconds: float, warmup: float, log=print) -> list:
        return [{"label": v.label, "rps": 2000.0, "cpu_ms": 0.1 * (i + 1), "p50": 0.5, "p99": 1.0}
                for i, v in enumerate(CEILING_VARIANTS)]


def main(argv=None) -> int:
    args = parse_args(argv)
    lab = PaperLab() if args.dry_run else Lab()
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(wanted) - {"gateway", "gateway-redis", *PEERS}
    if unknown:
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
    lab.pin()
    started = time.time()
    log(f"installing (once) into {install.CACHE.relative_to(REPO)} ...")
    installed = lab.install()
    log(f"install: {', '.join(installed.did) or 'nothing new'} ({installed.seconds:.1f} s)")
    load_before = loadavg()
    log(f"load average before: {load_before}")

    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    procs = Procs(work)
    atexit.register(procs.stop_all)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    samples: dict[str, Samples] = {}
    soak_result = prof = sink_stats = None
    ceiling_rows: list[dict] = []
    gateway_uses: dict[str, bool] = {}
    try:
        standin = lab.start_standin(procs, work)
        systems: list[System] = [standin.system]
        env = dict(e.split("=", 1) for e in args.gateway_env)
        starters = {"gateway": lambda: lab.start_gateway(procs, work, standin, env_extra=env, args=args.gateway_arg),
                    "LiteLLM": lambda: lab.start_litellm(procs, work, standin),
                    "vllm-router": lambda: lab.start_router(procs, work, standin),
                    "nginx": lambda: lab.start_floor(procs, work, standin),
                    "gateway-redis": lambda: lab.start_gateway(procs, work, standin, name="gateway-redis",
                                                               env_extra=env, args=args.gateway_arg,
                                                               redis_url=lab.start_redis(procs, work))}
        for name in wanted:
            log(f"starting {name} on core {SUT_CORE}")
            systems.append(starters[name]())
        if args.knobs and "gateway" in wanted:
            for label, extra_args, extra_env in KNOBS:
                log(f"starting {label} on core {SUT_CORE}")
                systems.append(lab.start_gateway(procs, work, standin, name=label, env_extra={**env, **extra_env},
                                             args=[*args.gateway_arg, *extra_args]))
        if args.ledger_compare and "gateway" in wanted:
            for label, sections in LEDGER_COMPARE:
                log(f"starting {label} on core {SUT_CORE}")
                systems.append(lab.start_gateway(procs, work, standin, name=label.replace(" ", "-"), env_extra=env,
                                             args=args.gateway_arg, policy_extra=sections))
                systems[-1].name = label
        if args.routing_compare and "gateway" in wanted:
            for label, routing in ROUTING_COMPARE:  # not `profile`: that is the py-spy function main calls below
                log(f"starting {label} on core {SUT_CORE}")
                systems.append(lab.start_gateway(procs, work, standin, name=label.replace(" ", "-"), env_extra=env,
                                             args=args.gateway_arg, routing=routing, replicas=2))
                systems[-1].name = label
        if args.variants_compare and "gateway" in wanted:
            log(f"starting {VARIANTS} on core {SUT_CORE}")
            systems.append(lab.start_gateway(procs, work, standin, name="gateway-variants", env_extra=env,
                                         args=args.gateway_arg, variants=True))
            systems[-1].name = VARIANTS
        if args.edge_compare and "gateway" in wanted:
            log(f"starting {PLAIN_EDGE} on core {SUT_CORE}")
            systems.append(lab.start_gateway(procs, work, standin, name="gateway-plain-edge",
                                         env_extra={**env, "PYTHONPATH": str(REPO)}, args=args.gateway_arg,
                                         launcher=[sys.executable, "-m", "tests.benchmarks.peers.plain_edge"]))
            systems[-1].name = PLAIN_EDGE
        if args.baseline_tree and "gateway" in wanted:
            log(f"starting {BASELINE} ({args.baseline_tree}) on core {SUT_CORE}")
            systems.append(lab.start_gateway(procs, work, standin, name="gateway-baseline", args=args.gateway_arg,
                                             env_extra={**env, "PYTHONPATH": str(Path(args.baseline_tree).resolve())}))
            systems[-1].name = BASELINE
        if args.store_compare and "gateway" in wanted:
            systems += lab.start_store_variants(procs, work, standin, env, args)
        sink_url = None
        if args.tracing_compare and "gateway" in wanted:
            sink_url = lab.start_sink(procs)
            log(f"starting {TRACED} on core {SUT_CORE}")
            systems.append(lab.start_gateway(procs, work, standin, name=TRACED.replace(" ", "-"), env_extra=env,
                                         args=args.gateway_arg, policy_extra={"tracing": {
                                             "enabled": True, "sampling_ratio": 1.0,
                                             "endpoint": f"{sink_url}/v1/traces"}}))
            systems[-1].name = TRACED
        for system in systems:
            lab.smoke(system)
        by_name = {s.name: s for s in systems}
        if "gateway" in by_name:
            gateway_uses = lab.uses(by_name["gateway"])
            log(f"gateway process loaded: {gateway_uses}")
        scripts = {s.name: write_script(work / f"{s.name}.lua", s.auth) for s in systems}
        samples = {s.name: Samples() for s in systems}
        measured = [s for s in systems if s.name != "direct"]
        for r in range(args.rounds):
            k = r % len(measured)
            order = measured[k:] + measured[:k]
            log(f"round {r + 1}/{args.rounds}: direct, {', '.join(s.name for s in order)}")
            direct = lab.measure(standin.system, samples["direct"], None, scripts, args)
            log(f"  direct: {direct['rps']:,.0f} req/s, p50 {direct['p50']:.3f} ms, "
                f"{direct['events']:,.0f} events/s")
            for system in order:
                got = lab.measure(system, samples[system.name], direct, scripts, args)
                log(f"  {system.name}: {got['rps']:,.0f} req/s, p50 {got['p50']:.3f} ms, "
                    f"{got['events']:,.0f} events/s, {got['cpu_ms']:.3f} CPU ms/req, "
                    f"{got['cpu_us_event']:.2f} CPU µs/event")
        if sink_url is not None:
            sink_stats = lab.sink_stats(sink_url)
        for system in systems:
            samples[system.name].rss_mib = sum(p.rss_bytes() for p in system.procs) / 2**20
        if "gateway" in by_name and not args.no_profile:
            log(f"profiling the gateway under c=64 for {args.profile_seconds} s (py-spy)")
            prof = lab.profile(by_name["gateway"], scripts, work, args)
        if "gateway" in by_name and not args.no_soak:
            log(f"soak: a fresh gateway, {args.soak_first:,} then {args.soak_total:,} requests at "
                f"c={args.soak_connections}")
            soak_result = lab.soak(procs, work, standin, args, median(samples["gateway"].rps) or 1000)
        if not args.no_ceilings:
            log("ceilings: minimal apps on core 1 (ceilings.py)")
            ceiling_rows = lab.measure_ceilings(procs, work, standin, args.ceiling_seconds, 0.5,
                                            log=lambda m: log(m.strip()))
    except KeyboardInterrupt:
        log("interrupted; stopping every process")
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
        return 130
    except Exception:
        log(f"failed; the processes' logs are in {work}")
        raise
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
    shutil.rmtree(work, ignore_errors=True)
    load_after = loadavg()

    report = table(samples, soak_result)
    checks = targets(samples, soak_result)
    print()
    print(report)
    print()
    for label, ok, detail in checks:
        print(f"{'MET   ' if ok else 'MISSED'} {label}: {detail}")
    (dflt, _), (lif, _) = ROUTING_COMPARE
    within_10_percent(samples, dflt, lif, "default routing profile within 10% of least-in-flight")
    within_10_percent(samples, VARIANTS, "gateway", "variants within 10% of a single variant")
    within_10_percent(samples, "gateway", BASELINE, "this tree within 3% of the baseline tree", 0.97)
    within_10_percent(samples, "gateway", PLAIN_EDGE, "the bounded edge within 5% of an unbounded one", 0.95)
    (standalone, _), *others = STORE_COMPARE
    for label, _ in others:
        within_10_percent(samples, label, standalone, f"{label} within 10% of {standalone}")
    if TRACED in samples and "gateway" in samples and median(samples["gateway"].rps):
        print(tracing_line(samples[TRACED], samples["gateway"], sink_stats))
    rounds = per_round(samples)
    if rounds:
        print(rounds)
    if ceiling_rows:
        print("\nceilings: minimal apps on the same core under the same load (ceilings.py)\n")
        print(ceilings_table(ceiling_rows, median(samples["direct"].p50) if "direct" in samples else None))
        if "gateway" in samples:
            print("\n" + breakdown(ceiling_rows, median(samples["gateway"].cpu_ms)))
    if prof and "error" not in prof:
        print(f"\ngateway profile under {'64 streams' if args.profile_streams else 'c=64'} ({prof['samples']} samples; % of samples):")
        print("  self time by area:")
        for n, p in prof["areas_self"]:
            print(f"    {p:5.1f}%  {n}")
        print("  top functions (self):")
        for n, p in prof["self"]:
            print(f"    {p:5.1f}%  {n}")
        print("  top functions (inclusive):")
        for n, p in prof["inclusive"]:
            print(f"    {p:5.1f}%  {n}")
    elif prof:
        print(f"\nprofile: {prof['error']}")
    mach, vers = machine(), versions()
    print(f"\nmachine: {mach['cores']} cores, {mach['cpu']}, kernel {mach['kernel']}; systems on core {SUT_CORE}, "
          f"load and stand-in on core {LOAD_CORE}; load average before {load_before}, after {load_after}")
    print("versions: " + "; ".join(f"{k} {v}" for k, v in vers.items()))
    if gateway_uses:
        print("gateway process loaded: " + ", ".join(f"{k}={v}" for k, v in gateway_uses.items()))
    elapsed = time.time() - started
    print(f"install {installed.seconds:.1f} s; whole run {elapsed:.0f} s")

    out = Path(args.out) if args.out else install.CACHE / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({
        "args": vars(args), "machine": mach, "versions": vers, "load_before": load_before, "load_after": load_after,
        "install_seconds": installed.seconds, "installed": installed.did, "elapsed_seconds": elapsed,
        "gateway_uses": gateway_uses, "samples": {k: v.__dict__ for k, v in samples.items()},
        "soak": soak_result, "profile": prof, "table": report, "ceilings": ceiling_rows,
        "targets": [{"target": t, "met": ok, "detail": d} for t, ok, d in checks],
    }, indent=2))
    print(f"results: {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
