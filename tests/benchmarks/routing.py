"""Routing benchmark: an agent-like workload over two real CPU vLLM servers, through the gateway, per profile.

    python -m tests.benchmarks.routing                     # what `make bench-routing` runs
    python -m tests.benchmarks.routing --profiles ceiling,default --workloads hot --conversations 24

Two `vllm serve` processes (prefix caching on, vLLM's default), each pinned to its own core, serve the `bench`
model (scripts/build_tiny_model.py --size bench: a tiny model's prefill of a 2k-token prompt is too cheap for
the cache to matter). One real `llm-gateway serve` lists both as replicas of one model; it is started afresh for
each routing profile with `routing: {default_profile: <profile>}`, and shares the two cores with the servers
and with this client (unpinned). The profile "ceiling" has no gateway: the client sends conversation i to
server i mod 2, every turn where its prefix is (what routing aims at). The profile "vllm-router" has no gateway
either: vLLM's own router (PyPI vllm-router, the production-stack/SGLang lineage; its default `cache_aware`
policy, a prefix tree per worker with a load-balance threshold) in front of the same servers, as it ships
(--router-cmd says how to run it). "unguarded" is the default profile with
prefix-affinity's load guard off (BENCH_PROFILES); "precise-prefix" is the default profile with the precise-prefix
scorer, fed by the servers' KV cache events, in prefix-affinity's place (PRECISE); "cost" is the default profile
with prefix-cost in prefix-affinity's place (a conversation stays unless vLLM's queue time there costs more than
recomputing its prefix elsewhere at vLLM's prefill rate: policies/routing/prefix_cost.py).

The workloads (--workloads), each the same request sequence under every profile (seeded):
- distinct: N conversations, each a distinct long system prompt (--system-tokens) and T turns; turn t resends the system
  prompt and every earlier user message and assistant reply, then a new user message (--user-tokens), as an
  agent does. The assistant replies resent are fixed seeded text (the same under every profile), not what the
  random-weight model said; the model is asked for --max-tokens tokens with ignore_eos, streamed.
- hot: the same, but every conversation's system prompt starts with one shared prompt (a hot prefix, the mean
  of --system-tokens long), followed by --own-tokens of its own.
- pressure: as distinct, with as many active conversations as make their working set --pressure (1.05) times
  all the servers' caches together, by vLLM's own figures (cache_config_info, /tokenize), and twice as many
  conversations in all; alone, --print-kv-bytes sizes the caches so that --active conversations are that.
- A closed loop of --active conversations at a time: a worker takes the next conversation when its current one
  ends. Between two turns of a conversation the worker waits its tool time (seeded, uniform in --tool-time).
  Without that pause least-in-flight is accidentally affine (the slot that just freed is on the server that
  holds the conversation), and no profile can be told from another (docs/benchmarks.md, field notes).
- Sizing: each server's KV cache (--kv-cache-memory-bytes) is set so that the working set, active
  conversations x mean tokens per conversation, is --overflow times one server's cache: it overflows one
  server but fits in both. vLLM's own figures (cache_config_info, /tokenize) are checked and printed.

Before each profile both servers' prefix caches are emptied (POST /reset_prefix_cache, which vLLM serves with
VLLM_SERVER_DEV_MODE=1), so each profile starts cold; vllm:prefix_cache_hits_total / _queries_total are read
from each server before and after (the hit rate is vLLM's own, not the gateway's guess). Each request carries
x-session-id (the conversation; session-affinity hashes it) and x-request-id, which the gateway passes on and
vLLM logs, so the benchmark can tell which server served which turn ("same server" below: the share of turns
served where the conversation's previous turn was).

Per run, where the time to first token went: the client's TTFT p50 and mean; vLLM's own time to first token,
queue time and prefill time (mean from each histogram's _sum/_count, p50 from its buckets), preemptions and prefix
hit rate, from both servers' /metrics before and after the run; the gateway's queue wait and its TTFT less that
wait (its /metrics). --repeat N runs every profile N times, interleaved (PROFILE#2, ...).
Per profile: TTFT p50/p99 (client side, through the gateway), TTFT p50 of later turns, output tok/s over the
profile's wall time, each server's and the overall prefix-cache hit rate, and the workload's ceiling (every
turn hits all of the previous turn's prompt). Checks per workload, each front's runs averaged (exit status 1
when one fails; `verdict`): the default profile's TTFT p50 at most 1.10x the ceiling's and its mean at most the
ceiling's, its hit rate and req/s at least 0.97x; where vllm-router ran, its TTFT p50 at most 0.85x the
router's; on the hot prefix no server over 60% of the requests and TTFT p99 no worse than least-in-flight's. Every loop is
bounded: each profile by --profile-timeout, each request by the client's timeout.
Results go to .cache/bench/routing-<time>.json.

External servers (e.g. two vLLM servers sharing one GPU, tests/benchmarks/gpu/step5.sh):

    python -m tests.benchmarks.routing --servers http://127.0.0.1:8000,http://127.0.0.1:8001 \
        --served-model qwen3-4b [--server-logs a.log,b.log] [--gateway-cmd "python3 -m gateway"]

uses servers that are already running: nothing is started or stopped but the gateway, each server is named
after its port, and its KV cache size is read from its /metrics (vllm:cache_config_info) instead of being set;
size it beforehand so the working set overflows one server (`--print-kv-bytes --model-dir DIR` prints the
--kv-cache-memory-bytes for the workload and --overflow). The servers must run with VLLM_SERVER_DEV_MODE=1 (the
prefix caches are reset between profiles) and, for the "same server" column, with --enable-log-requests and
their log files given in --server-logs; without logs that column stays empty. The gateway runs as
`llm-gateway` next to this interpreter, else `python -m gateway`, or as --gateway-cmd says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e.vllm_procs import (  # noqa: E402
    BASE_ARGS, VLLMServer, free_port, kv_events_args, metric_value, parse_metrics, start_many, stop_all,
)
from tests.support.probes import wait_http_ok  # noqa: E402

# "ceiling": no gateway, the client sends each conversation to one server (i mod n): every turn where its prefix is
PROFILES = ("ceiling", "default", "vllm-router", "least-in-flight", "session-affinity")
# the default profile with its classes' prefill levels off (arrival order within a class): against "default" on
# servers run with --scheduling-policy priority, what cheapest prefill first (policies/prefill_order.py) changes
ARRIVAL = "default-arrival"
# profiles the benchmark adds to the built-in ones: the default's scorers with prefix-affinity's load guard off
BENCH_PROFILES = {"unguarded": {"scorers": [{"name": "prefix-affinity", "weight": 4, "params": {"guard": False}},
                                            {"name": "vllm-queue", "weight": 2}, {"name": "least-in-flight"}]}}
# the default with prefix-affinity's record of evicted blocks (opt-in): a prompt no replica's LRU matches goes
# back where the record let it go, rather than by load
BENCH_PROFILES["evicted"] = {"scorers": [{"name": "lora-affinity", "weight": 8},
                                         {"name": "prefix-affinity", "weight": 4, "params": {"evicted": 0.125}},
                                         {"name": "vllm-queue", "weight": 2}, {"name": "least-in-flight", "weight": 1}]}
# Not built in either: the default's scorers with precise-prefix (fed by the servers' KV cache events) for
# prefix-affinity; its tokenizer is the model's directory, known only at run time (start_gateway)
PRECISE = {"scorers": [{"name": "precise-prefix", "weight": 4}, {"name": "vllm-queue", "weight": 2},
                       {"name": "least-in-flight", "weight": 1}]}
# "cost": the default's scorers with prefix-cost (stay unless vLLM's queue there costs more than the recompute
# elsewhere, in vLLM's own seconds) in prefix-affinity's place; a candidate for the default (issue: routing where
# the caches are full)
BENCH_PROFILES["cost"] = {"scorers": [{"name": "lora-affinity", "weight": 8}, {"name": "prefix-cost", "weight": 4},
                                      {"name": "vllm-queue", "weight": 2}, {"name": "least-in-flight", "weight": 1}]}
MODEL = "bench"  # the served model name of the servers started here (--served-model for external ones)
CHARS_PER_TOKEN = 4.0  # for sizing only; measured ~4.2 for this text and the models' tokenizer (see /tokenize check)
WORDS = """the a of to and in is for that with as on by this be are from or it an at not if which can when
file list value name data time user task request server model cache prefix token agent tool result call
return function object string number error message response query search read write open close check
update create delete find path line table record field key index node step plan next first last each
all any some more most other new old small large long short fast slow good best simple default current
must should will may need use make take give keep run send get set add remove start stop wait retry""".split()


# -- the workload -------------------------------------------------------------------------------------------

@dataclass
class Conversation:
    id: str
    system: str
    users: list[str]
    replies: list[str]
    tool_times: list[float]  # after turn t (the last one is not used)

    def messages(self, turn: int) -> list[dict]:
        out = [{"role": "system", "content": self.system}]
        for t in range(turn):
            out += [{"role": "user", "content": self.users[t]}, {"role": "assistant", "content": self.replies[t]}]
        return out + [{"role": "user", "content": self.users[turn]}]

    def chars(self) -> int:  # of the last turn's prompt and its reply: what the conversation holds at its end
        return len(self.system) + sum(map(len, self.users)) + sum(map(len, self.replies))


def prose(rng: random.Random, tokens: int) -> str:
    """Seeded sentences of common words, about `tokens` tokens long (~4 characters a token)."""
    out: list[str] = []
    size = 0
    while size < tokens * CHARS_PER_TOKEN:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentence = " ".join(words).capitalize() + "."
        out.append(sentence)
        size += len(sentence) + 1
    return " ".join(out)


# each conversation its own system prompt; one system prompt shared by all; `distinct` with enough active
# conversations that their working set is --pressure (1.05) times all the servers' caches together
WORKLOADS = ("distinct", "hot", "pressure")


def workload(args, kind: str = "distinct", count: int | None = None) -> list[Conversation]:
    """`distinct`: each conversation its own system prompt (--system-tokens). `hot`: one system prompt of the
    same mean length shared by every conversation (a hot prefix), then --own-tokens of the conversation's own.
    `pressure`: as distinct (`count` conversations, default --conversations; the same seed)."""
    rng = random.Random(args.seed)
    lo, hi = args.system_tokens
    shared = "You are one of many agents. " + prose(random.Random(args.seed + 1), (lo + hi) // 2)
    convs = []
    for i in range(count or args.conversations):
        cid = f"conv-{args.seed}-{kind}-{i:04d}"
        if kind == "hot":
            system = shared + f" You are agent {cid}. " + prose(rng, args.own_tokens)
        else:
            system = f"You are agent {cid}. " + prose(rng, rng.randint(lo, hi))
        users = [f"Turn {t}. " + prose(rng, args.user_tokens) for t in range(args.turns)]
        replies = [prose(rng, args.max_tokens) for _ in range(args.turns)]
        tool = [round(rng.uniform(*args.tool_time), 3) for _ in range(args.turns)]
        convs.append(Conversation(cid, system, users, replies, tool))
    return convs


# -- vLLM servers ---------------------------------------------------------------------------------------------

class BenchServer(VLLMServer):
    """A VLLMServer with the benchmark's context length and KV cache size in place of the tests' defaults."""

    def __init__(self, model_dir: Path, label: str, *, max_model_len: int, kv_bytes: int, **kw) -> None:
        super().__init__(model_dir, MODEL, **kw)
        self.label = label  # both serve MODEL; this names the server in the results and in the gateway
        self.overrides = {"--max-model-len": str(max_model_len), "--kv-cache-memory-bytes": str(kv_bytes)}

    scheduling = "fcfs"  # vLLM's --scheduling-policy (--scheduling-policy here sets it for the servers started)

    def command(self) -> list[str]:
        cmd = super().command()
        for i, arg in enumerate(cmd[:-1]):
            if arg in self.overrides and cmd[i + 1] in BASE_ARGS:
                cmd[i + 1] = self.overrides[arg]
        return cmd + ["--scheduling-policy", self.scheduling]


class ExternalServer:
    """A vLLM server started elsewhere (--servers): read and reset, never started or stopped here."""

    def __init__(self, url: str, log_path: Path | None = None) -> None:
        self.base_url = url.rstrip("/")
        self.api_base = self.base_url + "/v1"
        self.label = f"vllm-{urlsplit(self.base_url).port}"
        self.log_path = log_path

    def __repr__(self) -> str:
        return f"ExternalServer({self.base_url})"

    def metrics_text(self, timeout: float = 5.0) -> str:
        r = httpx.get(self.base_url + "/metrics", timeout=timeout, trust_env=False)
        r.raise_for_status()
        return r.text

    def metrics(self, timeout: float = 5.0):
        return parse_metrics(self.metrics_text(timeout))

    def log_text(self) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def kv_bytes_per_token(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2  # K and V, bf16


def cache_config(server: VLLMServer) -> dict[str, int]:
    text = server.metrics_text()
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}
    return {k: int(labels[k]) for k in ("block_size", "num_gpu_blocks") if labels.get(k, "").isdigit()}


# vLLM's own histograms read before and after each run (seconds): time to first token, waiting to be scheduled,
# in prefill
VLLM_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                   "prefill": "vllm:request_prefill_time_seconds"}
# the gateway's (read once at the end of a run: each run has a fresh gateway)
GATEWAY_HISTOGRAMS = {"ttft": "llm_gateway_time_to_first_token_seconds", "queue": "llm_gateway_queue_wait_seconds",
                      "overhead": "llm_gateway_overhead_seconds"}


def counters(server: VLLMServer) -> dict:
    m = server.metrics()
    return {
        "hits": metric_value(m, "vllm:prefix_cache_hits_total"),
        "queries": metric_value(m, "vllm:prefix_cache_queries_total"),
        "prompt_tokens": metric_value(m, "vllm:prompt_tokens_total"),
        "generation_tokens": metric_value(m, "vllm:generation_tokens_total"),
        "requests": metric_value(m, "vllm:request_success_total"),
        "preemptions": metric_value(m, "vllm:num_preemptions_total"),
        **{key: histogram(m, name) for key, name in VLLM_HISTOGRAMS.items()},
    }


def histogram(m: dict, name: str) -> dict:
    """A Prometheus histogram of parse_metrics' samples (prometheus_client's parser), summed over label sets:
    {"sum", "count", "buckets": [[upper edge, cumulative count], ...]}; all 0 when the server has none."""
    buckets: dict[float, float] = {}
    for (sample, labels), value in m.items():
        if sample == name + "_bucket":
            le = float(dict(labels).get("le", "inf"))
            buckets[le] = buckets.get(le, 0.0) + value
    return {"sum": metric_value(m, name + "_sum"), "count": metric_value(m, name + "_count"),
            "buckets": sorted(buckets.items())}


def histogram_delta(before: list[dict], after: list[dict]) -> dict:
    """after - before, summed over servers (the same bucket edges: one model, one vLLM)."""
    out: dict = {"sum": 0.0, "count": 0.0, "buckets": {}}
    for b, a in zip(before, after):
        out["sum"] += a["sum"] - b["sum"]
        out["count"] += a["count"] - b["count"]
        was = dict(b["buckets"])
        for le, n in a["buckets"]:
            out["buckets"][le] = out["buckets"].get(le, 0.0) + n - was.get(le, 0.0)
    out["buckets"] = sorted(out["buckets"].items())
    return out


def histogram_figures(h: dict) -> dict[str, float | None]:
    """{"mean_ms", "p50_ms", "count"}: the mean from _sum/_count, the median from the buckets as Prometheus'
    histogram_quantile reads them (linear within the bucket it falls in; the last finite edge for +Inf)."""
    count = h["count"]
    if count <= 0:
        return {"mean_ms": None, "p50_ms": None, "count": 0}
    p50, lower, below = None, 0.0, 0.0
    for le, cum in h["buckets"]:
        if cum >= count / 2:
            if le == float("inf"):
                p50 = lower
            else:
                p50 = lower + (le - lower) * ((count / 2 - below) / (cum - below) if cum > below else 1.0)
            break
        lower, below = le, cum
    return {"mean_ms": round(h["sum"] / count * 1000, 1), "p50_ms": None if p50 is None else round(p50 * 1000, 1),
            "count": count}


def gateway_figures(gateway_url: str) -> dict[str, dict]:
    """The gateway's own time to first token (arrival to the first chunk), queue wait and overhead, and its
    upstream time to first token (that TTFT less its queue wait: the backend's part plus the gateway's path)."""
    text = httpx.get(gateway_url + "/metrics", timeout=10, trust_env=False).text
    m = parse_metrics(text)
    out = {key: histogram_figures(histogram(m, name)) for key, name in GATEWAY_HISTOGRAMS.items()}
    ttft, queue = out["ttft"]["mean_ms"], out["queue"]["mean_ms"]
    out["upstream"] = {"mean_ms": None if ttft is None else round(ttft - (queue or 0.0), 1)}
    return out


def reset_prefix_cache(server: VLLMServer, timeout: float = 30.0) -> None:
    """Empty the server's prefix cache; vLLM refuses while blocks are held, so retry for a while."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(server.base_url + "/reset_prefix_cache", timeout=10, trust_env=False)
        if r.status_code == 404:
            raise RuntimeError(f"{server!r} has no /reset_prefix_cache: start it with VLLM_SERVER_DEV_MODE=1")
        if r.status_code == 200 and r.json().get("success", True):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server!r}: /reset_prefix_cache answered {r.status_code} {r.text[:200]}")
        time.sleep(0.5)


