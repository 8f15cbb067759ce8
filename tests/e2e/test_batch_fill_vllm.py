"""A batch fills only what interactive traffic leaves, on a real CPU vLLM that schedules by priority
(`--scheduling-policy priority --max-num-seqs 8`, alone on core 0) behind a real gateway process of cap 8 and the
default reserve (one slot): tests/benchmarks/batch_fill.py's four runs, short. An interactive closed loop of 2
streams alone; a Batch API batch (the openai SDK's files.create and batches.create, as a user sends one) alone;
the two together; the loop alone again once the batch is cancelled.

Judged by ratios measured in this run: the interactive TTFT p50 and p99 beside the batch against the mean of the
runs before and after it, and the share of the idle slot-seconds the batch used (the benchmark's definition;
target 0.8, which the reserve allows up to ~0.83 at this load). p50 is held to the benchmark's 1.2x target times a
margin for a loaded 2-core machine, whose speed drifts +-30% between runs of a few seconds. The tail is not at
the target yet (docs/benchmarks.md, "Batch fill"): when both interactive streams arrive while the batch holds all
but the one reserved slot, the second waits for a batch line to end, so p99 (over ~50 requests, their slowest)
sits near 2x here (1.9x and 2.0x in two runs, p50 0.70-0.74x); it is held under 2.5x times the same margin."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.benchmarks import batch_fill
from tests.e2e.conftest import CAPPED_ARGS

CAP = 8
DRIFT = 1.3  # a loaded 2-core machine's drift between runs a few seconds apart, on top of the 1.2x target
TAIL = 2.5  # where p99 is today (~2x) with room for a stall of the machine, until the tail target is met


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
    assert ratios[50] <= 1.2 * DRIFT and ratios[99] <= TAIL * DRIFT, (ratios, verdict)
    share, allowed = batch_fill.idle_share(result)
    assert 0.8 <= allowed  # the reserve leaves the batch room for the target at this load
    assert share >= 0.8, (share, allowed, verdict)  # slot-seconds are counted, not timed: no drift margin
    # the batch ran beside the load, not only before it
    assert result["lines_per_second"] > 0 and result["lines_per_second_alone"] > 0
