"""Ceilings: what a Python front end can do at all on one core, by piece (run by run.py; also on its own):

    python -m tests.benchmarks.peers.ceilings [--seconds 3]

Each minimal app of ceiling_apps.py runs on core 1 (uvicorn with uvloop + httptools, or granian), the stand-in
and wrk on core 0, and gets the same c=64 and c=1 non-streaming load as the systems in run.py. The gap between
`uvicorn + httpx` and the gateway is the gateway's own pipeline; the gap between the client rows is what the
choice of HTTP client is worth; the gap between servers is what the choice of ASGI server is worth.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.benchmarks.peers import install
from tests.benchmarks.peers.load import run_wrk, write_script
from tests.benchmarks.peers.procs import Procs, http_ok, wait_until
from tests.benchmarks.peers.systems import LOAD_CORE, SUT_CORE, free_port, start_standin

REPO = Path(__file__).resolve().parents[3]
APPS = "tests.benchmarks.peers.ceiling_apps"


@dataclass
class Variant:
    label: str
    server: str  # uvicorn | granian
    app: str


VARIANTS = [
    Variant("uvicorn: fixed reply (no upstream)", "uvicorn", "fixed"),
    Variant("granian: fixed reply (no upstream)", "granian", "fixed"),
    Variant("uvicorn + httpx (gateway's pool limits)", "uvicorn", "via_httpx"),
    Variant("uvicorn + httpx + anyio task group per request", "uvicorn", "via_httpx_taskgroup"),
    Variant("uvicorn + aiohttp client", "uvicorn", "via_aiohttp"),
    Variant("granian + aiohttp client", "granian", "via_aiohttp"),
    Variant("uvicorn + the gateway's client (backends/http1.py)", "uvicorn", "via_http1"),
]


def command(variant: Variant, port: int) -> list[str]:
    venv_bin = install.venv_python("ceilings").parent
    target = f"{APPS}:{variant.app}"
    if variant.server == "uvicorn":
        return [str(venv_bin / "python"), "-m", "uvicorn", target, "--host", "127.0.0.1", "--port", str(port),
                "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning",
                "--lifespan", "on"]
    return [str(venv_bin / "granian"), "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port),
            "--workers", "1", "--runtime-threads", "1", "--loop", "uvloop", "--no-ws", "--log-level", "warning",
            target]


def measure_ceilings(procs: Procs, work: Path, standin, seconds: float, warmup: float, log=print) -> list[dict]:
    script = write_script(work / "ceiling.lua", None)
    env = {**os.environ, "CEIL_UPSTREAM": f"http://127.0.0.1:{standin.json_port}"}
    env.pop("VIRTUAL_ENV", None)
    rows = []
    for variant in VARIANTS:
        port = free_port()
        proc = procs.start(f"ceiling-{variant.server}-{variant.app}", command(variant, port), SUT_CORE, env=env,
                           cwd=REPO)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until(http_ok(url + "/health"), proc, 30, variant.label)  # every app answers any path
            run_wrk(url, script, 64, warmup)
            cpu0 = proc.cpu_seconds()
            hi = run_wrk(url, script, 64, seconds)
            cpu = proc.cpu_seconds() - cpu0
            run_wrk(url, script, 1, warmup)
            lo = run_wrk(url, script, 1, seconds)
            if hi.errors or lo.errors:
                raise RuntimeError(f"{variant.label}: {hi.errors + lo.errors} errors")
            row = {"label": variant.label, "rps": hi.rps, "cpu_ms": cpu / hi.requests * 1000, "p50": lo.p50_ms,
                   "p99": lo.p99_ms}
            log(f"  {variant.label}: {hi.rps:,.0f} req/s, {row['cpu_ms']:.3f} CPU ms/req, p50 {lo.p50_ms:.3f} ms")
            rows.append(row)
        finally:
            procs.stop(proc)
    return rows


def ceilings_table(rows: list[dict], direct_p50: float | None) -> str:
    lines = ["| one core, c=64 / c=1 | requests/s | CPU ms per request | p50, c=1 (ms) | added p50 (ms) |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        added = f"{r['p50'] - direct_p50:.3f}" if direct_p50 is not None else "—"
        lines.append(f"| {r['label']} | {r['rps']:,.0f} | {r['cpu_ms']:.3f} | {r['p50']:.3f} | {added} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args()
    os.sched_setaffinity(0, {LOAD_CORE})
    install.ensure_all()
    with tempfile.TemporaryDirectory(prefix="bench-ceilings-") as tmp:
        work = Path(tmp)
        procs = Procs(work)
        try:
            standin = start_standin(procs, work)
            direct = run_wrk(standin.system.json_url, write_script(work / "d.lua", None), 1, args.seconds)
            rows = measure_ceilings(procs, work, standin, args.seconds, args.warmup)
        finally:
            procs.stop_all()
    print(ceilings_table(rows, direct.p50_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
