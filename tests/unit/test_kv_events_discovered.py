"""KV cache events, completed: every discovered replica gets a subscriber of its own (and loses it when it goes);
blocks offloaded to CPU weigh less than blocks in GPU memory; and an index that may know less than its vLLM holds
(blind) neither attracts nor repels all traffic."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from backends.kv_events import BlockIndex, KVEventSource, Subscribers, prefix_keys
from backends.replicas import DOWN, UP, HealthTimings, Replica, ReplicaSet
from backends.sources.base import Endpoint
from policies.config import PolicyError, parse_policy
from policies.discovery import Discovery
from policies.pipeline import Call, Request
from policies.routing import Stats
from policies.routing.base import Note
from policies.routing.precise_prefix import PrecisePrefix, load_prompt_tokenizer
from policies.routing.precise_prefix import PrecisePrefixParams as Params
from policies.routing.profile import Profile
from policies.routing.registry import SCORERS
from policies.routing.request import RoutingRequest
from tests.unit.test_kv_events import _free_port as free_port
from tests.unit.test_kv_events import keys, message, stored, wait_for
from tests.unit.test_kv_events import tokenizer_dir  # noqa: F401 (the fixture: a tokenizer, a chat template)
from tests.support.calls import call_of

BS = 4
PROMPT = list(range(100, 116))  # four blocks of 4


def removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


# --- discovered replicas ---------------------------------------------------------------------------------------


def discovered_policy(events: str = "{port: PORT}", port: int = 5557):
    return parse_policy("models: [{name: m, discovery: {kind: kubernetes, namespace: llm, service: vllm, "
                        f"kv_events: {events.replace('PORT', str(port))}}}}}]")


class FakeSource:
    kind = "kubernetes"

    def start(self, emit):
        self.emit = emit

    def stop(self):
        pass


async def test_a_discovered_replica_subscribes_at_its_own_address_never_another():
    replicas = ReplicaSet({"m": []}, HealthTimings())
    fake = FakeSource()
    discovery = Discovery(replicas, source_factory=lambda config, access: fake)
    discovery.sync(discovered_policy("{port: 5557, replay_port: 5558, topic: t, max_blocks: 1024}"))
    fake.emit([Endpoint("10.1.2.3", 8000), Endpoint("fc00::7", 8000)])
    await wait_for(lambda: len(replicas.by_model["m"]) == 2)  # (applied on the loop)
    v4, v6 = replicas.by_model["m"]
    assert v4.kv_events == KVEventSource("tcp://10.1.2.3:5557", bind=False, topic="t", max_blocks=1024,
                                         replay="tcp://10.1.2.3:5558")
    assert v6.kv_events == KVEventSource("tcp://[fc00::7]:5557", bind=False, topic="t", max_blocks=1024,
                                         replay="tcp://[fc00::7]:5558")
    discovery.sync(parse_policy("models: [{name: m, discovery: {kind: kubernetes, namespace: llm, service: vllm}}]"))
    assert [r.kv_events for r in replicas.by_model["m"]] == [None, None]  # the section gone: no events
    for bad in ("{}", "{port: 0}", "{port: 5557, replay_port: 5557}", "{port: 5557, bind: 'tcp://*:1'}"):
        with pytest.raises(PolicyError):
            discovered_policy(bad)


async def test_discovered_replicas_get_a_subscriber_each_keep_it_over_a_reload_and_lose_it_when_they_go():
    """Two pods (127.0.0.1 and 127.0.0.2 stand for their addresses), each a vLLM that binds its event port; the
    gateway connects to each. A reload keeps both subscriptions and indexes; a pod that goes is unsubscribed: its
    thread ends (its socket closed) and its index is dropped."""
    port = free_port()
    policy = discovered_policy(port=port)
    replicas = ReplicaSet({"m": []}, HealthTimings())
    fake = FakeSource()
    discovery = Discovery(replicas, source_factory=lambda config, access: fake)
    discovery.sync(policy)
    subs = Subscribers(lambda: list(replicas), interval=0.05)
    task = asyncio.create_task(subs.run())
    ctx = zmq.Context()
    pubs = {}
    for host in ("127.0.0.1", "127.0.0.2"):
        pubs[host] = ctx.socket(zmq.PUB)
        pubs[host].setsockopt(zmq.LINGER, 0)
        pubs[host].bind(f"tcp://{host}:{port}")  # as a pod's vLLM does with tcp://*:PORT
    try:
        fake.emit([Endpoint("127.0.0.1", 8000), Endpoint("127.0.0.2", 8000)])
        await wait_for(lambda: len(subs.running) == 2)
        one, two = replicas.by_model["m"]
        assert {s.source.endpoint for s in subs.running.values()} == {f"tcp://127.0.0.1:{port}",
                                                                       f"tcp://127.0.0.2:{port}"}
        for n, (host, replica) in enumerate(zip(pubs, (one, two))):
            seq = 0

            def seen(host=host, replica=replica, n=n) -> bool:  # PUB drops what it sends before the subscription
                nonlocal seq
                pubs[host].send_multipart(message(seq, stored([11 + n], PROMPT[n * BS:(n + 1) * BS])))
                seq += 1
                return replica.kv_index is not None and len(replica.kv_index) == 1

            await wait_for(seen)
        assert one.kv_index.matched(keys(PROMPT)) == 1 and two.kv_index.matched(keys(PROMPT)) == 0
        kept = dict(subs.running)
        indexes = (one.kv_index, two.kv_index)
        discovery.sync(policy)  # a reload that keeps both
        fake.emit([Endpoint("127.0.0.1", 8000), Endpoint("127.0.0.2", 8000)])  # and an event that lists them again
        await asyncio.sleep(0.2)  # (several sync rounds)
        assert subs.running == kept and (one.kv_index, two.kv_index) == indexes
        fake.emit([Endpoint("127.0.0.1", 8000)])  # the second pod goes
        await wait_for(lambda: len(subs.running) == 1)
        [gone] = [s for name, s in kept.items() if name not in subs.running]
        assert gone.replica is two and two.draining
        await asyncio.to_thread(gone.thread.join, 5)
        assert not gone.thread.is_alive() and two.kv_index is None
        assert one.kv_index is indexes[0]
        one.kv_index.blind_since = None
        one.state = DOWN  # its vLLM may be back with its cache or without: blind, and cleared
        await wait_for(lambda: one.kv_index.blind(60) and len(one.kv_index) == 0)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for pub in pubs.values():
            pub.close()
        ctx.term()
    assert subs.running == {} and subs.stopping == [] and subs.context is None


# --- the medium ------------------------------------------------------------------------------------------------


def test_a_block_removed_from_gpu_but_offloaded_stays_known_as_the_cpus():
    index = BlockIndex()
    index.feed(message(0, stored([1, 2, 3], PROMPT[:12])))
    index.feed(message(1, stored([2, 3], PROMPT[4:12], parent=1, medium="CPU")))  # offloaded (self-describing)
    index.feed(message(2, removed([2, 3])))  # evicted from the GPU
    assert index.matched(keys(PROMPT)) == 3
    assert [index.media(k) for k in keys(PROMPT)[:3]] == [["GPU"], ["CPU"], ["CPU"]]
    assert index.weighed(keys(PROMPT), 3, {"GPU": 1.0, "CPU": 0.5}.get) == 2.0
    index.feed(message(3, removed([3], medium="CPU")))
    assert index.matched(keys(PROMPT)) == 2
    index.feed(message(4, removed([1], medium="CPU")))  # not in the CPU: the GPU's stays
    assert index.matched(keys(PROMPT)) == 2


def test_offloaded_stores_without_tokens_copy_known_blocks_and_repeats_are_counted():
    """vLLM's offloading connector names an offloaded chunk by its hash alone (token_ids [], block_size 0) unless
    its events are self-describing, and overlapping chunks announce a hash more than once."""
    index = BlockIndex()
    index.feed(message(0, stored([1, 2], PROMPT[:8])))
    index.feed(message(1, stored([2, 99], [], medium="cpu", block_size=0)))  # 99: never seen, cannot be placed
    index.feed(message(2, stored([2], [], medium="CPU", block_size=0)))  # the same hash, announced again
    assert index.refused == 0 and len(index) == 3  # 1 and 2 in GPU memory, 2 in the CPU
    index.feed(message(3, removed([2])))  # from the GPU
    assert index.media(keys(PROMPT)[1]) == ["CPU"]
    index.feed(message(4, removed([2], medium="CPU")))  # one of its two announcements
    assert index.matched(keys(PROMPT)) == 2
    index.feed(message(5, removed([2], medium="CPU")))
    assert index.matched(keys(PROMPT)) == 1
    index.feed(message(6, *(stored([1], [], medium=m, block_size=0) for m in ("NVME", "M2", "M3", "M4"))))
    assert index.refused == 1  # (CPU, NVME, M2, M3:) a fifth medium besides GPU
    assert sorted(index.offloaded) == ["CPU", "M2", "M3", "NVME"]


def test_offloaded_copies_are_forgotten_first_past_the_bound():
    index = BlockIndex(max_blocks=16)
    index.feed(message(0, stored(list(range(1, 13)), list(range(48)))))
    index.feed(message(1, stored(list(range(1, 13)), [], medium="CPU", block_size=0)))
    assert len(index) == 16 and len(index.by_hash) == 12 and len(index.offloaded["CPU"].blocks) == 4
    assert index.matched(prefix_keys(list(range(48)), BS, 100)) == 12


def chat(user: str = "tell me about the sea") -> Call:
    return call_of(Request("r", "chat/completions", {}, "", 0.0), model="m",
                body={"messages": [{"role": "system", "content": "you are a helpful agent"},
                                   {"role": "user", "content": user}]})


def replica(name: str, index: BlockIndex | None = None, source: KVEventSource | None = None) -> Replica:
    r = Replica(name=name, model="m", url=f"http://127.0.0.1:1/{name}", served_name="m", kv_events=source)
    r.state, r.kv_index = UP, index
    return r


def blind_index() -> BlockIndex:
    """An index that may know less than its vLLM holds, as a fresh subscription's (BlockIndex(blind=True))."""
    index = BlockIndex()
    index.blind_since = time.monotonic()
    return index


