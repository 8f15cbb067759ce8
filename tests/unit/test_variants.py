"""Variants of a model: the policy file's shape, assignment by weight, stickiness, live weight changes."""

from __future__ import annotations

import asyncio
import random

import pytest

from backends.replicas import ReplicaSet
from policies.admission import Admission
from policies.compile import replica_set
from policies.config import PolicyError, parse_policy
from policies.metrics import GatewayMetrics
from policies.pipeline import Call, Request
from policies.variant_signals import ANSWER
from policies.variants import HEADER, SHADOW, AssignVariant, NoLiveWeight, UnknownVariant, Variants, plan_of, point_of
from tests.support.calls import settled

POLICY = """
models:
  - name: chat
    sticky: {header: x-session-id, key: true}
    variants:
      - name: a
        weight: 80
        backends: [{url: "http://127.0.0.1:9001", cap: 4}]
      - name: b
        weight: 20
        served_name: chat-fp8
        backends: [{url: "http://127.0.0.1:9002", cap: 2}, {url: "http://127.0.0.1:9003", name: fp8-two}]
      - name: shadowed
        weight: 5
        shadow: true
        backends: [{url: "http://127.0.0.1:9004"}]
  - name: plain
    backends: [{url: "http://127.0.0.1:9005"}]
"""


def policy(text: str = POLICY):
    return parse_policy(text)


def call(model="chat", headers=None, key=None) -> Call:
    c = Call(Request("r", "chat/completions", headers or {}, "127.0.0.1", 0.0))
    settled(c, model=model, key=key)
    return c


class Key:
    def __init__(self, id: str) -> None:
        self.id = id


def test_variant_backends_are_the_models_backends_with_their_variant():
    p = policy()
    chat = p.models[0]
    assert [b.name for b in chat.backends] == ["chat-a-0", "chat-b-0", "fp8-two", "chat-shadowed-0"]
    replicas = replica_set(p)
    assert sorted(replicas.by_model) == ["chat#a", "chat#b", "chat#shadowed", "plain"]
    b = replicas.by_model["chat#b"]
    assert [(r.name, r.variant, r.group, r.model, r.served_name, r.cap) for r in b] == [
        ("chat-b-0", "b", "chat#b", "chat", "chat-fp8", 2), ("fp8-two", "b", "chat#b", "chat", "chat-fp8", None)]
    assert replicas.by_model["plain"][0].variant is None and replicas.by_model["plain"][0].group == "plain"


@pytest.mark.parametrize("change, message", [
    ("    backends: [{url: 'http://127.0.0.1:1'}]\n", "not in `backends`"),
    ("    sticky: {key: true}\n", None),
])
def test_a_model_gives_variants_or_backends(change, message):
    text = POLICY.replace("    sticky: {header: x-session-id, key: true}\n", change)
    if message is None:
        policy(text)
        return
    with pytest.raises(PolicyError, match=message):
        policy(text)


@pytest.mark.parametrize("text, message", [
    (POLICY.replace("name: b\n", "name: a\n"), "variant names must be unique"),
    (POLICY.replace("weight: 80", "weight: 0").replace("weight: 20", "weight: 0"), "weight above 0"),
    (POLICY + "    sticky: {key: true}\n", "sticky and guard apply to variants"),
    (POLICY.replace("name: b\n", "name: 'b#x'\n"), "name"),
    (POLICY.replace("        served_name: chat-fp8\n", "        discovery: {kind: kubernetes, namespace: x,"
                                                       " service: y}\n"), "not both"),
])
def test_bad_variants_are_refused_naming_why(text, message):
    with pytest.raises(PolicyError, match=message):
        policy(text)


def test_points_fall_into_the_cumulative_weight_ranges():
    plan = plan_of(policy().models[0], {"a": 80, "b": 20, "shadowed": 5})
    assert plan.names == ("a", "b")  # a shadow never gets live traffic
    assert plan.bounds == (0.8, 1.0)
    assert [plan.names[plan.index(p)] for p in (0.0, 0.5, 0.7999, 0.8, 0.95, 0.999999)] == \
        ["a", "a", "a", "b", "b", "b"]
    zero = plan_of(policy().models[0], {"a": 0, "b": 20, "shadowed": 5})
    assert {zero.names[zero.index(p)] for p in (0.0, 0.3, 0.99)} == {"b"}


def assign(variants: Variants, c: Call) -> str:
    asyncio.run(AssignVariant(variants).enter(c))
    return c.variant


def configured(text: str = POLICY) -> Variants:
    v = Variants()
    v.configure(policy(text))
    return v


@pytest.mark.parametrize("seed", range(5))
def test_unsticky_assignment_follows_the_weights_closely_in_any_run(seed):
    random.seed(seed)  # the sequence's start
    v = configured(POLICY.replace("    sticky: {header: x-session-id, key: true}\n", ""))
    picks = [assign(v, call()) for _ in range(1000)]
    for start, n in ((0, 100), (100, 500), (0, 1000)):  # every run of requests, not only the long one
        share = picks[start:start + n].count("b") / n
        assert abs(share - 0.2) <= 0.02, (start, n, share)
    random.seed(seed + 100)  # another process starts elsewhere in the sequence
    other = configured(POLICY.replace("    sticky: {header: x-session-id, key: true}\n", ""))
    assert [assign(other, call()) for _ in range(50)] != picks[:50]
    c = call()
    assign(v, c)
    assert c.group == f"chat#{c.variant}" and c.response_headers[HEADER] == c.variant


