"""Outlier ejection (policies/ejection.py) on a clock the test moves: the rules, the growing backoff, the share
of a model's replicas that may be out, and the routing filter that skips ejected replicas."""

from backends.replicas import UP, HealthTimings, Replica, ReplicaSet
from policies.config import Ejection
from policies.ejection import FAILURES, TTFT, Ejections, ejected
from policies.routing import Stats
from policies.routing.filters import NotEjected
from policies.routing.request import NO_REQUEST


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet(n: int = 3, **settings) -> tuple[ReplicaSet, list[Replica], Ejections, Clock, list]:
    replicas = [Replica(f"r{i}", "m", f"http://10.0.0.{i}:8000", "m", state=UP) for i in range(n)]
    clock, events = Clock(), []
    rules = Ejection(**settings)
    ejections = Ejections(ReplicaSet({"m": replicas}, HealthTimings()), rules, {"m": rules},
                          on_eject=lambda r, rule: events.append((r.name, rule)), clock=clock,
                          unix=lambda: clock.now + 1e9)
    return ejections.replicas, replicas, ejections, clock, events


def release_all(ejections: Ejections) -> None:
    ejections.release_due(float("inf"))


def test_consecutive_failures_eject_and_a_success_between_resets_the_count():
    _, (r0, _, _), ej, clock, events = fleet(consecutive_failures=3)
    try:
        ej.failed(r0)
        ej.failed(r0)
        ej.succeeded(r0)  # a good answer between: the count starts again
        ej.failed(r0)
        ej.failed(r0)
        assert not ejected(r0)
        ej.failed(r0)
        assert ejected(r0) and events == [("r0", FAILURES)]
        assert r0.outlier.rule == FAILURES and r0.outlier.until == clock.now + 5.0
        assert r0.outlier.until_unix == clock.now + 1e9 + 5.0
    finally:
        release_all(ej)


def test_the_backoff_doubles_up_to_its_maximum_and_starts_again_after_serving_well():
    _, (r0, _, _), ej, clock, _ = fleet(consecutive_failures=1, base_seconds=5, max_seconds=30)
    try:
        lasted = []
        for _ in range(5):
            ej.failed(r0)
            assert ejected(r0)
            lasted.append(r0.outlier.lasted)
            clock.now = r0.outlier.until - 0.001
            ej.release_due(clock.now)
            assert ejected(r0)  # not due yet
            clock.now += 0.001
            ej.release_due(clock.now)
            assert not ejected(r0)
        assert lasted == [5, 10, 20, 30, 30]
        clock.now += 10  # back, serving well, but for less than its last ejection (30 s)
        ej.succeeded(r0)
        assert r0.outlier.ejections == 5
        clock.now += 20
        ej.succeeded(r0)  # 30 s of good service: the backoff starts again
        assert r0.outlier.ejections == 0
        ej.failed(r0)
        assert r0.outlier.lasted == 5
    finally:
        release_all(ej)


def test_never_more_than_the_share_out_and_never_the_last_replica():
    _, (r0, r1, r2), ej, _, events = fleet(consecutive_failures=1, max_ejected_share=0.5)
    try:
        for r in (r0, r1, r2):
            ej.failed(r)
        assert [ejected(r) for r in (r0, r1, r2)] == [True, False, False]  # int(0.5 x 3) = 1 out at most
        assert events == [("r0", FAILURES)]
    finally:
        release_all(ej)
    _, (only,), ej, _, _ = fleet(1, consecutive_failures=1, max_ejected_share=1.0)
    ej.failed(only)
    assert not ejected(only)  # a model's last replica always stays
    _, (a, b), ej, _, _ = fleet(2, consecutive_failures=1, max_ejected_share=1.0)
    try:
        ej.failed(a)
        ej.failed(b)
        assert ejected(a) and not ejected(b)
    finally:
        release_all(ej)


def test_a_ttft_far_above_the_peers_median_ejects():
    _, (slow, p1, p2), ej, _, events = fleet(ttft_ratio=3.0, ttft_min_samples=16)
    try:
        for _ in range(16):
            ej.ttft(p1, 0.10)
            ej.ttft(p2, 0.12)
            ej.ttft(slow, 0.30)  # 2.7x the median: not an outlier yet
        assert not ejected(slow)
        for _ in range(16):
            ej.ttft(slow, 1.0)  # the average climbs far past 3x
        assert ejected(slow) and events == [("r0", TTFT)]
        assert not ejected(p1) and not ejected(p2)
    finally:
        release_all(ej)


def test_ttft_needs_the_minimum_sample_from_a_peer():
    _, (slow, peer, _), ej, _, _ = fleet(ttft_ratio=2.0, ttft_min_samples=16)
    for _ in range(5):
        ej.ttft(peer, 0.1)  # too few to compare with
    for _ in range(32):
        ej.ttft(slow, 5.0)
    assert not ejected(slow)


def test_the_filter_skips_ejected_replicas_and_keeps_all_rather_than_none():
    _, replicas, ej, _, _ = fleet(consecutive_failures=1)
    keep = NotEjected().keep
    try:
        assert keep(NO_REQUEST, replicas, Stats()) == replicas
        ej.failed(replicas[1])
        assert keep(NO_REQUEST, replicas, Stats()) == [replicas[0], replicas[2]]
        assert keep(NO_REQUEST, [replicas[1]], Stats()) == [replicas[1]]  # none would be left: keep them
    finally:
        release_all(ej)
    assert keep(NO_REQUEST, replicas, Stats()) == replicas


def test_disabled_ejection_never_ejects():
    _, (r0, _, _), ej, _, _ = fleet(consecutive_failures=1, enabled=False)
    ej.failed(r0)
    assert not ejected(r0)
