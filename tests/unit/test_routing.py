import random

import pytest

from backends.replicas import DOWN, UP, Replica
from backends.vllm_stats import VLLMStats
from policies.config import BUILTIN_PROFILES, RoutingProfile
from policies.pipeline import Call
from policies.routing import Stats, build_profile
from policies.routing.filters import KVHeadroom
from policies.routing.kv_cache import KVCache
from policies.routing.least_in_flight import LeastInFlight
from policies.routing.pickers import MaxScore
from policies.routing.prefix_affinity import Params as PrefixParams
from policies.routing.prefix_affinity import PrefixAffinity
from policies.routing.profile import Profile
from policies.routing.session_affinity import SessionAffinity
from policies.routing.vllm_queue import VLLMQueue


def replicas(*in_flight):
    return [Replica(name=f"r{i}", model="m", url=f"http://127.0.0.1:{9000 + i}", served_name="m", in_flight=n)
            for i, n in enumerate(in_flight)]


def profile(*scorers, seed=0, stats=None, filters=()):
    return Profile(list(scorers) or [(LeastInFlight(), 1.0)], filters, MaxScore(random.Random(seed)), stats)


def chat(system, *turns, headers=None):
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return Call(request_id="r", endpoint="chat/completions", headers=headers or {}, client_host="127.0.0.1",
                arrived=0.0, body={"model": "m", "messages": messages}, model="m")


def test_picks_fewest_in_flight():
    rs = replicas(3, 1, 2)
    assert profile().pick(None, rs) is rs[1]


def test_ties_are_spread_randomly():
    rs = replicas(2, 0, 0)
    p = profile()
    picked = {p.pick(None, rs).name for _ in range(200)}
    assert picked == {"r1", "r2"}


def test_down_and_tried_replicas_are_skipped():
    rs = replicas(0, 5, 9)
    rs[0].state = DOWN
    rs[1].state = UP
    p = profile()
    assert p.pick(None, rs) is rs[1]
    assert p.pick(None, rs, exclude=[rs[1]]) is rs[2]
    assert p.pick(None, rs, exclude=[rs[1], rs[2]]) is None


class Fixed:
    name, outcome, learns = "fixed", None, False

    def __init__(self, scores):
        self.scores = scores

    def score(self, call, candidates, stats):
        return list(self.scores)


def test_scores_are_clamped_to_unit_interval():
    # r0 is busier, so least-in-flight (weight 2) prefers r1 by 2 points. Unclamped, the wild scorer's 5.0
    # (and its -10 for r1) would outvote that; clamped to [0, 1] it adds at most 1 point for r0.
    rs = replicas(1, 0)
    assert profile((Fixed([5.0, 0.0]), 1.0), (LeastInFlight(), 2.0)).pick(None, rs) is rs[1]
    assert profile((Fixed([0.0, -10.0]), 1.0), (LeastInFlight(), 0.5)).pick(None, rs) is rs[1]
    assert profile((Fixed([1.0, 0.0]), 1.0), (LeastInFlight(), 0.5)).pick(None, rs) is rs[0]  # weights still count


def test_vllm_queue_counts_load_from_elsewhere():
    rs = replicas(0, 1)  # this gateway sees r0 idle, but other clients keep 6 requests on its vLLM
    seen = {"r0": VLLMStats(running=4, waiting=2), "r1": VLLMStats(running=1, waiting=0)}
    stats = Stats(lambda r: seen.get(r.name))
    assert profile((VLLMQueue(), 1.0), stats=stats).pick(None, rs) is rs[1]
    assert profile((LeastInFlight(), 1.0), stats=stats).pick(None, rs) is rs[0]
    assert profile((VLLMQueue(), 1.0), stats=Stats()).pick(None, rs) is rs[0]  # no scrape: own counts stand in


