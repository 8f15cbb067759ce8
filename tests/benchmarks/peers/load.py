"""Non-streaming load: wrk with a generated Lua script (POST body, auth header, JSON summary on exit).

The script reports requests, non-2xx answers, socket errors and latency percentiles (microseconds) as one
`BENCH {...}` line, so nothing depends on wrk's human-readable output. With `limit`, each wrk thread stops
after that many responses (the soak uses it to send an exact number of requests).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import orjson

from tests.benchmarks.peers.standin import MODEL

BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
                     "max_tokens": 16, "temperature": 0})

SCRIPT = """
wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
{auth}
local limit = {limit}
local seen = 0
{response}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {{"requests":%d,"duration_us":%d,"non2xx":%d,"connect":%d,"read":%d,"write":%d,"timeout":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}}\\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
"""

RESPONSE_LIMIT = """
response = function(status, headers, body)
  seen = seen + 1
  if seen >= limit then wrk.thread:stop() end
end
"""


@dataclass
class WrkResult:
    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p99_ms: float
    mean_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def write_script(path: Path, auth: str | None, limit: int | None = None) -> Path:
    header = f'wrk.headers["Authorization"] = [==[{auth}]==]' if auth else ""
    path.write_text(SCRIPT.format(body=BODY.decode(), auth=header, limit=limit or 0,
                                  response=RESPONSE_LIMIT if limit else ""))
    return path


def run_wrk(url: str, script: Path, connections: int, seconds: float, core: int = 0,
            timeout_s: float = 10.0) -> WrkResult:
    """One wrk run (one thread, pinned to `core`); raises if wrk fails or anything came back other than 2xx."""
    cmd = ["taskset", "-c", str(core), "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
           f"--timeout={timeout_s:.0f}s", "-s", str(script), f"{url}/v1/chat/completions"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + timeout_s + 30,
                              check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"wrk against {url} did not finish in time") from None
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed against {url} (exit {proc.returncode}): {proc.stdout[-800:]}{proc.stderr[-800:]}")
    data = json.loads(line[6:])
    errors = data["non2xx"] + data["connect"] + data["read"] + data["write"] + data["timeout"]
    return WrkResult(data["requests"], data["duration_us"] / 1e6, errors, data["p50_us"] / 1000,
                     data["p99_us"] / 1000, data["mean_us"] / 1000)