def routed(user: str = "tell me about the sea") -> RoutingRequest:
    """What a pick of chat(user) hands its plugins, for the tests that call a scorer directly."""
    return chat(user).routing()


def tokens_of(directory, request: RoutingRequest) -> list[int]:
    tokens = load_prompt_tokenizer(str(directory)).tokens(request.endpoint, request.prompt.body)
    assert len(tokens) == 18  # 4 blocks
    return tokens


def test_blocks_held_only_in_cpu_memory_score_below_blocks_in_gpu_memory(tokenizer_dir):  # noqa: F811
    request = routed()
    tokens = tokens_of(tokenizer_dir, request)
    gpu, cpu = BlockIndex(), BlockIndex()
    gpu.feed(message(0, stored([1, 2], tokens[:8])))
    cpu.feed(message(0, stored([1, 2, 3], tokens[:12]), stored([1, 2, 3], [], medium="CPU", block_size=0),
                     removed([1, 2, 3])))  # all three offloaded, then evicted from the GPU
    a, b = replica("a", gpu), replica("b", cpu)
    note = Note()
    scorer = PrecisePrefix(Params(tokenizer=str(tokenizer_dir)))
    assert scorer.score(request, [a, b], Stats(), note) == [1.0, 0.0] and note.outcome == "hit"  # 2 GPU > 3 x 0.5
    one = BlockIndex()
    one.feed(message(0, stored([1], tokens[:4])))
    c = replica("c", one)  # 1 GPU block < 3 x 0.5: b's offloaded blocks count, below a's
    assert scorer.score(request, [a, b, c], Stats(), Note()) == [1.0, 0.5, 0.0]
    cheap_transfer = PrecisePrefix(Params(tokenizer=str(tokenizer_dir), medium_weights={"cpu": 0.9}))
    assert cheap_transfer.score(request, [a, b], Stats(), Note()) == [0.0, 1.0]  # 2 < 2.7
    assert PrecisePrefix(Params(tokenizer=str(tokenizer_dir), medium_weights={"CPU": 1.0})).score(
        request, [a, b], Stats(), Note()) == [0.0, 1.0]  # all alike: the longer prefix wins, as before media
    for bad in ({"CPU": 1.5}, {"bad medium": 0.5}, {f"M{i}": 0.5 for i in range(17)}):
        with pytest.raises(ValueError):
            Params(medium_weights=bad)


