"""The batch benchmark's verdicts: a TTFT check holds only where interactive requests were measured."""

from __future__ import annotations

from tests.benchmarks.batch_fill import checks
from tests.benchmarks.overload import Run


def result(ttfts: list[list[float]], failed: int = 0) -> dict:
    runs = [Run(name, 2, ttft=list(t), ok=len(t), failed=["x"] * failed)
            for name, t in zip(("alone", "beside", "again"), ttfts)]
    return {"runs": runs, "utilisation": [(1.0, 0.25), (1.0, 0.85)], "reserve": 1, "cap": 8,
            "lines_per_second": 2.0, "lines_answered": 10, "lines_failed": 0, "lines": 100}


def verdicts(res: dict) -> dict[str, bool]:
    return {text.split(" (")[0]: ok for text, ok in checks(res, 1.2, 0.8)}


def test_ttft_checks_pass_within_the_bound_and_fail_past_it() -> None:
    near = verdicts(result([[0.10] * 20, [0.11] * 20, [0.10] * 20]))
    assert near["interactive TTFT p50 beside the batch <= 1.2x without it"]
    far = verdicts(result([[0.10] * 20, [0.30] * 20, [0.10] * 20]))
    assert not far["interactive TTFT p50 beside the batch <= 1.2x without it"]


def test_no_interactive_answer_passes_no_ttft_check() -> None:
    """Every interactive request failing (a gateway that could not start) is no 0x ratio that passes."""
    none = verdicts(result([[], [], []], failed=5))
    assert not none["interactive TTFT p50 beside the batch <= 1.2x without it"]
    assert not none["interactive TTFT p99 beside the batch <= 1.2x without it"]
    assert not none["no interactive request failed"]
