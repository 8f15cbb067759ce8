"""prefix-cost: a conversation stays on the replica holding its prefix unless vLLM's own queue time there costs
more than recomputing the prefix elsewhere at vLLM's own prefill rate; without those figures the match decides."""

import random

import pytest

from backends.replicas import Replica
from backends.vllm_stats import VLLMStats
from gateway.endpoints.chat import ROUTE as CHAT
from policies.config import RoutingProfile
from policies.metrics import GatewayMetrics
from policies.pipeline import Request
from policies.routing import Stats
from policies.routing.base import Note
from policies.routing.least_in_flight import LeastInFlight
from policies.routing.pickers import MaxScore
from policies.routing.prefix_cost import PrefixCost, PrefixCostParams
from policies.routing.profile import Profile
from policies.routing.vllm_queue import VLLMQueue
from tests.support.calls import call_of

SYSTEM = "You are a careful agent. " * 320  # ~8,000 characters: ~2,000 tokens at 4 characters a token


def replicas(n=2):
    return [Replica(name=f"r{i}", model="m", url=f"http://127.0.0.1:{9000 + i}", served_name="m")
            for i in range(n)]


def conversation(n, turns=1):
    messages = [{"role": "system", "content": f"agent {n}. " + SYSTEM}]
    for t in range(2 * turns - 1):
        messages.append({"role": "user" if t % 2 == 0 else "assistant", "content": f"turn {t} " + "y" * 200})
    return call_of(Request("r", "chat/completions", {}, "127.0.0.1", 0.0),
                   body={"model": "m", "messages": messages}, model="m", prompt_of=CHAT.prompt)


def vllm(at=1.0, waiting=0, running=10, queue=(0.0, 0), prefill=(10.0, 100), computed=100_000.0, ttft=None):
    """A scrape: `queue` and `prefill` are (seconds in all, requests) since the server started; `computed` the
    prompt tokens it computed (prefix-cache queries less hits). 10 s of prefill for 100,000 tokens: 10k tok/s."""
    return VLLMStats(running=running, waiting=waiting, kv_usage=0.5, scraped_at=at,
                     queue_seconds=queue[0], queue_requests=queue[1],
                     prefill_seconds=None if prefill is None else prefill[0],
                     prefill_requests=None if prefill is None else prefill[1],
                     ttft_seconds=None if ttft is None else ttft[0], ttft_requests=None if ttft is None else ttft[1],
                     prefix_queries=computed + 50_000, prefix_hits=50_000.0, requests_finished=100)


def setup(seen, **params):
    """A profile of prefix-cost (weight 4) with the default's load scorers after it, the scorer and metrics;
    conversations 0-3 have had their first turn on r0."""
    rs = replicas()
    scorer = PrefixCost(PrefixCostParams(**params))
    metrics = GatewayMetrics()
    p = Profile([(scorer, 4.0), (VLLMQueue(), 2.0), (LeastInFlight(), 1.0)], (), MaxScore(random.Random(0)),
                Stats(lambda r: seen.get(r.name)), metrics, "m")
    for n in range(4):
        scorer.picked(conversation(n).routing(), rs[0], Note())
    return rs, scorer, p, metrics


def outcomes(metrics):
    return {o: n for (_m, s, o), n in metrics.routing_decisions.counts.items() if s == "prefix-cost"}


def test_a_conversation_stays_while_its_replicas_queue_costs_less_than_the_recompute_elsewhere():
    # r0 queues 0.1 s a request (vLLM's own mean) and holds ~2,000 of the ~2,100 prompt tokens: ~0.11 s there;
    # r1 queues nothing but would compute all ~2,100 tokens at 10k tok/s: ~0.21 s. r0 is ten times as loaded,
    # which the load scorers (weights 2 + 1) would follow: the cost decides.
    seen = {"r0": vllm(waiting=4, running=100, queue=(10.0, 100)), "r1": vllm(running=10)}
    rs, _, p, metrics = setup(seen)
    for n in range(2):
        assert p.pick(conversation(n, turns=2), rs) is rs[0]
    assert outcomes(metrics) == {"stay": 2}


def test_a_conversation_moves_when_its_replicas_queue_costs_more_than_the_recompute_elsewhere():
    # r0 now queues 0.5 s a request: more than the ~0.21 s the whole prompt costs to compute on r1
    seen = {"r0": vllm(waiting=4, queue=(50.0, 100)), "r1": vllm()}
    rs, _, p, metrics = setup(seen)
    assert p.pick(conversation(0, turns=2), rs) is rs[1]
    assert outcomes(metrics) == {"move": 1}
    # the same queue on a slow replica pair (1k tok/s: ~2.1 s to recompute) is worth waiting for
    seen.update(r0=vllm(waiting=4, queue=(50.0, 100), prefill=(100.0, 100)), r1=vllm(prefill=(100.0, 100)))
    rs, _, p, metrics = setup(seen)
    assert p.pick(conversation(0, turns=2), rs) is rs[0]
    assert outcomes(metrics) == {"stay": 1}