# --- the blind start -------------------------------------------------------------------------------------------


def test_an_index_is_blind_until_it_has_seen_its_vllms_cache_from_empty():
    index = BlockIndex(blind=True)  # a fresh subscription
    index.feed(message(7, stored([1], PROMPT[:4])))  # vLLM published 7 batches before: it may hold their blocks
    assert index.blind(60) and not index.blind(60, now=time.monotonic() + 61)  # the window ends
    index.feed(message(8, {"type": "AllBlocksCleared"}))  # its cache is empty: the index knows it all
    assert not index.blind(60)
    index.feed(message(10, stored([1], PROMPT[:4])))  # a gap: what was removed meanwhile is unknown
    assert index.blind(60)
    index.feed(message(0, stored([1], PROMPT[:4])))  # vLLM restarted and the index saw its first batch
    assert not index.blind(60)
    index.down("down")
    assert index.blind(60) and len(index) == 0
    fresh = BlockIndex(blind=True)
    fresh.feed(message(0, stored([1], PROMPT[:4])))  # subscribed before vLLM published anything
    assert not fresh.blind(60)


async def test_a_new_subscription_starts_blind():
    port = free_port()
    r = replica("a", source=KVEventSource(f"tcp://127.0.0.1:{port}", bind=True))
    subs = Subscribers(lambda: [r], interval=0.05)
    subs.sync()
    try:
        assert r.kv_index is not None and r.kv_index.blind(60)
        scorer = PrecisePrefix(Params(tokenizer="x"))
        assert scorer.blind(r, time.monotonic()) and not scorer.blind(replica("no-events"), time.monotonic())
        r.kv_index = None  # a replica with a source whose subscription has not started yet
        assert scorer.blind(r, time.monotonic())
        assert not PrecisePrefix(Params(blind_seconds=0)).blind(r, time.monotonic())
    finally:
        for name in list(subs.running):
            subs.stop(name)
        for sub in subs.stopping:
            await asyncio.to_thread(sub.thread.join, 5)
        subs.context.destroy(linger=0)


