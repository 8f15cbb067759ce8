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


def loaded(rng, n: int, in_flight: int, speed: float = 1.0) -> list[Sample]:
    """`n` calls sent while about `in_flight` others ran on the replica: latency rises with the load, and each
    call's ITL (a mean over its tokens) and TTFT scatter around it."""
    from policies.variant_signals import load_level

    out = []
    for _ in range(n):
        k = max(0, round(rng.gauss(in_flight, in_flight / 4)))
        step = 0.004 + 0.0001 * k  # the simulator's default step: 4 ms + 0.1 ms per running sequence
        out.append(Sample(0.0, None, load_level(k), itl=speed * step * rng.lognormvariate(0, 0.15),
                          ttft=speed * 4 * step * rng.lognormvariate(0, 0.3)))
    return out


def run_split(rng, guard: Guard, calls: int, cand_load: int, base_load: int, speed: float, window: int = 2000):
    """A candidate's `calls` calls at 20% beside a baseline's at 80%, judged every 10 calls as the guard does
    (each side's last `window` calls): the candidate call at which it was pulled back and why, or None."""
    from policies.variant_guard import EVERY

    cand: list[Sample] = []
    base: list[Sample] = []
    for i in range(EVERY, calls + 1, EVERY):
        cand += loaded(rng, EVERY, cand_load, speed)
        base += loaded(rng, 4 * EVERY, base_load)
        cand, base = cand[-window:], base[-window:]
        breach = verdict(guard, cand, base)
        if breach is not None:
            return i, breach
    return None


MIXES = [(8, 32), (16, 16), (32, 8), (1, 1), (2, 24), (40, 40)]  # (candidate, baseline) in flight


@pytest.mark.parametrize("cand_load, base_load", MIXES)
def test_an_identical_candidate_is_never_pulled_back_at_any_load_mix(cand_load, base_load):
    import random

    rng = random.Random(cand_load * 100 + base_load)
    assert run_split(rng, Guard(), 3000, cand_load, base_load, speed=1.0) is None  # the default guard


@pytest.mark.parametrize("cand_load, base_load", [(8, 32), (8, 16), (4, 32), (16, 16)])
def test_a_slower_candidate_at_a_lighter_load_is_judged_within_50_calls(cand_load, base_load):
    import random

    rng = random.Random(7)
    found = run_split(rng, Guard(), 3000, cand_load, base_load, speed=1.5 * (1 + 0.0001 * base_load / 0.004))
    assert found is not None
    at, (signal, reason) = found
    assert at <= 50 and signal == "itl" and "comparable load" in reason  # min_samples: the first look that can


def test_a_candidate_36x_slower_to_its_first_token_is_pulled_back_by_the_default_guard():
    base = samples(60, "8", ttft=0.05, itl=0.01)
    cand = samples(60, "8", ttft=1.8, itl=0.01)
    signal, reason = verdict(Guard(), cand, base)
    assert signal == "ttft" and "36.00x" in reason


def test_a_guard_that_cannot_judge_says_why_and_since_when_then_warns():
    v = Variants()
    v.configure(parse_policy(POLICY.replace("min_samples: 20, ", "min_samples: 20, window_seconds: 60, ")))
    now = __import__("time").monotonic()
    for _ in range(100):
        v.window("m", "base").add(Sample(now, None, "1", itl=0.01))
    for _ in range(10):  # ten calls: one look, too few to judge
        v.window("m", "cand").add(Sample(now, None, "1", itl=0.01))
        v.guard.after_call("m", "cand")
    view = v.report()["m"]["variants"][1]["guard"]
    assert view["state"] == "watching" and view["warning"] is False
    assert "ITL: not enough samples at comparable load: candidate 10/20, baseline 100/20" in view["undecided"]
    assert view["undecided_for_s"] is not None and view["undecided_for_s"] < 5
    v.guard.state("m", "cand").judging_since -= 61  # undecided for longer than the window
    assert v.report()["m"]["variants"][1]["guard"]["warning"] is True
    for _ in range(20):
        v.window("m", "cand").add(Sample(now, None, "1", itl=0.01))
        v.guard.after_call("m", "cand")
    view = v.report()["m"]["variants"][1]["guard"]
    assert view["undecided"] is None and view["undecided_for_s"] is None and view["warning"] is False


