"""What a pick hands its plugins: a RoutingRequest made once from the call, its prompt read at most once."""

import dataclasses
import random

import pytest

from backends.lora import AdapterTarget
from backends.replicas import Replica
from backends.vllm_stats import VLLMStats
from policies.pipeline import Request
from policies.routing import Stats
from policies.routing.pickers import MaxScore
from policies.routing.prefix_affinity import PrefixAffinity
from policies.routing.prefix_affinity import PrefixAffinityParams as PrefixParams
from policies.routing.prefix_cost import PrefixCost
from policies.routing.profile import Profile
from policies.routing.prompt import chat_text
from policies.routing.request import NO_REQUEST, RoutingRequest
from tests.support.calls import call_of


class CountingRoute:
    """A route declaring the chat prompt, counting how often it is read."""

    def __init__(self) -> None:
        self.reads = 0

    def prompt(self, body):
        self.reads += 1
        return chat_text(body)


def call(route=None, **fields):
    body = {"model": "m", "messages": [{"role": "system", "content": "You are a careful agent. " * 40},
                                       {"role": "user", "content": "list the files"}]}
    return call_of(Request("r", "chat/completions", {"x-session-id": "s1"}, "127.0.0.1", 0.0), body=body, model="m",
                prompt_of=(route or CountingRoute()).prompt, **fields)


def replicas(n=3):
    return [Replica(name=f"r{i}", model="m", url=f"http://127.0.0.1:{9000 + i}", served_name="m") for i in range(n)]


def vllm():
    """A fresh scrape with queue and prefill figures, so that prefix-cost reads the prompt for its costs too."""
    return VLLMStats(running=1, waiting=0, kv_usage=0.5, scraped_at=1.0, queue_seconds=0.0, queue_requests=0,
                     prefill_seconds=10.0, prefill_requests=100, prefix_queries=150_000, prefix_hits=50_000.0,
                     requests_finished=100)


def test_a_pick_reads_the_prompt_once_however_many_scorers_ask():
    # three prefix scorers read the prompt (prefix-cost twice: its blocks and its costs), and prefix-affinity
    # learns the pick: one pick, one read
    rs = replicas()
    seen = {r.name: vllm() for r in rs}
    profile = Profile([(PrefixAffinity(), 4.0), (PrefixAffinity(PrefixParams(block_chars=32)), 2.0),
                       (PrefixCost(), 1.0)], (), MaxScore(random.Random(0)), Stats(lambda r: seen[r.name]))
    route = CountingRoute()
    first = call(route)
    assert profile.pick(first, rs) in rs
    assert route.reads == 1
    assert profile.pick(first, rs, exclude=[rs[0]]) in rs[1:]  # a retry picks again: one more read at most
    assert route.reads <= 2


class Recording:
    """A filter and a learning scorer that keep what each of their calls was handed."""

    name, learns = "recording", True

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def keep(self, request, candidates, stats):
        self.seen.append(("keep", request))
        return list(candidates)

    def score(self, request, candidates, stats, note):
        self.seen.append(("score", request))
        return [1.0] * len(candidates)

    def picked(self, request, replica, note):
        self.seen.append(("picked", request))


def test_plugins_get_one_immutable_routing_request_per_pick_not_the_call():
    rs = replicas(2)
    plugin = Recording()
    profile = Profile([(plugin, 1.0)], [plugin], MaxScore(random.Random(0)))
    adapter = AdapterTarget("ft", "/adapters/ft")
    route = CountingRoute()
    profile.pick(call(route, adapter=adapter), rs)
    assert [step for step, _ in plugin.seen] == ["keep", "score", "picked"]
    request = plugin.seen[0][1]
    assert isinstance(request, RoutingRequest) and all(r is request for _, r in plugin.seen)
    assert (request.model, request.endpoint, request.headers, request.adapter) == \
        ("m", "chat/completions", {"x-session-id": "s1"}, adapter)
    assert route.reads == 0  # nobody asked for the prompt: it was not read
    assert request.prompt.text == chat_text(request.prompt.body) and route.reads == 1
    assert request.prompt.text and route.reads == 1  # kept
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.model = "other"
    plugin.seen.clear()
    profile.pick(None, rs)  # a pick for no request
    assert all(r is NO_REQUEST for _, r in plugin.seen)
    assert (NO_REQUEST.model, NO_REQUEST.headers, NO_REQUEST.adapter, NO_REQUEST.prompt.text) == ("", {}, None, "")
