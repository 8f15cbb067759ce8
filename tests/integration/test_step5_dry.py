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


def test_step5_dry_run_of_the_pressure_workload_with_the_cost_profile_twice(tmp_path):
    # the GPU command of the cache-pressure comparison: one workload, three fronts, each run twice
    env = {**os.environ, "STEP5_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO), "SCRATCH": str(tmp_path / "scratch"), "WORKLOADS": "pressure",
           "PROFILES": "ceiling,default,cost", "REPEAT": "2"}
    done = subprocess.run(["bash", "tests/benchmarks/gpu/step5.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=420)
    assert done.returncode in (0, 1) and (tmp_path / "routing.json").exists(), \
        done.stdout[-3000:] + done.stderr[-3000:]  # 1: a target missed on the simulators, which is not tested here
    report = json.loads((tmp_path / "routing.json").read_text())
    results = report["results"]
    assert [(r["workload"], r["profile"]) for r in results] == [
        ("pressure", p) for p in ("ceiling", "default", "cost", "ceiling#2", "default#2", "cost#2")]
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in results)
    # the active conversations' working set is 1.05x both simulated caches (sized by --print-kv-tokens for
    # ACTIVE=3), by the servers' own token counts: about as many as asked for, all in flight at once
    assert {r["active"] for r in results} == {results[0]["active"]} and 2 <= results[0]["active"] <= 5
    sizing = report["sizing"]
    assert 0.8 <= results[0]["active"] * sizing["conversation_tokens_mean"] / sum(sizing["kv_cache_tokens"]) <= 1.3
    for r in results:
        # vLLM's own time to first token and queue time over the run, from its histograms before and after
        assert r["vllm"]["ttft"]["count"] >= r["requests"] and r["vllm"]["ttft"]["mean_ms"] > 0
        assert r["vllm"]["queue"]["p50_ms"] is not None and "preemptions" in r["vllm"]
        through_gateway = not r["profile"].startswith("ceiling")
        assert bool(r["gateway"]) == through_gateway
        if through_gateway:
            assert r["gateway"]["ttft"]["count"] >= r["requests"] and r["gateway"]["upstream"]["mean_ms"] > 0
    cost = [r["routing_decisions"] for r in results if r["profile"].startswith("cost")]
    assert all(any(k.startswith("prefix-cost:") for k in d) for d in cost)  # the new scorer decided there
    text = (tmp_path / "routing.txt").read_text()
    assert "vLLM queue p50 / mean ms" in text and "the ceiling's" in text
