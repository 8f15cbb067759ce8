"""The guard's verdict: each signal against the baseline, only with enough samples, latency at comparable load."""

from __future__ import annotations

import pytest

from policies.config import Guard, parse_policy
from policies.variant_guard import ROLLED_BACK, verdict
from policies.variant_signals import Sample
from policies.variants import Variants

GUARD = Guard(min_samples=20)


def samples(n: int, load: str = "1", **fields) -> list[Sample]:
    return [Sample(0.0, None, load, **fields) for _ in range(n)]


def test_a_drop_in_structured_validity_is_a_breach_once_both_sides_have_enough():
    base = samples(40, structured=True)
    worse = samples(17, structured=True) + samples(3, structured=False)  # 85%
    assert verdict(GUARD, worse, base)[0] == "structured_validity"
    assert "85.0% vs baseline 100.0%" in verdict(GUARD, worse, base)[1]
    assert verdict(GUARD, worse[:19], base) is None  # 19 answers: not judged yet
    slightly = samples(49, structured=True) + samples(1, structured=False)  # 98%: within 2 points
    assert verdict(GUARD, slightly, base) is None


def test_errors_count_only_the_variants_own_faults():
    base = samples(100)
    capped = samples(90) + [Sample(0.0, "at_capacity", "1") for _ in range(10)]
    assert verdict(GUARD, capped, base) is None
    failing = samples(95) + [Sample(0.0, "upstream_error", "1") for _ in range(5)]
    assert verdict(GUARD, failing, base)[0] == "errors"


def test_latency_is_compared_at_comparable_load():
    # the baseline is busier (load 8) and slower there; at load 1 both are the same: no breach
    base = samples(30, "1", itl=0.010) + samples(100, "8", itl=0.030)
    same = samples(30, "1", itl=0.0105)
    assert verdict(GUARD, same, base) is None
    slower = samples(30, "1", itl=0.025)
    signal, reason = verdict(GUARD, slower, base)
    assert signal == "itl" and "2.50x" in reason and "load level 1: 30 vs 30 calls" in reason
    # a load level the baseline never reached is not compared at all
    assert verdict(GUARD, samples(30, "64", itl=0.5), base) is None


def test_a_regression_that_shows_only_with_company_is_not_averaged_away():
    # one sequence at a time: alone it is as fast, with one request beside it the second waits a whole answer
    base = samples(40, "1", ttft=0.05) + samples(40, "2", ttft=0.06)
    cand = samples(80, "1", ttft=0.04) + samples(20, "2", ttft=0.30)
    guard = Guard(min_samples=20, max_ttft_ratio=2.0)
    signal, reason = verdict(guard, cand, base)
    assert signal == "ttft" and "5.00x" in reason and "load level 2: 20 vs 40 calls" in reason
    assert verdict(guard, cand[:99], base) is None  # 19 calls at level 2: too few to judge that level


def test_shadow_agreement_below_the_floor():
    base = samples(30)
    assert verdict(GUARD, samples(18, agreed=True) + samples(2, agreed=False), base) is None  # 90%
    assert verdict(GUARD, samples(17, agreed=True) + samples(3, agreed=False), base)[0] == "agreement"


POLICY = """
models:
  - name: m
    guard: {min_samples: 20, promotion: {steps: [5, 25, 100], after_requests: 20}}
    variants:
      - {name: base, weight: 95, backends: [{url: "http://127.0.0.1:9001"}]}
      - {name: cand, weight: 5, backends: [{url: "http://127.0.0.1:9002"}]}
"""


def feed(v: Variants, variant: str, n: int, **fields) -> None:
    for _ in range(n):
        v.window("m", variant).add(Sample(__import__("time").monotonic(), None, "1", **fields))
        v.guard.after_call("m", variant)


def test_a_candidate_that_holds_is_promoted_step_by_step_and_one_that_breaks_is_rolled_back():
    v = Variants()
    v.configure(parse_policy(POLICY))
    feed(v, "base", 40, structured=True)
    feed(v, "cand", 20, structured=True)
    assert v.weights["m"] == {"base": 95, "cand": 5}  # the first step is where it started
    feed(v, "cand", 20, structured=True)
    assert v.weights["m"] == {"base": 75, "cand": 25}
    feed(v, "cand", 10, structured=False)  # now 50 answers, 20% broken
    assert v.weights["m"]["cand"] == 0 and v.weights["m"]["base"] == 75
    assert v.guard.state("m", "cand").state == ROLLED_BACK
    assert "structured-output validity" in v.report()["m"]["variants"][1]["guard"]["reason"]
    assert v.report()["m"]["variants"][0]["guard"]["state"] == "baseline"
    feed(v, "cand", 50, structured=True)  # what a rolled-back variant still answers changes nothing
    assert v.weights["m"]["cand"] == 0
    v.set_weights("m", {"cand": 5})  # an operator gives it another chance
    assert v.guard.state("m", "cand").state == "watching"


@pytest.mark.parametrize("bad, message", [
    ("guard: {baseline: nope}", "not a variant"),
    ("guard: {promotion: {steps: [50, 25]}}", "steps must rise"),
])
def test_bad_guards_are_refused(bad, message):
    from policies.config import PolicyError

    with pytest.raises(PolicyError, match=message):
        parse_policy(POLICY.replace("guard: {min_samples: 20, promotion: {steps: [5, 25, 100], after_requests: 20}}",
                                    bad))
