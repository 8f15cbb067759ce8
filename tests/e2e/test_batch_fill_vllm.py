"""A batch fills only what interactive traffic leaves, on a real CPU vLLM that schedules by priority
(`--scheduling-policy priority --max-num-seqs 8`, alone on core 0) behind a real gateway process of cap 8 and the
default reserve (one slot): tests/benchmarks/batch_fill.py's four runs, short. An interactive closed loop of 2
streams alone; a Batch API batch (the openai SDK's files.create and batches.create, as a user sends one) alone;
the two together; the loop alone again once the batch is cancelled.

Judged by ratios measured in this run: the interactive TTFT p50 and p99 beside the batch against the mean of the
runs before and after it (the benchmark's target is 1.2x; here 1.2x times a margin for a loaded 2-core machine,
whose speed drifts +-30% between runs of a few seconds: 1.3 for p50, 1.5 for p99, which over so few requests is
their slowest), and the share of the idle slot-seconds the batch used
(the benchmark's definition; target 0.8, which the reserve allows up to ~0.83 at this load)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.benchmarks import batch_fill
from tests.e2e.conftest import alone_on_core0

CAP = 8
DRIFT = 1.3  # a loaded 2-core machine's drift between runs a few seconds apart, on top of the 1.2x target
# p99 of the ~15-30 requests a 10 s run answers on a loaded machine is their slowest: one stall of the machine
# lands in it whole, in either run (1.3 / 0.7 apart at the worst); 1.5 of it
TAIL_DRIFT = 1.5


@pytest.fixture(scope="module")
def priority_vllm(tmp_path_factory):
    with alone_on_core0(tmp_path_factory, "tiny-fill",
                        ("--scheduling-policy", "priority", "--max-num-seqs", str(CAP))) as server:
        yield server


def test_a_batch_fills_the_idle_capacity_and_leaves_interactive_ttft_alone(priority_vllm, tmp_path: Path):
    args = batch_fill.parse(["--url", priority_vllm.base_url, "--model", "tiny-fill", "--cap", str(CAP),
                             "--warmup", "4", "--duration", "10", "--lines", "2000", "--batch-tokens", "16",
                             "--output-tokens", "8"])
    result = asyncio.run(batch_fill.measure(priority_vllm.base_url, "tiny-fill", CAP, args, tmp_path, priority=True))
    verdict = batch_fill.report(result, args, "e2e")  # the benchmark's table in the test's output
    alone, beside, again = result["runs"]
    assert not alone.failed and not beside.failed and not again.failed, [r.failed for r in result["runs"]]
    assert min(r.ok for r in result["runs"]) >= 10, [r.ok for r in result["runs"]]  # enough to judge by
    assert result["reserve"] == 1 and result["lines_answered"] > 0 and result["lines_failed"] == 0
    ratios = {q: batch_fill.ttft_ratio(result, q) for q in (50, 99)}
    assert ratios[50] <= 1.2 * DRIFT and ratios[99] <= 1.2 * TAIL_DRIFT, (ratios, verdict)
    share, allowed = batch_fill.idle_share(result)
    assert 0.8 <= allowed  # the reserve leaves the batch room for the target at this load
    assert share >= 0.8, (share, allowed, verdict)  # slot-seconds are counted, not timed: no drift margin
    # the batch ran beside the load, not only before it
    assert result["lines_per_second"] > 0 and result["lines_per_second_alone"] > 0