def test_a_model_without_variants_is_left_alone():
    v = configured()
    c = call("plain")
    assert assign(v, c) is None and c.group == "" and HEADER not in c.response_headers


def test_sticky_sessions_keep_their_variant_and_split_by_weight():
    v = configured()
    sessions = [f"conversation-{i}" for i in range(3000)]
    first = {s: assign(v, call(headers={"x-session-id": s})) for s in sessions}
    for s in sessions[:200]:  # every later turn of a conversation lands where its first did
        assert all(assign(v, call(headers={"x-session-id": s})) == first[s] for _ in range(5))
    share = list(first.values()).count("a") / len(sessions)
    assert 0.77 < share < 0.83
    # without the header, the key decides, the same way every time
    by_key = {assign(v, call(key=Key(f"key{i}"))) for i in range(50)}
    assert by_key == {"a", "b"}
    assert len({assign(v, call(key=Key("key7"))) for _ in range(20)}) == 1


def test_the_hash_is_stable_across_processes():
    # blake2b, not Python's salted hash(): these values are the same in every gateway replica
    assert point_of("conversation-1") == pytest.approx(
        int.from_bytes(__import__("hashlib").blake2b(b"conversation-1", digest_size=8).digest(), "big") / 2**64)


def test_raising_a_weight_moves_only_sessions_of_the_range_that_moved():
    v = configured()
    sessions = [f"s{i}" for i in range(2000)]
    before = {s: assign(v, call(headers={"x-session-id": s})) for s in sessions}
    v.set_weights("chat", {"a": 90, "b": 10})
    after = {s: assign(v, call(headers={"x-session-id": s})) for s in sessions}
    assert all(after[s] == "a" for s in sessions if before[s] == "a")
    moved = sum(1 for s in sessions if before[s] != after[s])
    assert 0.07 * len(sessions) < moved < 0.13 * len(sessions)


def test_weight_changes_are_checked():
    v = configured()
    with pytest.raises(UnknownVariant, match="no variant c"):
        v.set_weights("chat", {"c": 1})
    with pytest.raises(NoLiveWeight, match="weight above 0"):
        v.set_weights("chat", {"a": 0, "b": 0})
    with pytest.raises(UnknownVariant, match="has no variants"):
        v.set_weights("plain", {"a": 1})
    assert v.weights["chat"] == {"a": 80, "b": 20, "shadowed": 5}  # a refused change changes nothing


def test_a_reload_keeps_live_weights_unless_the_file_changed_them():
    v = configured()
    v.set_weights("chat", {"a": 50, "b": 50})
    v.configure(policy(POLICY.replace("cap: 4", "cap: 5")))  # another change to the same model
    assert v.weights["chat"]["a"] == 50
    v.configure(policy(POLICY.replace("weight: 80", "weight: 70")))
    assert v.weights["chat"] == {"a": 70, "b": 20, "shadowed": 5}
    assert v.view("chat")["variants"][0] == {"name": "a", "weight": 70, "shadow": False, "filed_weight": 70,
                                              "guard": None}


def test_weights_are_published_as_a_metric():
    metrics = GatewayMetrics()
    v = Variants(metrics)
    v.configure(policy())
    v.set_weights("chat", {"b": 40})
    assert metrics.registry.get_sample_value("llm_gateway_variant_weight", {"model": "chat", "variant": "b"}) == 40


def test_each_variant_is_admitted_to_its_own_replicas():
    p = policy()
    replicas: ReplicaSet = replica_set(p)
    for r in replicas:
        r.state = "up"
    from policies.routing import Stats, build_profile
    from policies.config import profile_of

    metrics = GatewayMetrics()
    profiles = {m.name: build_profile(profile_of(p, m)[1], m.name, Stats(None), metrics) for m in p.models}
    admission = Admission(p, replicas, profiles, metrics)

    async def run():
        got = await admission.acquire("chat#b", "owner")
        assert got.variant == "b"
        admission.release(got)
        assert got.in_flight == 0
        a = [await admission.acquire("chat#a", "owner") for _ in range(4)]  # a's cap is 4: b's room is not a's
        assert {r.name for r in a} == {"chat-a-0"}
        with pytest.raises(Exception, match="capacity"):
            async with asyncio.timeout(5):
                admission.queues["chat#a"].config = p.models[0].queue.model_copy(update={"max_depth": 0})
                await admission.acquire("chat#a", "owner")

    asyncio.run(run())


def test_a_streams_text_is_gathered_only_when_structured_output_or_a_shadows_comparison_needs_it():
    v = configured(POLICY.replace("weight: 5\n", "weight: 100\n"))  # every request is copied to the shadow
    kept = {}
    for label, body in (("plain", {}), ("json", {"response_format": {"type": "json_object"}}),
                        ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
                        ("compared", {"temperature": 0}), ("sampled", {"temperature": 0.7})):
        c = call()
        c.body = {**body, "stream": True}
        assign(v, c)
        assert SHADOW.get(c) == ("shadowed", "chat#shadowed")
        kept[label] = ANSWER.of(c).whole
    assert kept == {"plain": False, "json": True, "tools": True, "compared": True, "sampled": False}
    c = call()
    c.body = {"temperature": 0, "stream": True}
    assign(configured(POLICY.replace("weight: 5\n", "weight: 0\n")), c)  # a shadow at weight 0 gets no copy
    assert SHADOW.get(c) is None and ANSWER.of(c).whole is False
    c = call()
    c.body = {"tools": [{"type": "function", "function": {"name": "f"}}]}
    assign(v, c)
    assert ANSWER.get(c) is None  # not streamed: its whole answer is read once it is in
