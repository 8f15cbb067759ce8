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


def test_scores_are_clamped_to_unit_interval():
    class Wild:
        name = "wild"

        def score(self, rs):
            return [50.0, -3.0]

    rs = replicas(0, 0)
    p = Profile([(Wild(), 1.0), (LeastInFlight(), 0.5)], rng=random.Random(1))
    assert p.pick(rs) is rs[0]