def routing_decisions(gateway_url: str) -> dict[str, float]:
    """{"scorer:outcome": count} from the gateway's llm_gateway_routing_decisions_total (e.g. how often
    prefix-affinity's load guard overrode the cache), and {"ejected:backend:rule": count} from its outlier
    ejections (a replica out of routing makes picks with one candidate, which no scorer counts)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(gateway_url + "/metrics", timeout=10, trust_env=False).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llm_gateway_routing_decisions_total":
                key = f"{sample.labels.get('scorer')}:{sample.labels.get('outcome')}"
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name == "llm_gateway_replica_ejections_total":
                key = f"ejected:{sample.labels.get('backend')}:{sample.labels.get('rule')}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def served_by(servers: list[VLLMServer], tag: str) -> dict[str, str]:
    """{x-request-id: server name} for this profile's requests, from the servers' request logs."""
    out = {}
    pattern = re.compile(r"Received request chatcmpl-(" + re.escape(tag) + r"\S*?)(?:-[0-9a-f]{8})?:")
    for s in servers:
        for rid in pattern.findall(s.log_text()):
            out[rid] = s.label
    return out


# -- the gateway -------------------------------------------------------------------------------------------

def gateway_command(args, alt: str = "") -> list[str]:
    """--gateway-alt's command for a profile named PROFILE@ALT, else --gateway-cmd, else the `llm-gateway` script
    next to this interpreter, else `python -m gateway`."""
    if alt:
        return shlex.split(args.gateway_alt[alt])
    if args.gateway_cmd:
        return shlex.split(args.gateway_cmd)
    cli = Path(sys.executable).with_name("llm-gateway")
    return [str(cli)] if cli.exists() else [sys.executable, "-m", "gateway"]


def router_command(args) -> list[str]:
    """--router-cmd, else the vllm-router the peers' benchmark installs (tests/benchmarks/peers), else on PATH."""
    if args.router_cmd:
        return shlex.split(args.router_cmd)
    peers = REPO / ".cache" / "bench" / "router-venv" / "bin" / "vllm-router"
    return [str(peers)] if peers.exists() else ["vllm-router"]


