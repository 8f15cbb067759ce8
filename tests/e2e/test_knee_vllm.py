"""`llm-gateway knee` against a real CPU vLLM with `--max-num-seqs 8`: a queue forms past 8, the knee is found.

The server (tests/e2e/conftest.py, `capped_vllm`) is the sweeps' own, not the session's shared a/b servers: a sweep loads a server to saturation
and would disturb the state other tests rely on, and a sweep whose server shares its core with another vLLM
measures that neighbour as much as its own server. So the test is marked `sweep`, which runs it before the
shared servers start (tests/e2e/conftest.py); should any be running anyway, they are paused for the sweep.

Every level measures at least MIN_REQUESTS finished requests (and at least 2 s), however long that takes on
a slow or busy machine, up to generous bounds: a fixed window on a server that finishes a request every few
seconds sees none. Budget on an idle 2-core machine: ~20 s to start, ~30 s of sweep, a few to stop.
"""

import json
import subprocess
import sys

import matplotlib.image
import pytest
import yaml


LEVELS = (1, 4, 8, 16, 32)
MIN_REQUESTS = 8


@pytest.mark.sweep
def test_knee_sweep_of_a_real_vllm(capped_vllm, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"models:\n  - name: tiny\n    backends:\n      - url: {capped_vllm.base_url}  # one core\n")
    out = tmp_path / "out"
    json_path, png_path = sweep(capped_vllm, LEVELS, out, "--write-cap", str(policy), "--backend", "tiny-0")
    report = json.loads(json_path.read_text())
    by_c = {r["concurrency"]: r for r in report["levels"]}
    assert list(by_c) == list(LEVELS) and report["stopped"] is None
    for r in report["levels"]:
        assert r["errors"] == 0 and r["complete"] and r["requests"] >= MIN_REQUESTS and r["gauge_samples"] > 0
        assert r["running_max"] <= 8  # vLLM's own gauge: the batch never exceeds --max-num-seqs
        assert 200 <= r["prompt_tokens_mean"] <= 320  # calibrated to ~256 on the tiny model's tokenizer
    # Batching pays up to the cap. How much depends on the CPU: 3.2-3.8x at 8 on machines with AVX-512 (2.3x
    # with a test run competing), but 1.36x at 4 and 1.32x at 8 on an idle AVX2-only one (1.46x at 8 with other
    # work competing), where this 256-token prompt's prefill dominates and batches poorly. 1.2x over the better
    # of 4 and 8 holds on both, with room for the machine's speed to drift between levels.
    # The levels run one after another, so a drift between them (±30% within minutes on a shared machine) can
    # eat that room: a sweep that misses is followed by one more of 1 and 8 alone, and either must show it.
    if not batching_pays(by_c):
        again, _ = sweep(capped_vllm, (1, 8), tmp_path / "again")
        again_by_c = {r["concurrency"]: r for r in json.loads(again.read_text())["levels"]}
        assert batching_pays(again_by_c), (by_c, again_by_c)
    assert by_c[32]["waiting_max"] > 0 and by_c[1]["waiting_max"] == 0  # past the cap, vLLM queues
    assert by_c[32]["ttft_p99_s"] > 3 * by_c[8]["ttft_p99_s"]  # and the queue shows as TTFT (measured 7-14x)
    # The knee sits at the batch cap or next to it. 16 is common: at exactly 8 in flight a slot idles between a
    # request's end and its successor's admission (running mean ~6.6 of 8), so a small queue in vLLM still adds
    # ~20% throughput there (for 3-4x the TTFT p99: what --slo-ttft-p99 is for). 4 when 4 and 8 score alike.
    cap = report["knee"]["recommended"]
    assert cap in (4, 8, 16), report["knee"]
    assert yaml.safe_load(policy.read_text())["models"][0]["backends"][0]["cap"] == cap
    assert "# one core" in policy.read_text()
    assert png_path.stat().st_size > 20_000 and matplotlib.image.imread(png_path).shape[1] > 800


def sweep(server, levels, out, *extra: str):
    """One `llm-gateway knee` run over `levels`; its JSON and PNG reports."""
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "knee", "--url", server.base_url, "--model", "tiny-knee",
         "--levels", ",".join(map(str, levels)), "--duration", "2", "--min-requests", str(MIN_REQUESTS),
         "--warmup", "1", "--output-tokens", "32", "--request-timeout", "60", "--max-level-time", "120",
         "--max-time", "600", "--out", str(out), *extra],
        check=False, capture_output=True, text=True, timeout=660)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [json_path] = out.glob("knee-tiny-knee-*.json")
    [png_path] = out.glob("knee-tiny-knee-*.png")
    return json_path, png_path


def batching_pays(by_c: dict) -> bool:
    """The better of 4 and 8 in flight (whichever the sweep ran) beats 1 by 1.2x in output tokens/s."""
    best = max(by_c[c]["output_tokens_per_s"] for c in (4, 8) if c in by_c)
    return best > 1.2 * by_c[1]["output_tokens_per_s"]