def test_the_baselines_latency_is_modelled_at_the_candidates_own_load():
    # the baseline met loads 4 and 16 but not 8: at 8 it is held to the chord between them, not to 16
    base = samples(30, "4", itl=0.010) + samples(30, "16", itl=0.030)
    bound_only = verdict(GUARD, samples(20, "8", itl=0.026), base[30:])  # 0.87x the baseline at 16: passes
    assert bound_only is None
    signal, reason = verdict(GUARD, samples(20, "8", itl=0.026), base)  # 1.30x the 0.020 modelled at 8
    assert signal == "itl" and "1.30x" in reason and "modelled from its calls at 4 and 16: 20 vs 60 calls" in reason
    assert verdict(GUARD, samples(20, "8", itl=0.022), base) is None  # 1.10x
    # never extrapolated: a candidate lighter than every level the baseline met is held only to the bound
    assert verdict(GUARD, samples(20, "2", itl=0.0095), base) is None
    # a level whose median came out below a lighter one's is held to the lighter one's (the curve never falls
    # with load; it is never lowered either). 12 calls at 8: half of min_samples, too few to compare alone
    noisy = samples(30, "4", itl=0.020) + samples(12, "8", itl=0.010) + samples(30, "16", itl=0.040)
    assert verdict(GUARD, samples(20, "8", itl=0.019), noisy) is None  # 0.95x the 0.020 at 4, not 1.9x 0.010
    signal, reason = verdict(GUARD, samples(20, "8", itl=0.025), noisy)
    assert signal == "itl" and "1.25x" in reason and "modelled from its calls at 8: 20 vs 12 calls" in reason
    assert verdict(GUARD, samples(20, "4", itl=0.022), noisy) is None  # 1.10x: level 4 not pulled down by 8's


def swinging(rng, n: int, share: float, clients: int, speed: float, per_seq: float) -> list[Sample]:
    """`n` calls of a variant taking `share` of `clients` concurrent clients: each sent while about that share
    of the others ran on its replica; each token costs 4 ms + `per_seq` per running sequence, scattered."""
    from policies.variant_signals import load_level

    out = []
    for _ in range(n):
        k = 1 + sum(rng.random() < share for _ in range(clients - 1))
        step = speed * (0.004 + per_seq * k)
        out.append(Sample(0.0, None, load_level(k), itl=step * rng.lognormvariate(0, 0.15),
                          ttft=4 * step * rng.lognormvariate(0, 0.3)))
    return out


def run_clients(rng, calls: int, fewest: int, most: int, speed: float, per_seq: float, window: int = 2000):
    """80/20 under a number of clients that changes between the guard's looks (from `fewest` to `most`), as
    traffic rises and falls; judged by a default guard every 10 calls of the candidate: (call, breach) at its
    rollback, or (None, why it could not judge) at the end."""
    from policies.variant_guard import EVERY, judge

    cand: list[Sample] = []
    base: list[Sample] = []
    for i in range(EVERY, calls + 1, EVERY):
        clients = rng.randint(fewest, most)
        cand = (cand + swinging(rng, EVERY, 0.2, clients, speed, per_seq))[-window:]
        base = (base + swinging(rng, 4 * EVERY, 0.8, clients, 1.0, per_seq))[-window:]
        breach = verdict(Guard(), cand, base)
        if breach is not None:
            return i, breach
    return None, judge(Guard(), cand, base)[1]


@pytest.mark.parametrize("per_seq", [0.0001, 0.0002, 0.0003])
@pytest.mark.parametrize("seed", [1, 2])
def test_an_identical_candidate_is_never_pulled_back_as_traffic_rises_and_falls(seed, per_seq):
    import random

    at, _ = run_clients(random.Random(seed), 3000, 8, 40, 1.0, per_seq)
    assert at is None


@pytest.mark.parametrize("speed", [1.3, 1.5])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_candidate_slower_by_less_than_the_baselines_load_penalty_is_pulled_back_at_matched_load(seed, speed):
    """40 clients at most, 80/20: the baseline at load 32 costs 1.86x what it costs at 8, more than the
    candidate's slowdown, so only a comparison at the candidate's own load sees it."""
    import random

    at, (signal, reason) = run_clients(random.Random(seed), 3000, 8, 40, speed, per_seq=0.0002)
    assert at is not None and at <= 300, reason
    assert signal == "itl" and "load level 8" in reason and "heavier" not in reason


def test_with_no_load_in_common_the_guard_says_what_it_cannot_see():
    """A steady 40 clients at 80/20: the candidate near 8 in flight, the baseline near 32, never lighter. A 1.3x
    candidate is hidden by the baseline's load penalty; the guard says it holds it only to the bound."""
    import random

    at, waiting = run_clients(random.Random(5), 500, 40, 40, 1.3, per_seq=0.0002)
    assert at is None
    assert any(w.startswith("ITL: no load level both sides met") and "held only to the baseline at heavier load"
               in w for w in waiting), waiting