def start_router(servers: list[VLLMServer], work: Path, args) -> tuple[subprocess.Popen, str]:
    """vLLM's router with its default policy (cache_aware) over the servers, on a port of its own."""
    port, metrics = free_port(), free_port()
    log = open(work / f"vllm-router-{port}.log", "wb")
    proc = subprocess.Popen([*router_command(args), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                             *[s.base_url for s in servers], "--policy", "cache_aware", "--log-level", "warning",
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc, 120, "vllm-router")
    except BaseException:
        proc.terminate()
        proc.wait(10)
        print("vllm-router's log:\n" + (work / f"vllm-router-{port}.log").read_text(errors="replace")[-3000:])
        raise
    return proc, url


def start_gateway(servers: list[VLLMServer], profile: str, work: Path, args,
                  alt: str = "") -> tuple[subprocess.Popen, str, str]:
    secret = secrets.token_urlsafe(32)
    port = free_port()
    if profile == ARRIVAL:  # the default profile, each class in arrival order (no cheapest-prefill-first levels)
        profile = "default"
        extra = {"priorities": {"classes": [{"name": "interactive"},
                                            {"name": "batch", "vllm_priority": 10, "max_wait": 300}]}}
    else:
        extra = {}
    policy = {
        **extra,
        "listen": {"port": port},
        "store": {"kind": "sqlite", "path": str(work / f"keys-{profile}-{port}.db")},
        "timeouts": {"read": 300},
        "routing": {"default_profile": profile, "profiles": BENCH_PROFILES},
        "models": [{"name": args.served_model, "queue": {"max_depth": 10_000, "max_wait": 300},
                    "backends": [{"url": s.base_url, "name": s.label, "scheduling_policy": args.scheduling_policy}
                                 for s in servers]}],
    }
    if profile == "precise-prefix":  # the gateway binds each server's event address; the servers connect
        # blind_seconds 0: both caches were emptied just before this gateway subscribed (run_profile), so
        # nothing is held that its indexes have not seen; a blind start would route by load for its first minute
        scorer = {**PRECISE["scorers"][0], "params": {"tokenizer": str(args.model_dir.resolve()), "blind_seconds": 0}}
        policy["routing"]["profiles"] = {**BENCH_PROFILES, profile: {"scorers": [scorer, *PRECISE["scorers"][1:]]}}
        for backend, events_port in zip(policy["models"][0]["backends"], args.kv_events_ports, strict=True):
            backend["kv_events"] = {"bind": f"tcp://127.0.0.1:{events_port}"}
    path = work / f"policy-{profile}-{port}.yaml"
    path.write_text(yaml.safe_dump(policy))
    env = {**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret}
    log = open(work / f"gateway-{profile}-{port}.log", "wb")
    proc = subprocess.Popen([*gateway_command(args, alt), "serve", "--config", str(path), "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/ready", proc, 60, "the gateway")
        from gateway.admin.auth import mint_token
        from policies.config import Admin

        token = mint_token(Admin(), 600, secret=secret)
        r = httpx.post(f"{url}/admin/keys", json={"name": "bench-routing"},
                       headers={"authorization": f"Bearer {token}"}, trust_env=False)
        r.raise_for_status()
    except BaseException:
        proc.terminate()
        proc.wait(10)
        print(f"the gateway's log ({' '.join(gateway_command(args, alt))}):\n"
              + (work / f"gateway-{profile}-{port}.log").read_text(errors="replace")[-3000:], flush=True)
        raise
    return proc, url, r.json()["key"]


# -- the client ----------------------------------------------------------------------------------------------

@dataclass
class Record:
    conv: str
    turn: int
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None
    server: str | None = None
    head: float | None = None  # when the response's head arrived (the gateway sends it once vLLM's has come)
    queue_ms: float | None = None  # the gateway's own admission wait (x-gateway-queue-ms)


async def one_turn(client: httpx.AsyncClient, url: str, key: str, conv: Conversation, turn: int, tag: str,
                   args) -> Record:
    rec = Record(conv.id, turn)
    body = orjson.dumps({"model": args.served_model, "messages": conv.messages(turn), "max_tokens": args.max_tokens,
                         "temperature": 0, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}})
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json", "x-session-id": conv.id,
               "x-request-id": f"{tag}-{conv.id}-t{turn}"}
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", content=body, headers=headers) as r:
            rec.head = time.perf_counter() - start
            if r.headers.get("x-gateway-queue-ms"):
                rec.queue_ms = float(r.headers["x-gateway-queue-ms"])
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = orjson.loads(line[6:])
                choices = event.get("choices")
                if choices and (choices[0].get("delta") or {}).get("content"):
                    if rec.ttft is None:
                        rec.ttft = time.perf_counter() - start
                    rec.output_tokens += 1
                if event.get("usage"):
                    rec.prompt_tokens = event["usage"].get("prompt_tokens")
                    rec.output_tokens = event["usage"].get("completion_tokens") or rec.output_tokens
    except httpx.HTTPError as exc:
        rec.error = type(exc).__name__
    rec.e2e = time.perf_counter() - start
    if rec.ttft is None and rec.error is None:
        rec.error = "no content"
    return rec