def test_a_move_must_save_the_margin():
    seen = {"r0": vllm(waiting=4, queue=(30.0, 100)), "r1": vllm()}  # 0.31 s there against ~0.21 s on r1
    rs, _, p, metrics = setup(seen)
    assert p.pick(conversation(0, turns=2), rs) is rs[1]
    rs, _, p, metrics = setup(seen, margin=0.5)
    assert p.pick(conversation(0, turns=2), rs) is rs[0]
    assert outcomes(metrics) == {"stay": 1}


def test_queue_time_and_rate_are_taken_over_the_window_not_since_the_start():
    # r0 queued 1 s a request long ago (cumulative 100 s over 100 requests); in the last scrapes 50 more
    # requests queued 0.01 s each: the recent figure says stay, the cumulative one would have said move
    seen = {"r0": vllm(at=1.0, waiting=4, queue=(100.0, 100)), "r1": vllm(at=1.0)}
    rs, scorer, p, metrics = setup(seen)
    assert p.pick(conversation(0, turns=2), rs) is rs[1]
    seen.update(r0=vllm(at=2.0, waiting=4, queue=(100.5, 150), prefill=(15.0, 150), computed=150_000.0),
                r1=vllm(at=2.0))
    assert p.pick(conversation(1, turns=2), rs) is rs[0]
    assert outcomes(metrics) == {"move": 1, "stay": 1}
    queue, rate = scorer.figures(rs[0], seen["r0"])
    assert queue == pytest.approx(0.01) and rate == pytest.approx(10_000)
    # past the window the old scrape is dropped: the window starts at the newest scrape older than it
    late = vllm(at=20.0, waiting=4, queue=(101.5, 250), prefill=(25.0, 250), computed=250_000.0)
    scorer.figures(rs[0], late)
    assert [f.at for f in scorer.history["r0"]] == [2.0, 20.0]


def test_without_vllm_figures_the_match_decides():
    rs, _, p, metrics = setup({})  # no scrape at all: the conversation stays where its prefix is
    assert p.pick(conversation(0, turns=2), rs) is rs[0]
    # a scrape without queue or prefill figures (an older vLLM) on one side: the same
    seen = {"r0": VLLMStats(running=100, waiting=9, scraped_at=1.0), "r1": vllm()}
    rs, _, p, metrics = setup(seen)
    assert p.pick(conversation(0, turns=2), rs) is rs[0]
    assert outcomes(metrics) == {"no_stats": 1}


def test_a_replica_without_a_prefill_histogram_is_timed_by_ttft_less_queue():
    # the simulator and older servers report time to first token and queue time but no prefill time
    seen = {"r0": vllm(waiting=4, queue=(50.0, 100), prefill=None, ttft=(60.0, 100)),
            "r1": vllm(prefill=None, ttft=(10.0, 100))}
    rs, scorer, p, metrics = setup(seen)
    assert scorer.figures(rs[1], seen["r1"]) == (0.0, pytest.approx(10_000))
    assert p.pick(conversation(0, turns=2), rs) is rs[1]
    assert outcomes(metrics) == {"move": 1}


def test_a_new_conversation_leans_to_the_shorter_queue_and_load_settles_it():
    seen = {"r0": vllm(waiting=2, queue=(20.0, 100)), "r1": vllm()}
    rs, scorer, p, metrics = setup(seen)
    note = Note()
    scores = scorer.score(conversation(9).routing(), rs, Stats(lambda r: seen[r.name]), note)
    assert note.outcome == "miss" and scores[1] == 1.0 and 0.0 < scores[0] < 1.0
    assert p.pick(conversation(9), rs) is rs[1]


def test_the_policy_file_takes_its_params_and_refuses_unknown_ones():
    RoutingProfile(scorers=[{"name": "prefix-cost", "weight": 4, "params": {"window": 5, "margin": 0.05}}])
    with pytest.raises(ValueError, match="prefix-cost"):
        RoutingProfile(scorers=[{"name": "prefix-cost", "params": {"window": 0}}])
    with pytest.raises(ValueError, match="prefix-cost"):
        RoutingProfile(scorers=[{"name": "prefix-cost", "params": {"queue_weight": 1}}])


def test_a_real_vllm_scrape_gives_the_scorer_its_queue_time_and_prefill_rate():
    from pathlib import Path

    from backends.vllm_stats import parse_metrics, relevant_lines

    sample = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu" / "metrics.txt").read_text()
    stats = parse_metrics(sample, scraped_at=1.0)
    assert (stats.queue_requests, stats.prefill_requests, stats.ttft_requests) == (4.0, 4.0, 4.0)
    assert stats.queue_seconds == pytest.approx(0.000141, rel=0.01)
    assert stats.prefill_seconds == pytest.approx(0.0399, rel=0.01)
    assert "_bucket" not in relevant_lines(sample)  # the histograms' sums and counts only
    queue, rate = PrefixCost().figures(replicas()[0], stats)  # nothing waits: no queue; 40 tokens in 0.04 s
    assert queue == 0.0 and rate == pytest.approx(40 / 0.0399, rel=0.01)
