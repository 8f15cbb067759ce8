import random
from dataclasses import replace

import pytest

from backends.replicas import DOWN, UP, Replica
from backends.vllm_stats import Scraper, VLLMStats
from gateway.endpoints.chat import ROUTE as CHAT
from policies.config import BUILTIN_PROFILES, RoutingProfile
from policies.metrics import GatewayMetrics
from policies.pipeline import UNCACHED, Call, Request
from policies.routing import Stats, build_profile
from policies.routing.base import Note
from policies.routing.filters import KVHeadroom
from policies.routing.kv_cache import KVCache
from policies.routing.least_in_flight import LeastInFlight
from policies.routing.pickers import MaxScore
from policies.routing.prefix_affinity import PrefixAffinityParams as PrefixParams
from policies.routing.prefix_affinity import PrefixAffinity
from policies.routing.profile import Profile
from policies.routing.session_affinity import SessionAffinity
from policies.routing.vllm_queue import VLLMQueue
from tests.support.calls import call_of


def replicas(*in_flight):
    return [Replica(name=f"r{i}", model="m", url=f"http://127.0.0.1:{9000 + i}", served_name="m", in_flight=n)
            for i, n in enumerate(in_flight)]


def profile(*scorers, seed=0, stats=None, filters=(), metrics=None):
    return Profile(list(scorers) or [(LeastInFlight(), 1.0)], filters, MaxScore(random.Random(seed)), stats,
                   metrics, "m")


def outcomes(metrics, scorer="prefix-affinity"):
    """{outcome: count} of one scorer's decisions, as the gateway's /metrics tallies them."""
    return {o: n for (_m, s, o), n in metrics.routing_decisions.counts.items() if s == scorer}


def chat(system, *turns, headers=None):
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return call_of(Request("r", "chat/completions", headers or {}, "127.0.0.1", 0.0),
                   body={"model": "m", "messages": messages}, model="m", prompt_of=CHAT.prompt)


routed = Call.routing  # what a pick hands its plugins: tests that call a plugin directly hand it the same


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

    def score(self, call, candidates, stats, note):
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