def client_run(url: str | list[str], key: str, convs: list[Conversation], tag: str, args,
               procs: int = 1) -> tuple[list[Record], float]:
    """The workload from --client-procs processes (conversation i in process i mod n, each with its share of the
    active conversations), so that one Python client's event loop is not what is measured at high rates."""
    n = max(1, min(procs, args.active))
    if n == 1:
        return asyncio.run(run_workload(url, key, list(enumerate(convs)), tag, args))
    import concurrent.futures
    import multiprocessing

    parts = [[(i, c) for i, c in enumerate(convs) if i % n == k] for k in range(n)]
    shares = [args.active // n + (k < args.active % n) for k in range(n)]
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
        outs = list(pool.map(client_part, [(url, key, part, tag, args, share) for part, share in zip(parts, shares)]))
    return [r for recs, _ in outs for r in recs], max(wall for _, wall in outs)


def client_part(job) -> tuple[list[Record], float]:
    url, key, part, tag, args, share = job
    return asyncio.run(run_workload(url, key, part, tag, args, share))


async def run_workload(url: str | list[str], key: str, convs: list[tuple[int, Conversation]], tag: str,
                       args, active: int | None = None) -> tuple[list[Record], float]:
    """Every conversation through `url`, or, given several (the ceiling), conversation i to url i mod n."""
    records: list[Record] = []
    active = active or args.active
    todo = deque(convs)
    urls = url if isinstance(url, list) else [url]

    async def worker() -> None:
        while todo:
            i, conv = todo.popleft()
            for turn in range(args.turns):
                records.append(await one_turn(client, urls[i % len(urls)], key, conv, turn, tag, args))
                if turn < args.turns - 1:
                    await asyncio.sleep(conv.tool_times[turn])

    # every conversation keeps its connection, as an SDK client does (httpx would keep only 20 alive and open a
    # new connection for most turns: a cost of the client's, not of what is measured)
    limits = httpx.Limits(max_connections=active + 4, max_keepalive_connections=active + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits, trust_env=False) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(active)]
        done, pending = await asyncio.wait(tasks, timeout=args.profile_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - start
    if pending:
        print(f"  profile timed out after {args.profile_timeout:.0f} s; {len(todo)} conversations never started",
              flush=True)
    return records, wall


# -- figures -------------------------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


@dataclass
class Result:
    profile: str
    workload: str = "distinct"
    requests: int = 0
    errors: int = 0
    wall_s: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_later_p50_ms: float | None = None  # turns after the first (the ones a cache can help)
    ttft_mean_ms: float | None = None
    active: int = 0  # conversations in flight at once
    output_tok_s: float = 0.0
    req_s: float = 0.0
    hit_rate: float | None = None  # vLLM's own counters, both servers
    hit_rate_by_server: dict[str, float | None] = field(default_factory=dict)
    requests_by_server: dict[str, float] = field(default_factory=dict)
    ceiling_hit_rate: float | None = None
    same_server: float | None = None  # share of later turns served where the previous turn was
    prompt_tokens_mean: float | None = None
    routing_decisions: dict[str, float] = field(default_factory=dict)  # the gateway's "scorer:outcome" counts
    loadavg: list[float] = field(default_factory=list)  # 1-minute load average at the profile's start and end
    error_samples: list[str] = field(default_factory=list)
    client_path: dict[str, float | None] = field(default_factory=dict)  # where the client's time went (p50/p90)
    tcp: dict[str, int] = field(default_factory=dict)  # the kernel's TCP counters over the profile (/proc/net)
    # vLLM's own figures over the run, both servers (its /metrics before and after): {"ttft"|"queue"|"prefill":
    # {"mean_ms", "p50_ms", "count"}, "preemptions": n}
    vllm: dict = field(default_factory=dict)
    gateway: dict = field(default_factory=dict)  # the gateway's own (its /metrics at the end): gateway_figures
    detail: list[list] = field(default_factory=list)  # per request: conversation, turn, TTFT ms, server, prompt tokens


def summarize(profile: str, records: list[Record], wall: float, before: dict, after: dict, where: dict,
              tag: str, block: int) -> Result:
    ok = [r for r in records if r.error is None]
    res = Result(profile, requests=len(ok), errors=len(records) - len(ok), wall_s=round(wall, 1))
    res.error_samples = sorted({r.error for r in records if r.error})[:5]
    ttft = [r.ttft for r in ok]
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    res.ttft_p50_ms, res.ttft_p99_ms = ms(pct(ttft, 50)), ms(pct(ttft, 99))
    res.ttft_later_p50_ms = ms(pct([r.ttft for r in ok if r.turn > 0], 50))
    res.ttft_mean_ms = ms(sum(ttft) / len(ttft)) if ttft else None
    names = list(after)
    res.vllm = {key: histogram_figures(histogram_delta([before[n][key] for n in names], [after[n][key] for n in names]))
                for key in VLLM_HISTOGRAMS}
    res.vllm["preemptions"] = sum(after[n]["preemptions"] - before[n]["preemptions"] for n in names)
    res.output_tok_s = round(sum(r.output_tokens for r in ok) / wall, 1) if wall else 0.0
    res.req_s = round(len(ok) / wall, 2) if wall else 0.0
    hits = queries = 0.0
    for name in after:
        h = after[name]["hits"] - before[name]["hits"]
        q = after[name]["queries"] - before[name]["queries"]
        hits, queries = hits + h, queries + q
        res.hit_rate_by_server[name] = round(h / q, 3) if q else None
        res.requests_by_server[name] = after[name]["requests"] - before[name]["requests"]
    res.hit_rate = round(hits / queries, 3) if queries else None
    by_turn = {(r.conv, r.turn): r for r in ok}
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens]
    res.prompt_tokens_mean = round(sum(prompts) / len(prompts)) if prompts else None
    if prompts:
        cached = sum((by_turn[(r.conv, r.turn - 1)].prompt_tokens or 0) // block * block
                     for r in ok if r.turn > 0 and (r.conv, r.turn - 1) in by_turn)
        res.ceiling_hit_rate = round(cached / sum(prompts), 3)
    same = [where.get(f"{tag}-{r.conv}-t{r.turn}") == where.get(f"{tag}-{r.conv}-t{r.turn - 1}")
            for r in ok if r.turn > 0 and f"{tag}-{r.conv}-t{r.turn}" in where
            and f"{tag}-{r.conv}-t{r.turn - 1}" in where]
    res.same_server = round(sum(same) / len(same), 3) if same else None
    heads = [r.head for r in ok if r.head is not None]
    after_head = [r.ttft - r.head for r in ok if r.head is not None]
    queued = [r.queue_ms / 1000 for r in ok if r.queue_ms is not None]
    res.client_path = {"head_p50_ms": ms(pct(heads, 50)), "head_p90_ms": ms(pct(heads, 90)),
                       "head_to_first_token_p50_ms": ms(pct(after_head, 50)),
                       "head_to_first_token_p90_ms": ms(pct(after_head, 90)),
                       "gateway_queue_p50_ms": ms(pct(queued, 50)), "gateway_queue_p90_ms": ms(pct(queued, 90))}
    res.detail = [[r.conv, r.turn, None if r.ttft is None else round(r.ttft * 1000, 1),
                   where.get(f"{tag}-{r.conv}-t{r.turn}"), r.prompt_tokens, r.error] for r in records]
    return res