def test_a_blind_replica_ties_with_the_best_match_and_all_blind_leaves_it_to_load(tokenizer_dir):  # noqa: F811
    request = routed()
    tokens = tokens_of(tokenizer_dir, request)
    holds, empty, blind = BlockIndex(), BlockIndex(), blind_index()
    holds.feed(message(0, stored([1, 2, 3], tokens[:12])))
    a, b, c = replica("a", holds), replica("b", blind), replica("c", empty)
    scorer = PrecisePrefix(Params(tokenizer=str(tokenizer_dir)))
    note = Note()
    assert scorer.score(request, [a, b, c], Stats(), note) == [1.0, 1.0, 0.0] and note.outcome == "blind"
    b.in_flight = 1  # between the two that may hold it, load decides: the guard judges b as a
    assert scorer.score(request, [a, b], Stats(), Note()) == [1.0, 1.0]
    all_blind = [replica("x", blind_index()), replica("y", blind_index())]
    note = Note()
    assert scorer.score(request, all_blind, Stats(), note) == [0.0, 0.0] and note.outcome == "blind"
    blind.blind_since = time.monotonic() - 61  # the window is over: its index is taken as it is
    note = Note()
    assert scorer.score(request, [a, b, c], Stats(), note) == [1.0, 0.0, 0.0] and note.outcome == "hit"


def test_a_blind_index_neither_attracts_nor_repels_all_traffic(tokenizer_dir):  # noqa: F811
    """One seeing replica holds the system prompt; one blind replica may hold anything. With the match alone
    deciding (guard off), every request went to the seeing one; now the blind one gets its share by load."""
    tokens = tokens_of(tokenizer_dir, routed())
    holds = BlockIndex()
    holds.feed(message(0, stored([1, 2], tokens[:8])))  # the system prompt's two blocks
    seeing, blind = replica("seeing", holds), replica("blind", blind_index())
    precise = PrecisePrefix(Params(tokenizer=str(tokenizer_dir), guard=False))
    profile = Profile([(precise, 4.0), (SCORERS["least-in-flight"](), 1.0)])
    picked = {"seeing": 0, "blind": 0}
    for user in ("tell me about the sea", "tell me about the sky", "me tell about the sea", "about me tell the sea",
                 "tell about the sky me", "sky tell me about the") * 2:
        chosen = profile.pick(chat(user), [seeing, blind])
        chosen.in_flight += 1  # each request stays in flight: load builds up where they go
        picked[chosen.name] += 1
    assert picked == {"seeing": 6, "blind": 6}
