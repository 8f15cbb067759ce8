"""The GPU batch-fill step (tests/benchmarks/gpu/step7.sh) runs on a CPU with STEP7_DRY=1: the simulator stands in
for the GPU server and the runs are short, but the step's command line, batch_fill.py's four runs through a real
gateway (the batch through the openai SDK) and its checks all run, so a broken argument or code path shows here
rather than on the GPU's time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.serial  # a gateway, a simulator and a 3,000-line batch in one budget: beside other test files it ran out
def test_step7_dry_run_goes_through_every_run_of_batch_fill(tmp_path):
    env = {**os.environ, "STEP7_DRY": "1", "STEP7_BUDGET": "120", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO), "SCRATCH": str(tmp_path / "scratch")}
    done = subprocess.run(["bash", "tests/benchmarks/gpu/step7.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "batch_fill.json").read_text())
    assert [r["name"] for r in result["runs"]] == ["interactive alone", "interactive beside the batch",
                                                   "interactive alone again"]
    assert all(r["ok"] > 0 and not r["failed"] for r in result["runs"])  # every interactive run was answered
    assert result["cap"] == 64 and result["reserve"] == 8  # the step's CAP, the policy's reserve of it
    assert result["lines_answered"] > 0 and result["lines_per_second_alone"] > 0 and result["lines_per_second"] > 0
    assert {"p50", "p99"} == set(result["ttft_ratio"]) and 0 < result["idle_share"]
    assert "batch_fill.py exit" in done.stdout