def table(results: list[Result]) -> str:
    def f(v, fmt="{:,.0f}"):
        return "-" if v is None else fmt.format(v)

    rows = [["workload", "profile", "TTFT p50 ms", "TTFT p99 ms", "later turns TTFT p50 ms", "output tok/s", "req/s",
             "vLLM prefix hit rate (a / b / both)", "prev-turn ceiling", "same server", "requests a / b", "errors",
             "wall s",             "load avg"]]
    for r in results:
        a, b = (list(r.hit_rate_by_server.values()) + [None, None])[:2]
        na, nb = (list(r.requests_by_server.values()) + [0, 0])[:2]
        rows.append([r.workload, r.profile, f(r.ttft_p50_ms), f(r.ttft_p99_ms), f(r.ttft_later_p50_ms),
                     f(r.output_tok_s, "{:,.1f}"), f(r.req_s, "{:.2f}"),
                     f"{f(a, '{:.3f}')} / {f(b, '{:.3f}')} / {f(r.hit_rate, '{:.3f}')}",
                     f(r.ceiling_hit_rate, "{:.3f}"),
                     f(r.same_server, "{:.0%}"), f"{na:.0f} / {nb:.0f}", str(r.errors), f(r.wall_s, "{:.0f}"),
                     " -> ".join(f"{x:.1f}" for x in r.loadavg)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def figures_table(results: list[Result]) -> str:
    """Where each front's time to first token went: the client's, vLLM's own (its histograms over the run, both
    servers), the gateway's (none for the fronts without one)."""
    def f(v, fmt="{:,.0f}"):
        return "-" if v is None else fmt.format(v)

    rows = [["workload", "profile", "active", "client TTFT p50 / mean ms", "vLLM TTFT p50 / mean ms",
             "vLLM queue p50 / mean ms", "vLLM prefill p50 / mean ms", "vLLM preemptions", "vLLM hit rate",
             "gateway queue p50 / mean ms", "gateway TTFT less queue, mean ms"]]
    for r in results:
        v, g = r.vllm, r.gateway

        def pm(d):
            return f"{f((d or {}).get('p50_ms'))} / {f((d or {}).get('mean_ms'))}"

        rows.append([r.workload, r.profile, str(r.active), f"{f(r.ttft_p50_ms)} / {f(r.ttft_mean_ms)}",
                     pm(v.get("ttft")), pm(v.get("queue")), pm(v.get("prefill")), f(v.get("preemptions")),
                     f(r.hit_rate, "{:.3f}"), pm(g.get("queue")) if g else "-",
                     f(g.get("upstream", {}).get("mean_ms")) if g else "-"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


TARGETS = {"p50": 1.10, "mean": 1.00, "hit": 0.97, "req_s": 0.97, "router_p50": 0.85}


def averaged(runs: list[Result]) -> dict[str, float] | None:
    """A front's figures over its runs (--repeat), each the mean of the runs' own; None when one is missing."""
    keys = {"p50": "ttft_p50_ms", "mean": "ttft_mean_ms", "hit": "hit_rate", "req_s": "req_s"}
    values = {k: [getattr(r, attr) for r in runs] for k, attr in keys.items()}
    if not runs or any(v is None for vs in values.values() for v in vs):
        return None
    return {k: sum(vs) / len(vs) for k, vs in values.items()}


def verdict(results: list[Result]) -> list[tuple[str, bool]]:
    """Per workload, the default profile against the ceiling (a client that sends each conversation to one
    server), each front's runs averaged (TARGETS, issue 44): TTFT p50 <= 1.10x and mean <= 1.00x the ceiling's,
    hit rate and req/s >= 0.97x; where vllm-router ran, TTFT p50 <= 0.85x its; on the hot prefix also no server
    over 60% of the requests (two servers) and TTFT p99 no worse than least-in-flight's."""
    checks: list[tuple[str, bool]] = []
    t = TARGETS
    for kind in dict.fromkeys(r.workload for r in results):
        runs = {name: [r for r in results if r.workload == kind and r.profile.split("#")[0] == name]
                for name in ("default", "ceiling", "vllm-router", "least-in-flight")}
        d, c, router = averaged(runs["default"]), averaged(runs["ceiling"]), averaged(runs["vllm-router"])
        if d is None or c is None:
            checks.append((f"{kind}: default and ceiling both measured", False))
            continue
        n = f"{len(runs['default'])}/{len(runs['ceiling'])} runs"
        checks += [
            (f"{kind}: default TTFT p50 {d['p50']:,.1f} ms <= {t['p50']:.2f}x the ceiling's {c['p50']:,.1f} ms"
             f" ({d['p50'] / c['p50']:.2f}x; {n})", d["p50"] <= t["p50"] * c["p50"]),
            (f"{kind}: default TTFT mean {d['mean']:,.1f} ms <= {t['mean']:.2f}x the ceiling's {c['mean']:,.1f} ms"
             f" ({d['mean'] / c['mean']:.3f}x)", d["mean"] <= t["mean"] * c["mean"]),
            (f"{kind}: default hit rate {d['hit']:.3f} >= {t['hit']:.2f}x the ceiling's {c['hit']:.3f}",
             d["hit"] >= t["hit"] * c["hit"]),
            (f"{kind}: default {d['req_s']:.2f} req/s >= {t['req_s']:.2f}x the ceiling's {c['req_s']:.2f}",
             d["req_s"] >= t["req_s"] * c["req_s"]),
        ]
        if router is not None:
            checks.append((f"{kind}: default TTFT p50 {d['p50']:,.1f} ms <= {t['router_p50']:.2f}x vllm-router's"
                           f" {router['p50']:,.1f} ms ({d['p50'] / router['p50']:.2f}x)",
                           d["p50"] <= t["router_p50"] * router["p50"]))
        if kind == "hot":  # the first run of each (as before the runs were averaged)
            first, lif = runs["default"][0], next(iter(runs["least-in-flight"]), None)
            total = sum(first.requests_by_server.values())
            share = max(first.requests_by_server.values()) / total if total else 1.0
            checks.append((f"hot: default's busiest server took {share:.0%} of the requests (<= 60%)",
                           len(first.requests_by_server) != 2 or share <= 0.60))
            if lif is not None and lif.ttft_p99_ms is not None and first.ttft_p99_ms is not None:
                checks.append((f"hot: default TTFT p99 {first.ttft_p99_ms:,.0f} ms <= least-in-flight's "
                               f"{lif.ttft_p99_ms:,.0f} ms", first.ttft_p99_ms <= lif.ttft_p99_ms))
    checks.append(("no request failed", all(r.errors == 0 for r in results)))
    return checks


def comparisons(results: list[Result]) -> list[str]:
    """Every other front's TTFT p50 and mean as a ratio of the ceiling's, per workload (several runs of one
    profile: each), for the report; not checks."""
    lines = []
    for kind in dict.fromkeys(r.workload for r in results):
        runs = [r for r in results if r.workload == kind]
        ceilings = [r for r in runs if r.profile.split("#")[0] == "ceiling" and r.ttft_p50_ms and r.ttft_mean_ms]
        if not ceilings:
            continue
        c50 = sorted(r.ttft_p50_ms for r in ceilings)[len(ceilings) // 2]
        cmean = sorted(r.ttft_mean_ms for r in ceilings)[len(ceilings) // 2]
        for r in runs:
            if r.ttft_p50_ms and r.ttft_mean_ms and r not in ceilings:
                lines.append(f"{kind}: {r.profile} TTFT p50 {r.ttft_p50_ms / c50:.2f}x, mean {r.ttft_mean_ms / cmean:.2f}x"
                             f" the ceiling's (median of its {len(ceilings)} run(s): {c50:,.0f} / {cmean:,.0f} ms)")
    return lines


# -- main ----------------------------------------------------------------------------------------------------

def floats(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    return lo, hi


def ints(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / ".cache" / "models" / "bench",
                   help="the model both servers serve (default: %(default)s; scripts/build_tiny_model.py --size bench)")
    p.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated (default: %(default)s)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: distinct (a system prompt "
                   "per conversation), hot (one shared by all) (default: %(default)s)")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--client-procs", default="1", help="client processes sharing the conversations and the active "
                   "count (default 1: at high rates one Python event loop is itself a queue); a list such as 1,8 "
                   "runs every profile with each, the later ones labelled PROFILE/cN")
    p.add_argument("--active", type=int, default=12, help="conversations in flight at once (closed loop)")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=ints, default=(1400, 2000), help="min,max of each system prompt")
    p.add_argument("--user-tokens", type=int, default=80, help="each user message")
    p.add_argument("--own-tokens", type=int, default=100, help="hot: each conversation's own part after the "
                   "shared system prompt")
    p.add_argument("--max-tokens", type=int, default=16, help="each reply (ignore_eos)")
    p.add_argument("--tool-time", type=floats, default=(0.5, 3.0), help="min,max seconds between two turns")
    p.add_argument("--overflow", type=float, default=1.6,
                   help="working set of the active conversations / one server's KV cache (default: %(default)s)")
    p.add_argument("--pressure", type=float, default=1.05, help="the pressure workload: working set of its active "
                   "conversations / all servers' KV caches together, by vLLM's own figures (its cache size and "
                   "/tokenize); it runs that many active conversations (the cache is sized for it when it is the "
                   "only workload, else by --active and --overflow) (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every profile per workload, interleaved; the "
                   "later ones labelled PROFILE#2, ... (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--profile-timeout", type=float, default=300, help="seconds; the rest of a profile is cut")
    p.add_argument("--out", type=Path, help="JSON results (default .cache/bench/routing-<time>.json)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs", help="vLLM's: the servers "
                   "run it (those started here get it; external ones must have been started with it) and the "
                   "gateway's backends say it, so with priority the gateway sends cheapest prefill first "
                   "(compare profiles default and default-arrival) (default: %(default)s)")
    ext = p.add_argument_group("external servers (started elsewhere, e.g. on a GPU)")
    ext.add_argument("--servers", help="comma-separated base URLs of running vLLM servers (loopback), e.g. "
                     "http://127.0.0.1:8000,http://127.0.0.1:8001; none are started or stopped")
    ext.add_argument("--served-model", default=MODEL, help="the model name the servers serve (default: %(default)s)")
    ext.add_argument("--server-logs", help="comma-separated log files of the --servers, in order (vLLM run with "
                     "--enable-log-requests): tells which server served each turn; without them no 'same server'")
    ext.add_argument("--kv-events-ports", help="comma-separated ports, one per server, where the precise-prefix "
                     "profile's gateway binds for the servers' KV cache events (run with --kv-events-config "
                     "endpoint tcp://127.0.0.1:PORT)")
    ext.add_argument("--gateway-cmd", help="how to run the gateway, e.g. \"python3 -m gateway\" (default: the "
                     "llm-gateway script next to this interpreter, else this interpreter's -m gateway)")
    ext.add_argument("--router-cmd", help="how to run vllm-router for the vllm-router profile (default: the one "
                     "tests/benchmarks/peers installs in .cache/bench/router-venv, else vllm-router on PATH)")
    ext.add_argument("--gateway-alt", action="append", default=[], metavar="ALT=CMD", help="another way to run "
                     "the gateway (e.g. an older tree) for profiles named PROFILE@ALT: the same profile, this "
                     "command; repeatable")
    ext.add_argument("--print-kv-bytes", action="store_true", help="print the --kv-cache-memory-bytes per server "
                     "that makes the workload's working set --overflow times one server's cache (the model's "
                     "shape from --model-dir), and exit")
    ext.add_argument("--print-kv-tokens", action="store_true", help="print the KV cache per server in tokens, as "
                     "--print-kv-bytes sizes it (no model needed: e.g. for simulated servers), and exit")
    args = p.parse_args(argv)
    args.profiles = [x for x in args.profiles.split(",") if x]
    try:
        args.client_procs = [int(x) for x in args.client_procs.split(",") if x.strip()]
    except ValueError:
        p.error("--client-procs: comma-separated counts")
    if not args.client_procs or min(args.client_procs) < 1:
        p.error("--client-procs: at least one count, each 1 or more")
    args.gateway_alt = dict(x.split("=", 1) for x in args.gateway_alt if "=" in x)
    if any(x.partition("@")[2] not in ("", *args.gateway_alt) for x in args.profiles):
        p.error("a profile named PROFILE@ALT needs --gateway-alt ALT=CMD")
    args.workloads = [x for x in args.workloads.split(",") if x]
    if not args.profiles or not args.workloads or set(args.workloads) - set(WORKLOADS):
        p.error(f"--workloads: one or more of {', '.join(WORKLOADS)}; --profiles: at least one")
    if not 1 <= args.active <= args.conversations:
        p.error("--active must be between 1 and --conversations")
    if not 1 <= args.repeat <= 10 or not 0.1 <= args.pressure <= 10:
        p.error("--repeat: 1 to 10; --pressure: 0.1 to 10")
    args.servers = [u.strip() for u in (args.servers or "").split(",") if u.strip()]
    logs = [Path(x.strip()) for x in (args.server_logs or "").split(",") if x.strip()]
    if args.servers:
        if len(args.servers) < 2:
            p.error("--servers needs at least two URLs")
        if any(urlsplit(u).hostname not in ("127.0.0.1", "localhost", "::1") or urlsplit(u).port is None
               for u in args.servers):
            p.error("--servers: loopback URLs with a port only, e.g. http://127.0.0.1:8000")
        if logs and len(logs) != len(args.servers):
            p.error("--server-logs needs one file per --servers URL")
    elif logs:
        p.error("--server-logs goes with --servers")
    args.server_logs = logs or [None] * len(args.servers)
    args.kv_events_ports = [int(x) for x in (args.kv_events_ports or "").split(",") if x.strip()]
    if "precise-prefix" in args.profiles and args.servers and len(args.kv_events_ports) != len(args.servers):
        p.error("the precise-prefix profile on --servers needs --kv-events-ports, one per server")
    return args


SERVERS = 2  # the servers this benchmark starts, and the ones step5.sh runs: what --print-kv-bytes sizes for


def planned_kv_bytes(args, working_set: float, model_dir: Path) -> tuple[int, int, int]:
    """(bytes, tokens, bytes a token) of the KV cache per server that makes the working set --overflow times it,
    or, when `pressure` is the only workload, --pressure times both servers' caches together."""
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"no model in {model_dir}: run .venv-vllm/bin/python scripts/build_tiny_model.py --size bench")
    per_token = kv_bytes_per_token(model_dir)
    cache_tokens = planned_cache_tokens(args, working_set)
    return cache_tokens * per_token, cache_tokens, per_token


def planned_cache_tokens(args, working_set: float) -> int:
    """Tokens of KV cache per server for the working set: --overflow times one server's cache, or --pressure times
    both servers' caches together when `pressure` is the only workload."""
    overflow = args.pressure * SERVERS if args.workloads == ["pressure"] else args.overflow
    # vLLM refuses a cache that cannot hold one request of --max-model-len; blocks are 128 tokens on CPU (16 on GPU)
    return max(int(working_set / overflow), args.max_model_len + 128) // 128 * 128


def pressure_active(args, cache_tokens: int, conversation_tokens: float) -> int:
    """Active conversations whose working set is --pressure times all the servers' caches (`cache_tokens`)."""
    return max(1, round(args.pressure * cache_tokens / conversation_tokens))


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = args.model_dir.resolve()
    convs = workload(args)
    est_tokens = sum(c.chars() for c in convs) / len(convs) / CHARS_PER_TOKEN + 10 * args.turns  # + chat markup
    working_set = args.active * est_tokens
    if args.print_kv_bytes:
        print(planned_kv_bytes(args, working_set, model_dir)[0])
        return 0
    if args.print_kv_tokens:
        print(planned_cache_tokens(args, working_set))
        return 0
    out = args.out or REPO / ".cache" / "bench" / f"routing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    workload_text = (f"{args.conversations} conversations x {args.turns} turns, {args.active} active, "
                     f"tool time {args.tool_time[0]:g}-{args.tool_time[1]:g} s")
    if args.servers:
        model_name, kv_bytes = args.served_model, None
        servers = [ExternalServer(url, log) for url, log in zip(args.servers, args.server_logs)]
        print(f"model {model_name} on {', '.join(s.base_url for s in servers)} (started elsewhere); {workload_text};"
              f" ~{est_tokens:,.0f} tokens per conversation, working set ~{working_set:,.0f} tokens; "
              f"load average {load_before[0]:.2f}", flush=True)
        if not any(args.server_logs):
            print("no --server-logs: which server served each turn is not known ('same server' stays empty)")
    else:
        model_name = model_dir.name
        kv_bytes, cache_tokens, per_token = planned_kv_bytes(args, working_set, model_dir)
        print(f"model {model_name}; {workload_text}; ~{est_tokens:,.0f} tokens per conversation, "
              f"working set ~{working_set:,.0f} tokens; KV cache per server {kv_bytes / 2**20:.0f} MiB "
              f"(~{cache_tokens:,} tokens at {per_token:,} bytes a token); load average {load_before[0]:.2f}",
              flush=True)
        log_dir = REPO / ".cache" / "bench" / "routing-logs"
        args.kv_events_ports = args.kv_events_ports or [free_port(), free_port()]
        servers = [BenchServer(model_dir, name, core=core, log_dir=log_dir, max_model_len=args.max_model_len,
                               kv_bytes=kv_bytes, env={"VLLM_SERVER_DEV_MODE": "1"},
                               extra_args=kv_events_args(port))  # publishing costs nothing while nobody binds
                   for (name, core), port in zip((("vllm-a", 0), ("vllm-b", 1)), args.kv_events_ports)]
        for server in servers:
            server.scheduling = args.scheduling_policy
        start_many(servers, timeout=300)

    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        work = Path(tmp)
        try:
            cfg = [cache_config(s) for s in servers]
            real_cache = [c.get("block_size", 0) * c.get("num_gpu_blocks", 0) for c in cfg]
            if not all(real_cache):
                raise SystemExit(f"no vllm:cache_config_info on {[s for s, c in zip(servers, real_cache) if not c]}")
            block = cfg[0].get("block_size", 16)
            tokens = [conversation_tokens(servers[0], c, args.served_model) for c in convs]
            real_ws = args.active * sum(tokens) / len(tokens)
            print(f"vLLM: block size {block}, KV cache {' / '.join(f'{c:,}' for c in real_cache)} tokens; "
                  f"conversations end at {min(tokens):,}-{max(tokens):,} tokens (mean {sum(tokens) / len(tokens):,.0f});"
                  f" working set {real_ws:,.0f} tokens = {real_ws / min(real_cache):.2f}x one server's cache, "
                  f"{real_ws / sum(real_cache):.2f}x all", flush=True)
            if set(args.workloads) - {"pressure"} and not min(real_cache) < real_ws < sum(real_cache):
                print("WARNING: the working set should overflow one server's cache and fit in all of them, or the "
                      "profiles cannot be told apart", flush=True)
            warm_up(servers, args)
            results = []
            for kind in args.workloads:
                kind_args, kind_convs = args, convs if kind == "distinct" else workload(args, kind)
                if kind == "pressure":  # more active conversations (and twice as many in all) on the same servers
                    active = pressure_active(args, sum(real_cache), sum(tokens) / len(tokens))
                    kind_args = argparse.Namespace(**{**vars(args), "active": active,
                                                      "conversations": max(args.conversations, 2 * active)})
                    kind_convs = workload(kind_args, kind)
                    print(f"pressure: {active} active conversations of {len(kind_convs)}: working set "
                          f"{active * sum(tokens) / len(tokens):,.0f} tokens = "
                          f"{active * sum(tokens) / len(tokens) / sum(real_cache):.2f}x all servers' caches",
                          flush=True)
                for procs in args.client_procs:
                    for run in range(args.repeat):
                        for profile in args.profiles:
                            results.append(run_profile(profile, servers, kind_convs, kind_args, work, block, kind,
                                                       procs))
                            if procs != args.client_procs[0]:
                                results[-1].profile += f"/c{procs}"
                            if run:
                                results[-1].profile += f"#{run + 1}"
                            print(table(results[-1:]), flush=True)
                            print(figures_table(results[-1:]), flush=True)
                            print(f"  gateway routing decisions: {results[-1].routing_decisions}", flush=True)
                            print(f"  client path: {results[-1].client_path}; TCP: {results[-1].tcp}", flush=True)
            sizing = {"block_size": block, "kv_cache_tokens": real_cache, "kv_cache_memory_bytes": kv_bytes,
                      "conversation_tokens_mean": round(sum(tokens) / len(tokens)),
                      "working_set_tokens": round(real_ws)}
        finally:
            if not args.servers:
                stop_all(servers)
    load_after = os.getloadavg()
    print(f"\n{workload_text}, model {model_name}, {args.max_tokens} output tokens;"
          f" load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
    print(table(results) + "\n")
    print("Where the time to first token went (vLLM's own figures from its /metrics before and after each run; "
          "the gateway's from its /metrics):\n")
    print(figures_table(results) + "\n")
    compared = comparisons(results)
    for line in compared:
        print(line)
    checks = verdict(results)
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    out.write_text(json.dumps({
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": model_name, "sizing": sizing, "loadavg_before": load_before, "loadavg_after": load_after,
        "results": [asdict(r) for r in results], "comparisons": compared, "checks": checks}, indent=2,
        default=str))
    print(f"\nresults: {out}")
    return 0 if all(ok for _, ok in checks) else 1


def conversation_tokens(server: VLLMServer, conv: Conversation, model: str) -> int:
    """Tokens of the conversation's last prompt and its reply, by the server's own tokenizer and chat template."""
    messages = conv.messages(len(conv.users) - 1) + [{"role": "assistant", "content": conv.replies[-1]}]
    r = httpx.post(server.base_url + "/tokenize", trust_env=False, timeout=30,
                   json={"model": model, "messages": messages, "add_generation_prompt": False})
    if r.status_code != 200 or "count" not in r.json():
        raise RuntimeError(f"/tokenize answered {r.status_code}: {r.text[:300]}")
    return r.json()["count"]


def warm_up(servers: list[VLLMServer], args) -> None:
    """A few requests to each server directly (the first ones after a start are slow), not counted."""
    rng = random.Random(-1)
    for s in servers:
        for n in (50, 1500, 50):
            httpx.post(s.api_base + "/chat/completions", trust_env=False, timeout=120, json={
                "model": args.served_model, "messages": [{"role": "user", "content": prose(rng, n)}],
                "max_tokens": args.max_tokens, "ignore_eos": True}).raise_for_status()


TCP_COUNTERS = ("ActiveOpens", "PassiveOpens", "AttemptFails", "EstabResets", "RetransSegs", "ListenOverflows",
                "ListenDrops", "TCPReqQFullDrop", "TCPBacklogDrop", "TCPTimeouts", "TCPAbortOnData")


def tcp_counters() -> dict[str, int]:
    """The kernel's TCP counters that tell a refused or retried connection (a full accept queue, a dropped SYN)."""
    out: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for names, values in zip(lines[::2], lines[1::2]):
            for k, v in zip(names.split()[1:], values.split()[1:]):
                if k in TCP_COUNTERS and v.lstrip("-").isdigit():
                    out[k] = int(v)
    return out


def run_profile(profile: str, servers: list[VLLMServer], convs: list[Conversation], args, work: Path,
                block: int, kind: str = "distinct", procs: int = 1) -> Result:
    """One profile on one workload, from cold prefix caches: through a fresh gateway, or, for "ceiling",
    straight to the servers, each conversation to one of them."""
    for s in servers:
        reset_prefix_cache(s)
    name, _, alt = profile.partition("@")
    if name == "ceiling":
        proc, url, key = None, [s.base_url for s in servers], "none"
    elif name == "vllm-router":
        (proc, url), key = start_router(servers, work, args), "none"
    else:
        proc, url, key = start_gateway(servers, name, work, args, alt)
    tcp_before = tcp_counters()
    load_start = os.getloadavg()[0]
    tag = f"{kind}-{profile}-{secrets.token_hex(3)}"
    decisions: dict[str, float] = {}
    gateway: dict[str, dict] = {}
    try:
        before = {s.label: counters(s) for s in servers}
        print(f"\n{kind} / {profile}: {len(convs)} conversations ...", flush=True)
        records, wall = client_run(url, key, convs, tag, args, procs)
        after = {s.label: counters(s) for s in servers}
        if proc is not None and name != "vllm-router":
            decisions = routing_decisions(url)
            gateway = gateway_figures(url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    result = summarize(profile, records, wall, before, after, served_by(servers, tag), tag, block)
    result.workload = kind
    result.routing_decisions = decisions
    result.gateway = gateway
    result.active = args.active
    result.tcp = {k: v - tcp_before.get(k, 0) for k, v in tcp_counters().items() if v - tcp_before.get(k, 0)}
    result.loadavg = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    return result


if __name__ == "__main__":
    sys.exit(main())
