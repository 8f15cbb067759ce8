import random

from backends.replicas import DOWN, UP, Replica
from policies.routing import LeastInFlight, Profile


def replicas(*in_flight):
    return [Replica(name=f"r{i}", model="m", url=f"http://127.0.0.1:{9000 + i}", served_name="m", in_flight=n)
            for i, n in enumerate(in_flight)]


def profile(seed=0):
    return Profile([(LeastInFlight(), 1.0)], rng=random.Random(seed))


def test_picks_fewest_in_flight():
    rs = replicas(3, 1, 2)
    assert profile().pick(rs) is rs[1]


def test_ties_are_spread_randomly():
    rs = replicas(2, 0, 0)
    p = profile()
    picked = {p.pick(rs).name for _ in range(200)}
    assert picked == {"r1", "r2"}


def test_down_and_tried_replicas_are_skipped():
    rs = replicas(0, 5, 9)
    rs[0].state = DOWN
    rs[1].state = UP
    p = profile()
    assert p.pick(rs) is rs[1]
    assert p.pick(rs, exclude=[rs[1]]) is rs[2]
    assert p.pick(rs, exclude=[rs[1], rs[2]]) is None


class Fixed:
    """A scorer that returns the given scores whatever the replicas: one out of [0, 1], to test the clamp."""

    name = "fixed"

    def __init__(self, *scores):
        self.scores = list(scores)

    def score(self, rs):
        return self.scores


def test_a_score_above_one_counts_as_one():
    # r1 is free, r0 busy: least-in-flight (weight 2) gives r1 2.0, r0 0.0; the wild scorer's 50 for r0 must
    # count as 1.0, so r1 wins 2.0 to 1.0. Without the clamp r0 would win 50 to 2.
    rs = replicas(4, 0)
    p = Profile([(Fixed(50.0, 0.0), 1.0), (LeastInFlight(), 2.0)], rng=random.Random(1))
    assert p.pick(rs) is rs[1]


def test_a_score_below_zero_counts_as_zero():
    # r0 is free, r1 busy: least-in-flight (weight 0.5) gives r0 0.5, r1 0.0; the wild scorer's -10 for r0
    # must count as 0.0, so r0 wins 0.5 to 0.0. Without the clamp r1 would win 0 to -9.5.
    rs = replicas(0, 4)
    p = Profile([(Fixed(-10.0, 0.0), 1.0), (LeastInFlight(), 0.5)], rng=random.Random(1))
    assert p.pick(rs) is rs[0]
