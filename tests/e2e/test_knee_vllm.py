"""`llm-gateway knee` against a real CPU vLLM with `--max-num-seqs 8`: a queue forms past 8, the knee is found.

The server is this module's own (pinned to core 0), not the session's shared a/b servers: a sweep loads a
server to saturation and would disturb the state other tests rely on. Budget: ~20-30 s to start, ~20 s of
sweep (5 levels of 1 s warm-up + 2 s window, more while the first requests of a level queue), a few to stop.
"""

import json
import subprocess
import sys

import matplotlib.image
import pytest
import yaml

from tests.e2e.vllm_procs import VLLMServer, default_model_dir, default_vllm_venv

LEVELS = (1, 4, 8, 16, 32)


@pytest.fixture(scope="module")
def capped_vllm(tmp_path_factory):
    venv, model = default_vllm_venv(), default_model_dir()
    if not (venv / "bin" / "vllm").exists() or not (model / "config.json").exists():
        pytest.fail(f"the vLLM venv ({venv}) or the tiny model ({model}) is missing: run scripts/setup_e2e.sh")
    server = VLLMServer(model, "tiny-knee", core=0, extra_args=("--max-num-seqs", "8"),
                        log_dir=tmp_path_factory.mktemp("vllm-knee-logs"), log_requests=False)
    server.start()
    try:
        server.wait_ready(120)
        yield server
    finally:
        server.stop()


def test_knee_sweep_of_a_real_vllm(capped_vllm, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"models:\n  - name: tiny\n    backends:\n      - url: {capped_vllm.base_url}  # one core\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "knee", "--url", capped_vllm.base_url, "--model", "tiny-knee",
         "--levels", ",".join(map(str, LEVELS)), "--duration", "2", "--warmup", "1", "--output-tokens", "32",
         "--request-timeout", "30", "--max-time", "80", "--out", str(out), "--write-cap", str(policy),
         "--backend", "tiny-0"],
        check=False, capture_output=True, text=True, timeout=100)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [json_path] = out.glob("knee-tiny-knee-*.json")
    [png_path] = out.glob("knee-tiny-knee-*.png")
    report = json.loads(json_path.read_text())
    by_c = {r["concurrency"]: r for r in report["levels"]}
    assert list(by_c) == list(LEVELS) and report["stopped"] is None
    for r in report["levels"]:
        assert r["errors"] == 0 and r["requests"] > 0 and r["gauge_samples"] > 0
        assert r["running_max"] <= 8  # vLLM's own gauge: the batch never exceeds --max-num-seqs
        assert 200 <= r["prompt_tokens_mean"] <= 320  # calibrated to ~256 on the tiny model's tokenizer
    assert by_c[8]["output_tokens_per_s"] > 2 * by_c[1]["output_tokens_per_s"]  # batching pays below the cap
    assert by_c[32]["waiting_max"] > 0 and by_c[1]["waiting_max"] == 0  # past the cap, vLLM queues
    assert by_c[32]["ttft_p99_s"] > 3 * by_c[8]["ttft_p99_s"]  # and the queue shows as time to first token
    # The knee sits at the batch cap or next to it. 16 is common: at exactly 8 in flight a slot idles between a
    # request's end and its successor's admission (running mean ~6.6 of 8), so a small queue in vLLM still adds
    # ~20% throughput there (for 3-4x the TTFT p99: what --slo-ttft-p99 is for). 4 when 4 and 8 score alike.
    cap = report["knee"]["recommended"]
    assert cap in (4, 8, 16), report["knee"]
    assert yaml.safe_load(policy.read_text())["models"][0]["backends"][0]["cap"] == cap
    assert "# one core" in policy.read_text()
    assert png_path.stat().st_size > 20_000 and matplotlib.image.imread(png_path).shape[1] > 800