def test_kv_cache_scorer_and_headroom_filter():
    rs = replicas(0, 0, 0)
    seen = {"r0": VLLMStats(kv_usage=0.9), "r1": VLLMStats(kv_usage=0.2), "r2": VLLMStats(kv_usage=0.99)}
    stats = Stats(lambda r: seen.get(r.name))
    assert profile((KVCache(), 1.0), stats=stats).pick(None, rs) is rs[1]
    keep = KVHeadroom(KVHeadroom.Params(max_usage=0.95)).keep(chat("s"), rs, stats)
    assert keep == rs[:2]
    assert KVHeadroom().keep(chat("s"), rs[2:], stats) == rs[2:]  # never filters every candidate away


SYSTEM = "You are a careful agent. " * 40  # ~1000 characters


def test_prefix_affinity_keeps_a_conversation_on_its_replica():
    rs = replicas(0, 0, 0)
    p = profile((PrefixAffinity(), 4.0), (LeastInFlight(), 1.0), seed=1)
    turns = ["list the files"]
    first = p.pick(chat(SYSTEM, *turns), rs)
    for i in range(6):
        other = rs[(rs.index(first) + 1) % 3]
        other.in_flight += 1  # load elsewhere must not pull the conversation away (below the guard)
        turns += [f"done step {i}", f"now step {i + 1} please"]
        assert p.pick(chat(SYSTEM, *turns), rs) is first


def test_prefix_affinity_spreads_new_conversations_by_load():
    rs = replicas(0, 0)
    p = profile((PrefixAffinity(), 4.0), (LeastInFlight(), 1.0))
    chosen = []
    for n in range(6):
        replica = p.pick(chat(f"conversation {n}: " + "x" * 500, "hi"), rs)
        replica.in_flight += 1
        chosen.append(replica.name)
    assert chosen.count("r0") == 3 and chosen.count("r1") == 3


def test_prefix_affinity_load_guard_spreads_a_hot_prefix():
    rs = replicas(0, 0)
    scorer = PrefixAffinity(PrefixParams(imbalance=3))
    p = profile((scorer, 4.0), (LeastInFlight(), 1.0))
    home = p.pick(chat(SYSTEM, "q"), rs)
    other = rs[1 - rs.index(home)]
    for _ in range(2):  # below the guard: the hot prefix stays home however busy it gets
        home.in_flight += 1
        assert p.pick(chat(SYSTEM, "q"), rs) is home and scorer.outcome == "hit"
    home.in_flight += 1  # 3 more than the other: the guard trips
    assert p.pick(chat(SYSTEM, "q"), rs) is other and scorer.outcome == "load_guard"
    home.in_flight = other.in_flight = 0  # learned on both: the tie goes by load again, either is fine
    assert scorer.matched(other, scorer.blocks(chat(SYSTEM, "q"))) > 0


def test_prefix_lru_is_bounded_by_the_replicas_cache_size():
    rs = replicas(0, 0)
    seen = {r.name: VLLMStats(block_size=16, num_blocks=32) for r in rs}  # 512 tokens ~ 2048 chars
    scorer = PrefixAffinity(PrefixParams(block_chars=64))
    p = profile((scorer, 1.0), stats=Stats(lambda r: seen.get(r.name)))
    call = chat("a" * 5000, "q")
    home = p.pick(call, rs)
    assert max(len(lru) for lru in scorer.lrus.values()) == 2048 // 64
    assert scorer.matched(home, scorer.blocks(call)) == 2048 // 64  # what is kept is the prompt's start


