"""The GPU routing step (tests/benchmarks/gpu/step5.sh) runs on a CPU with STEP5_DRY=1: two simulated vLLM
servers stand in for the GPU ones and the workload is tiny, but the command line, every workload and every
profile (the ceiling straight to the servers, the rest through a real gateway) and the checks all run, so a
broken argument or code path shows here rather than on the GPU's time."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_step5_dry_run_goes_through_every_workload_and_profile(tmp_path):
    env = {**os.environ, "STEP5_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO), "SCRATCH": str(tmp_path / "scratch")}
    done = subprocess.run(["bash", "tests/benchmarks/gpu/step5.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "routing.json").read_text())["results"]
    runs = {(r["workload"], r["profile"]) for r in results}
    assert runs == {(w, p) for w in ("distinct", "hot")
                    for p in ("ceiling", "default", "least-in-flight", "session-affinity")}
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in results)
    default = {r["workload"]: r for r in results if r["profile"] == "default"}
    assert default["hot"]["routing_decisions"]  # through the gateway: its decisions were read
    assert not next(r for r in results if r["profile"] == "ceiling")["routing_decisions"]  # no gateway there