class ScrapedMetrics:
    """vLLM's /metrics of each replica, as the scraper's client reads them: running requests by URL."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}

    async def get(self, url: str, **_bounds) -> tuple[int, bytes]:
        running = self.running.get(url.removesuffix("/metrics"), 0)
        return 200, f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n".encode()


async def test_a_request_that_ended_after_the_scrape_no_longer_counts_but_load_from_elsewhere_does():
    rs = replicas(0, 0)
    scraper, vllm = Scraper(lambda: rs, stale_after=3600), ScrapedMetrics()
    stats = Stats(scraper.stats)
    rs[1].in_flight += 1  # this gateway's request runs on r1; another client's runs on r0
    vllm.running = {rs[0].url: 1, rs[1].url: 1}
    await scraper.scrape_all(vllm)
    assert (stats.load(rs[0]), stats.load(rs[1])) == (1, 1)
    rs[1].end()  # over, before the next scrape: r1 is idle and must not look busy with it until then
    vllm.running[rs[1].url] = 0
    assert (stats.load(rs[0]), stats.load(rs[1])) == (1, 0)
    assert profile((VLLMQueue(), 1.0), stats=stats).pick(None, rs) is rs[1]
    rs[0].in_flight += 1  # this gateway's own request on r0 now: never counted less than what it has there
    rs[1].in_flight += 1
    assert (stats.load(rs[0]), stats.load(rs[1])) == (1, 1)
    vllm.running[rs[0].url] = 2  # r0: its own request and the other client's; r1: not started yet
    await scraper.scrape_all(vllm)
    assert (stats.load(rs[0]), stats.load(rs[1])) == (2, 1)


def test_kv_cache_scorer_and_headroom_filter():
    rs = replicas(0, 0, 0)
    seen = {"r0": VLLMStats(kv_usage=0.9), "r1": VLLMStats(kv_usage=0.2), "r2": VLLMStats(kv_usage=0.99)}
    stats = Stats(lambda r: seen.get(r.name))
    assert profile((KVCache(), 1.0), stats=stats).pick(None, rs) is rs[1]
    keep = KVHeadroom(KVHeadroom.Params(max_usage=0.95)).keep(routed(chat("s")), rs, stats)
    assert keep == rs[:2]
    assert KVHeadroom().keep(routed(chat("s")), rs[2:], stats) == rs[2:]  # never filters every candidate away


SYSTEM = "You are a careful agent. " * 40  # ~1000 characters
PAD = "w" * 80  # a turn long enough to add whole blocks (64 characters) to the hashed prompt


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


def conversation(n, turns=1, system=None):
    """Turn `turns` of conversation n: its own system prompt (or a shared one) and its history."""
    history = [f"conversation {n} turn {t}: " + "y" * 200 for t in range(2 * turns - 1)]
    return chat(system or f"agent {n}. " + SYSTEM, *history)


def test_the_opt_in_fixed_difference_guard_still_trips_at_its_difference():
    # (`imbalance` is off by default now; a policy that sets it keeps the old rule on top of the others)
    rs = replicas(0, 0)
    metrics = GatewayMetrics()
    scorer = PrefixAffinity(PrefixParams(imbalance=3))
    p = profile((scorer, 4.0), (LeastInFlight(), 1.0), metrics=metrics)
    home = p.pick(conversation(0), rs)
    other = rs[1 - rs.index(home)]
    for turn in (2, 3):  # below the guard: the conversation stays home however busy it gets
        home.in_flight += 1
        assert p.pick(conversation(0, turns=turn), rs) is home
    assert outcomes(metrics) == {"miss": 1, "hit": 2}
    home.in_flight += 1  # 3 more than the other: the guard trips
    assert p.pick(conversation(0, turns=4), rs) is other and outcomes(metrics)["load_guard"] == 1
    assert scorer.matched(other, scorer.blocks(routed(conversation(0, turns=4)))) > 0  # learned there


def test_prefix_lru_is_bounded_by_the_replicas_cache_size():
    rs = replicas(0, 0)
    seen = {r.name: VLLMStats(block_size=16, num_blocks=32) for r in rs}  # 512 tokens ~ 2048 chars
    scorer = PrefixAffinity(PrefixParams(block_chars=64))
    p = profile((scorer, 1.0), stats=Stats(lambda r: seen.get(r.name)))
    call = chat("a" * 5000, "q")
    home = p.pick(call, rs)
    assert max(len(lru) for lru in scorer.lrus.values()) == 2048 // 64
    assert scorer.matched(home, scorer.blocks(routed(call))) == 2048 // 64  # what is kept is the prompt's start


def test_prefix_lru_evicts_a_prefix_from_its_end():
    # vLLM frees a request's blocks tail first; a full LRU must lose a conversation's last blocks, not its
    # first, or one eviction turns a conversation whose prefix vLLM still holds into a miss.
    rs = replicas(0, 1)  # both prompts go to r0, the less loaded (the scorer only learns sizes among several)
    seen = {r.name: VLLMStats(block_size=16, num_blocks=40) for r in rs}  # 640 tokens ~ 40 blocks of 64 chars
    scorer = PrefixAffinity(PrefixParams(block_chars=64))
    p = profile((scorer, 1.0), (LeastInFlight(), 1.0), stats=Stats(lambda r: seen.get(r.name)))
    old, new = chat("old " * 480, "q"), chat("new " * 240, "q")  # ~30 and ~15 blocks: 40 do not hold both
    assert p.pick(old, rs) is rs[0] and p.pick(new, rs) is rs[0]
    new, old = routed(new), routed(old)
    assert scorer.matched(rs[0], scorer.blocks(new)) == len(scorer.blocks(new))
    assert 0 < scorer.matched(rs[0], scorer.blocks(old)) < len(scorer.blocks(old))


def test_prefix_affinity_forgets_a_replica_whose_vllm_restarted():
    rs = replicas(0, 0)
    seen = {r.name: VLLMStats(running=0, waiting=0, requests_finished=10) for r in rs}
    scorer = PrefixAffinity()
    p = profile((scorer, 4.0), (VLLMQueue(), 2.0), (LeastInFlight(), 1.0), stats=Stats(lambda r: seen[r.name]))
    turns = [f"q0: {PAD}"]
    home = p.pick(chat(SYSTEM, *turns), rs)
    other = rs[1 - rs.index(home)]
    turns += [f"a0: {PAD}", f"q1: {PAD}"]
    assert p.pick(chat(SYSTEM, *turns), rs) is home
    turns += [f"a1: {PAD}", f"q2: {PAD}"]
    assert p.pick(chat(SYSTEM, *turns), rs, exclude=[home]) is other  # home is down: the conversation moves
    # home is back, restarted (its counters start over, its prefix cache is empty); other is one request busier
    seen[home.name] = VLLMStats(running=0, waiting=0, requests_finished=0)
    seen[other.name] = VLLMStats(running=1, waiting=0, requests_finished=12)
    turns += [f"a2: {PAD}", f"q3: {PAD}"]
    assert p.pick(chat(SYSTEM, *turns), rs) is other  # not back to home on the strength of what it lost
    assert scorer.matched(home, scorer.blocks(routed(chat(SYSTEM, *turns)))) == 0


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
    metrics = GatewayMetrics()
    assert profile((SessionAffinity(), 4.0), (LeastInFlight(), 1.0), metrics=metrics).pick(chat("s", "q"), rs) is rs[1]
    assert outcomes(metrics, "session-affinity") == {"no_session": 1}


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


# -- the load guard: it trips on evidence that following the match costs more than a miss, not on a difference --

def learned_on(scorer, replica, *calls):
    for call in calls:
        scorer.picked(routed(call), replica, Note())


def test_a_busy_replica_that_does_not_queue_keeps_its_conversations():
    # A GPU batches 100+ requests: running requests alone are not queueing. The old fixed difference of 8 moved
    # these turns (each a full miss); now they stay as long as vLLM reports nothing waiting and room in its cache.
    rs = replicas(0, 0)
    seen = {"r0": VLLMStats(running=120, waiting=0, kv_usage=0.6),
            "r1": VLLMStats(running=20, waiting=0, kv_usage=0.1)}
    metrics = GatewayMetrics()
    p = profile((PrefixAffinity(), 4.0), (VLLMQueue(), 2.0), (LeastInFlight(), 1.0),
                stats=Stats(lambda r: seen[r.name]), metrics=metrics)
    learned_on(p.scorers[0][0], rs[0], *(conversation(n) for n in range(4)))  # first turns, before the load
    for n in range(4):
        assert p.pick(conversation(n, turns=2), rs) is rs[0]
    assert outcomes(metrics) == {"hit": 4}


def test_a_replica_that_queues_loses_a_turn_when_its_queue_costs_more_than_the_miss():
    rs = replicas(0, 0)
    # r0's vLLM has one request waiting; its finished requests each needed ~1,000 uncached prompt tokens
    # (queries - hits over finished), more than this ~300-token prompt costs to recompute on r1.
    seen = {"r0": VLLMStats(running=3, waiting=1, prefix_queries=10_000, prefix_hits=0, requests_finished=10),
            "r1": VLLMStats(running=3, waiting=0, prefix_queries=10_000, prefix_hits=0, requests_finished=10)}
    metrics = GatewayMetrics()
    scorer = PrefixAffinity()
    p = profile((scorer, 4.0), (VLLMQueue(), 2.0), (LeastInFlight(), 1.0), stats=Stats(lambda r: seen[r.name]),
                metrics=metrics)
    learned_on(scorer, rs[0], conversation(0), conversation(1))
    assert p.pick(conversation(0, turns=2), rs) is rs[1]
    assert outcomes(metrics) == {"guard_queue": 1}
    # the same one waiting request, but r0's requests are mostly cached (~20 uncached tokens each): the wait
    # ahead is shorter than the miss, so the turn stays
    seen["r0"] = VLLMStats(running=3, waiting=1, prefix_queries=10_000, prefix_hits=9_800, requests_finished=10)
    assert p.pick(conversation(1, turns=2), rs) is rs[0]
    assert outcomes(metrics) == {"guard_queue": 1, "hit": 1}


def test_a_replica_with_a_full_kv_cache_loses_a_turn_unless_every_replica_is_full():
    rs = replicas(0, 0)
    seen = {"r0": VLLMStats(kv_usage=0.97), "r1": VLLMStats(kv_usage=0.5)}
    metrics = GatewayMetrics()
    scorer = PrefixAffinity()
    p = profile((scorer, 4.0), (LeastInFlight(), 1.0), stats=Stats(lambda r: seen[r.name]), metrics=metrics)
    learned_on(scorer, rs[0], conversation(0), conversation(1))
    assert p.pick(conversation(0, turns=2), rs) is rs[1]
    seen["r1"] = VLLMStats(kv_usage=0.99)
    assert p.pick(conversation(1, turns=2), rs) is rs[0]
    assert outcomes(metrics) == {"guard_kv": 1, "hit": 1}


def test_a_hot_prefix_spreads_by_load_while_each_conversation_stays_on_its_replica():
    # One system prompt under every conversation: affinity alone sends them all where the first went. Once two
    # conversations continued it differently, it is a shared prefix: new conversations go by load (the copy on
    # the second replica is one miss that every later conversation saves), their own turns stay put.
    rs = replicas(0, 0)
    metrics = GatewayMetrics()
    p = profile((PrefixAffinity(), 4.0), (LeastInFlight(), 1.0), metrics=metrics)
    homes = {}
    for n in range(10):
        homes[n] = p.pick(conversation(n, system=SYSTEM), rs)
        homes[n].in_flight += 1
    assert sorted(r.in_flight for r in rs) == [5, 5]
    assert outcomes(metrics).get("guard_shared", 0) >= 1
    # the same prompt again and again (a hot prefix whose differences lie past the last whole block) spreads too
    busy = replicas(0, 0)
    for _ in range(6):
        p.pick(chat("A hot one. " + SYSTEM, "q"), busy).in_flight += 1
    assert sorted(r.in_flight for r in busy) == [3, 3]
    rs[0].in_flight, rs[1].in_flight = 9, 0  # uneven, but nothing queues: later turns stay home
    for n in range(10):
        assert p.pick(conversation(n, turns=3, system=SYSTEM), rs) is homes[n]


def test_each_pick_keeps_its_own_scratch():
    # score() of two calls before either is picked (as a scorer shared by two profiles could see): each pick
    # learns its own prompt, from its own note, not the last one scored
    rs = replicas(0, 0)
    scorer = PrefixAffinity()
    a, b = routed(conversation(0)), routed(conversation(1))
    note_a, note_b = Note(), Note()
    scorer.score(a, rs, Stats(), note_a)
    scorer.score(b, rs, Stats(), note_b)
    scorer.picked(a, rs[0], note_a)
    scorer.picked(b, rs[1], note_b)
    assert scorer.matched(rs[0], scorer.blocks(a)) == len(scorer.blocks(a))
    assert scorer.matched(rs[1], scorer.blocks(b)) == len(scorer.blocks(b))
    assert scorer.matched(rs[0], scorer.blocks(b)) == 0


def test_with_the_guard_off_a_hot_prefix_piles_on_one_replica():
    rs = replicas(0, 0)
    p = profile((PrefixAffinity(PrefixParams(guard=False)), 4.0), (LeastInFlight(), 1.0))
    for n in range(10):
        p.pick(conversation(n, system=SYSTEM), rs).in_flight += 1
    assert sorted(r.in_flight for r in rs) == [0, 10]  # the first went by load, the rest followed it


def test_the_prompt_is_read_as_the_route_declares_it():
    from gateway.endpoints import embeddings, messages

    scorer = PrefixAffinity()
    call = conversation(0)
    assert scorer.blocks(routed(call))
    call.request = replace(call.request, route="renamed")  # the route's name plays no part
    assert scorer.blocks(routed(call)) == scorer.blocks(routed(conversation(0)))
    anthropic = call_of(Request("r", "messages", {}, "127.0.0.1", 0.0),
                        model="m", prompt_of=messages.MESSAGES.prompt,
                     body={"model": "m", "system": SYSTEM, "messages": [{"role": "user", "content": "hi"}]})
    assert len(scorer.blocks(routed(anthropic))) == len(SYSTEM) // 64
    call.prompt_of = embeddings.ROUTE.prompt  # a route that declares no prompt
    assert scorer.blocks(routed(call)) == []


def test_every_plugin_is_timed_per_pick():
    from prometheus_client import generate_latest

    rs = replicas(0, 0)
    metrics = GatewayMetrics()
    p = profile((PrefixAffinity(), 4.0), (LeastInFlight(), 1.0), filters=[KVHeadroom()], metrics=metrics)
    for n in range(3):
        p.pick(conversation(n), rs)
    text = generate_latest(metrics.registry).decode()
    for plugin, step in (("kv-headroom", "filter"), ("prefix-affinity", "score"), ("least-in-flight", "score"),
                         ("max-score", "pick"), ("prefix-affinity", "learn")):
        assert (f'llm_gateway_routing_plugin_duration_seconds_count{{model="m",plugin="{plugin}",step="{step}"}} 3.0'
                in text), (plugin, step)
    assert 'llm_gateway_routing_plugin_duration_seconds_bucket{le="+Inf",model="m",plugin="max-score"' in text


def test_a_conversation_its_record_let_go_goes_back_where_it_went_not_by_load():
    # The record forgets sooner than vLLM (4 characters a token assumed; replies unseen), so a conversation it
    # evicted whole may still be partly cached where it went: with no replica matching at all, the record of
    # evicted blocks sends it back there; a prompt never sent anywhere still goes by load.
    rs = replicas(0, 0)
    seen = {r.name: VLLMStats(block_size=16, num_blocks=80) for r in rs}  # 1280 tokens ~ 80 blocks of 64 chars
    scorer = PrefixAffinity(PrefixParams(block_chars=64, evicted=0.125))  # the last 10 blocks evicted are kept
    metrics = GatewayMetrics()
    p = profile((scorer, 4.0), (LeastInFlight(), 1.0), stats=Stats(lambda r: seen.get(r.name)), metrics=metrics)
    old = ["first question " * 40]  # ~25 blocks with the system prompt's
    home = p.pick(chat(SYSTEM, *old), rs)
    other = rs[1 - rs.index(home)]
    home.in_flight, other.in_flight = 0, 9  # a newer conversation goes home too, and its 80 blocks evict `old`
    filler = chat("another agent " * 366)
    assert len(scorer.blocks(routed(filler))) == 80
    assert p.pick(filler, rs) is home
    assert scorer.matched(home, scorer.blocks(routed(chat(SYSTEM, *old)))) == 0
    home.in_flight, other.in_flight = 9, 0  # now home is the busier one
    later = chat(SYSTEM, *old, "an answer", "the next question")
    assert p.pick(later, rs) is home
    assert outcomes(metrics)["evicted"] == 1
    # where to go, not what is cached: the prefill order counts the whole prompt as uncached
    assert UNCACHED.get(later) == len(routed(later).prompt.text) / 4
    assert p.pick(chat("a prompt sent nowhere before " * 30), rs) is other
    assert outcomes(metrics)["miss"] >= 2  # the first prompt, and the new one (load decided)


def test_without_its_record_of_evicted_blocks_a_forgotten_conversation_goes_by_load():
    rs = replicas(0, 0)
    seen = {r.name: VLLMStats(block_size=16, num_blocks=80) for r in rs}
    scorer = PrefixAffinity(PrefixParams(block_chars=64))  # the default: no record of evicted blocks
    p = profile((scorer, 4.0), (LeastInFlight(), 1.0), stats=Stats(lambda r: seen.get(r.name)))
    old = ["first question " * 40]
    home = p.pick(chat(SYSTEM, *old), rs)
    other = rs[1 - rs.index(home)]
    home.in_flight, other.in_flight = 0, 9
    p.pick(chat("another agent " * 366), rs)
    home.in_flight, other.in_flight = 9, 0
    assert p.pick(chat(SYSTEM, *old, "an answer", "the next question"), rs) is other
    assert not scorer.evicted