def test_prefix_lru_evicts_a_prefix_from_its_end():
    # vLLM frees a request's blocks tail first; a full LRU must lose a conversation's last blocks, not its
    # first, or one eviction turns a conversation whose prefix vLLM still holds into a miss.
    rs = replicas(0, 1)  # both prompts go to r0, the less loaded (the scorer only learns sizes among several)
    seen = {r.name: VLLMStats(block_size=16, num_blocks=40) for r in rs}  # 640 tokens ~ 40 blocks of 64 chars
    scorer = PrefixAffinity(PrefixParams(block_chars=64))
    p = profile((scorer, 1.0), (LeastInFlight(), 1.0), stats=Stats(lambda r: seen.get(r.name)))
    old, new = chat("old " * 480, "q"), chat("new " * 240, "q")  # ~30 and ~15 blocks: 40 do not hold both
    assert p.pick(old, rs) is rs[0] and p.pick(new, rs) is rs[0]
    assert scorer.matched(rs[0], scorer.blocks(new)) == len(scorer.blocks(new))
    assert 0 < scorer.matched(rs[0], scorer.blocks(old)) < len(scorer.blocks(old))


def test_prefix_affinity_forgets_a_replica_whose_vllm_restarted():
    rs = replicas(0, 0)
    seen = {r.name: VLLMStats(running=0, waiting=0, requests_finished=10) for r in rs}
    scorer = PrefixAffinity()
    p = profile((scorer, 4.0), (VLLMQueue(), 2.0), (LeastInFlight(), 1.0), stats=Stats(lambda r: seen[r.name]))
    turns = ["q0"]
    home = p.pick(chat(SYSTEM, *turns), rs)
    other = rs[1 - rs.index(home)]
    turns += ["a0", "q1"]
    assert p.pick(chat(SYSTEM, *turns), rs) is home
    turns += ["a1", "q2"]
    assert p.pick(chat(SYSTEM, *turns), rs, exclude=[home]) is other  # home is down: the conversation moves
    # home is back, restarted (its counters start over, its prefix cache is empty); other is one request busier
    seen[home.name] = VLLMStats(running=0, waiting=0, requests_finished=0)
    seen[other.name] = VLLMStats(running=1, waiting=0, requests_finished=12)
    turns += ["a2", "q3"]
    assert p.pick(chat(SYSTEM, *turns), rs) is other  # not back to home on the strength of what it lost
    assert scorer.matched(home, scorer.blocks(chat(SYSTEM, *turns))) == 0


def test_session_affinity_is_consistent_and_falls_back():
    rs = replicas(0, 0, 0)
    p = profile((SessionAffinity(), 4.0), (LeastInFlight(), 1.0))
    homes = {}
    for s in range(30):
        call = chat("s", "q", headers={"x-session-id": f"session-{s}"})
        homes[s] = p.pick(call, rs)
        assert all(p.pick(call, rs) is homes[s] for _ in range(3))
    assert len({r.name for r in homes.values()}) == 3  # sessions spread over every replica
    s = next(s for s, r in homes.items() if r is rs[0])
    call = chat("s", "q", headers={"x-session-id": f"session-{s}"})
    rs[0].state = DOWN
    fallback = p.pick(call, rs)
    assert fallback is not rs[0]
    assert all(p.pick(call, rs) is fallback for _ in range(3))
    rs[0].state = UP
    assert p.pick(call, rs) is rs[0]  # back home when it returns


def test_session_affinity_ignores_requests_without_the_header():
    rs = replicas(2, 0)
    scorer = SessionAffinity()
    assert profile((scorer, 4.0), (LeastInFlight(), 1.0)).pick(chat("s", "q"), rs) is rs[1]
    assert scorer.outcome == "no_session"


def test_builtin_profiles_build_and_pick():
    rs = replicas(0, 1)
    for name, config in BUILTIN_PROFILES.items():
        assert build_profile(config, "m").pick(chat(SYSTEM, "q"), rs) in rs, name


def test_unknown_plugins_and_bad_params_are_refused():
    with pytest.raises(ValueError, match="unknown scorer 'fastest'"):
        RoutingProfile(scorers=[{"name": "fastest"}])
    with pytest.raises(ValueError, match="prefix-affinity: params: block_chars"):
        RoutingProfile(scorers=[{"name": "prefix-affinity", "params": {"block_chars": 1}}])
    with pytest.raises(ValueError, match="unknown picker"):
        RoutingProfile(picker="best")
