"""The KV block index fed with vLLM's event messages: stored, removed, cleared, gaps, restarts, bounds, and
hostile messages (oversized, malformed, unknown), plus a real ZMQ subscription and the precise-prefix scorer."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
import zmq

from backends.kv_events import BlockIndex, KVEventSource, Subscribers, prefix_keys
from backends.replicas import DOWN, UP, Replica
from backends.vllm_stats import VLLMStats
from policies.routing import Stats
from policies.routing.base import Note
from policies.routing.precise_prefix import PrecisePrefix, load_prompt_tokenizer
from policies.routing.precise_prefix import PrecisePrefixParams as Params
from policies.routing.request import Prompt, RoutingRequest

BS = 4


def stored(hashes, tokens, parent=None, block_size=BS, **extra):
    """As vLLM 0.32 encodes it (msgspec, tagged, defaults omitted; extra_keys one None per plain block)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [None] * len(hashes) if isinstance(hashes, list) else None, **extra}


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def message(seq, *events, topic=b"kv"):
    return [topic, seq.to_bytes(8, "big"), msgpack.packb([1733300000.0, list(events)])]


def keys(tokens):
    return prefix_keys(tokens, BS, 1000)


PROMPT = list(range(100, 112))  # three blocks of 4


def test_stored_blocks_match_a_prompt_by_content_and_chain():
    index = BlockIndex()
    index.feed(message(0, stored([11, 12], PROMPT[:8])))
    index.feed(message(1, stored([13], PROMPT[8:12], parent=12)))
    assert index.matched(keys(PROMPT)) == 3
    assert index.matched(keys(PROMPT[:4] + [1, 2, 3, 4] + PROMPT[8:])) == 1  # a block differs: the chain stops
    assert index.matched(keys(PROMPT[4:])) == 0  # the same tokens at another position are another prefix


def test_removed_blocks_cut_the_match_and_cleared_forgets_everything():
    index = BlockIndex()
    index.feed(message(0, stored([11, 12, 13], PROMPT)))
    index.feed(message(1, removed([13])))
    assert index.matched(keys(PROMPT)) == 2
    index.feed(message(2, removed([11])))
    assert index.matched(keys(PROMPT)) == 0  # vLLM evicted the first block: nothing of this prompt hits
    index.feed(message(3, stored([11], PROMPT[:4]), {"type": "AllBlocksCleared"}))
    assert len(index) == 0 and index.matched(keys(PROMPT)) == 0


def test_the_array_form_of_older_vllm_and_bytes_hashes_are_read():
    index = BlockIndex()
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    index.feed(message(0, ["BlockStored", [h1], None, PROMPT[:4], BS, None, "GPU"]))
    index.feed(message(1, ["BlockStored", [h2], h1, PROMPT[4:8], BS, None, "GPU"]))
    assert index.matched(keys(PROMPT)) == 2
    index.feed(message(2, ["BlockRemoved", [h2], "GPU"]))
    assert index.matched(keys(PROMPT)) == 1


def test_a_sequence_gap_or_a_restart_clears_the_index_which_refills_from_the_next_events():
    index = BlockIndex()
    index.feed(message(5, stored([11, 12, 13], PROMPT)))
    index.feed(message(7, stored([21], [9, 9, 9, 9])))  # 6 was lost: its removals are unknown
    assert index.gaps == 1 and index.matched(keys(PROMPT)) == 0
    assert index.matched(keys([9, 9, 9, 9])) == 1  # the batch after the gap is applied
    index.feed(message(0, stored([11], PROMPT[:4])))  # vLLM restarted: its sequence starts over
    assert index.matched(keys([9, 9, 9, 9])) == 0 and index.matched(keys(PROMPT)) == 1


def test_a_gap_is_filled_from_the_replay_buffer_in_order_and_clears_only_what_it_cannot_recover():
    lost = {1: message(1, stored([12], PROMPT[4:8], parent=11)), 2: message(2, stored([13], PROMPT[8:12], parent=12))}
    asked = []

    def replay(start, end):
        asked.append((start, end))
        return [lost[s] for s in range(start, end) if s in lost]

    index = BlockIndex(replay=replay)
    index.feed(message(0, stored([11], PROMPT[:4])))
    index.feed(message(3, removed([11])))  # 1 and 2 lost on the way: asked again, applied before 3
    assert asked == [(1, 3)] and index.replayed == 2 and index.gaps == 1 and index.clears == 0
    assert index.matched(keys(PROMPT)) == 0 and len(index) == 2  # 12 and 13 stored, then 11 removed
    del lost[2]  # vLLM's buffer no longer has one of them: the gap clears as without replay
    index.feed(message(4, stored([11], PROMPT[:4])))
    index.feed(message(7, stored([21], [9] * BS)))
    assert index.clears == 1 and index.matched(keys([9] * BS)) == 1 and len(index) == 1

    def broken(start, end):
        raise OSError("replay socket failed")

    index = BlockIndex(replay=broken)
    index.feed(message(0, stored([11], PROMPT[:4])))
    index.feed(message(2, stored([21], [9] * BS)))
    assert index.clears == 1 and len(index) == 1


def test_blocks_whose_parent_is_unknown_are_skipped():
    index = BlockIndex()
    index.feed(message(0, stored([13], PROMPT[8:12], parent=999)))
    assert len(index) == 0


def test_the_index_is_bounded_oldest_first():
    index = BlockIndex(max_blocks=16)
    for i in range(40):
        index.feed(message(i, stored([1000 + i], [i] * BS)))
    assert len(index) == 16 and len(index.keys) == 16
    assert index.matched(keys([39] * BS)) == 1 and index.matched(keys([0] * BS)) == 0


def test_the_same_content_under_two_hashes_stays_until_both_are_removed():
    index = BlockIndex()
    index.feed(message(0, stored([1], PROMPT[:4]), stored([2], PROMPT[:4])))
    index.feed(message(1, removed([1])))
    assert index.matched(keys(PROMPT)) == 1
    index.feed(message(2, removed([2])))
    assert index.matched(keys(PROMPT)) == 0


@pytest.mark.parametrize("frames", [
    [b"kv", (0).to_bytes(8, "big"), b"\xc1\xc1\xc1"],  # not msgpack
    [b"kv", (0).to_bytes(8, "big"), msgpack.packb({"a": 1})],  # not a batch
    [b"kv", (0).to_bytes(8, "big"), msgpack.packb([1.0, "x"])],
    [b"kv", b"\x00", msgpack.packb([1.0, []])],  # a sequence that is not 8 bytes
    [b"kv", msgpack.packb([1.0, []])],  # two frames
    [b"kv", (0).to_bytes(8, "big"), msgpack.packb([1.0, []])[:-1] + b"\xdd\xff\xff\xff\xff"],  # a huge array header
])
def test_malformed_and_oversized_messages_are_counted_never_raised(frames):
    index = BlockIndex(max_message_bytes=64 * 1024)
    index.feed(frames)
    assert index.refused >= 1 or index.last_seq is not None
    index.feed(message(1, stored([11], PROMPT[:4])))
    assert index.matched(keys(PROMPT)) == 1  # still serving


def test_an_oversized_message_is_refused_even_when_well_formed():
    index = BlockIndex(max_message_bytes=64 * 1024)
    tokens = list(range(1000, 1000 + BS)) * 5000  # 5,000 blocks: ~75 KB of valid msgpack
    index.feed(message(0, stored(list(range(5000)), tokens)))
    assert index.refused == 1 and len(index) == 0 and index.last_seq is None


@pytest.mark.parametrize("event", [
    {"type": "BlockMoved", "block_hashes": [1]},  # an unknown type
    "BlockStored", 42, None, [], {"no": "type"},
    stored([11, 12], PROMPT[:4]),  # tokens that do not fill its blocks
    stored([11], PROMPT[:4], block_size=0),
    stored([[1, 2]], PROMPT[:4]),  # an unhashable block hash
    stored([11], ["a", "b", "c", "d"]),
    {"type": "BlockRemoved", "block_hashes": "zz"},
])
def test_unknown_and_malformed_events_are_skipped(event):
    index = BlockIndex()
    index.feed(message(0, event, stored([21], PROMPT[:4])))
    assert index.refused == 1
    assert index.matched(keys(PROMPT)) == 1  # the good event of the same batch is applied


def test_lora_and_salted_blocks_are_not_indexed_for_plain_prompts():
    index = BlockIndex()
    index.feed(message(0, stored([11], PROMPT[:4], lora_name="ad"), stored([12], PROMPT[:4], extra_keys=[["s"]])))
    assert len(index) == 0 and index.refused == 0


def replica(name: str, source: KVEventSource | None = None) -> Replica:
    r = Replica(name=name, model="m", url=f"http://127.0.0.1:1/{name}", served_name="m", kv_events=source)
    r.state = UP
    return r


async def wait_for(predicate, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_subscribers_bind_receive_real_zmq_messages_and_clear_a_down_replica():
    port = _free_port()
    source = KVEventSource(f"tcp://127.0.0.1:{port}", bind=True)
    r = replica("a", source)
    subs = Subscribers(lambda: [r], interval=0.05)
    task = asyncio.create_task(subs.run())
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(source.endpoint)  # as vLLM does with a concrete address
    try:
        seq = 0

        def publish_until_seen() -> bool:  # PUB drops what it sends before the subscription has arrived
            nonlocal seq
            if seq and r.kv_index is not None and r.kv_index.last_seq == seq - 1:
                return True
            pub.send_multipart(message(seq, stored([11, 12, 13], PROMPT)))
            seq += 1
            return False

        await wait_for(publish_until_seen)
        assert r.kv_index.gaps == 0 and r.kv_index.matched(keys(PROMPT)) == 3
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), b"\x00" * (5 * 1024 * 1024)])  # over MAXMSGSIZE
        seq += 1
        await wait_for(publish_until_seen)  # ZMQ dropped that connection and reconnected
        assert r.kv_index.gaps == 1  # the message it refused is a gap: the index started over, and refilled
        assert r.kv_index.matched(keys(PROMPT)) == 3
        pub.send_multipart(message(seq, removed([13])))
        await wait_for(lambda: r.kv_index.matched(keys(PROMPT)) == 2)
        r.state = DOWN
        await wait_for(lambda: len(r.kv_index) == 0)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pub.close()
        ctx.term()
    assert subs.running == {} and subs.context is None


async def test_a_subscriber_asks_vllms_replay_endpoint_for_lost_events():
    """A ROUTER answering as vLLM's replay endpoint does: [id, b"", topic, seq, payload] per buffered batch from
    the asked sequence on, then [id, b"", b"", END_SEQ, b""]."""
    port, replay_port = _free_port(), _free_port()
    source = KVEventSource(f"tcp://127.0.0.1:{port}", bind=True, replay=f"tcp://127.0.0.1:{replay_port}")
    r = replica("a", source)
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for sock in (pub, router):
        sock.setsockopt(zmq.LINGER, 0)
    router.bind(source.replay)
    pub.connect(source.endpoint)
    buffer = {0: message(0, stored([11], PROMPT[:4])), 1: message(1, stored([12], PROMPT[4:8], parent=11)),
              2: message(2, stored([13], PROMPT[8:12], parent=12)), 3: message(3, removed([11]))}

    def serve_replay() -> None:
        if router.poll(0):
            client, _, start = router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), 4):
                router.send_multipart([client, b"", *buffer[seq]])
            router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    subs = Subscribers(lambda: [r], interval=0.05)
    task = asyncio.create_task(subs.run())
    try:
        def first_seen() -> bool:
            pub.send_multipart(buffer[0])
            return r.kv_index is not None and r.kv_index.last_seq == 0

        await wait_for(first_seen)
        pub.send_multipart(buffer[3])  # 1 and 2 never sent: lost
        await wait_for(lambda: (serve_replay(), r.kv_index.last_seq == 3)[1])
        # (a repeat of batch 0 may have cleared and refilled the index before: the last one restores block 11)
        assert r.kv_index.replayed == 2 and r.kv_index.gaps == 1
        assert r.kv_index.matched(keys(PROMPT)) == 0 and len(r.kv_index) == 2  # 12 and 13 from 1 and 2; 11 gone
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pub.close()
        router.close()
        ctx.term()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A real (small) tokenizer.json and a ChatML chat template, made with the tokenizers library."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "<|im_start|> <|im_end|> system user assistant you are a helpful agent tell me about the sea sky".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="the"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    return d


def chat(system: str, user: str) -> RoutingRequest:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    return RoutingRequest("m", "chat/completions", {}, None, Prompt(body))


def test_the_scorer_prefers_the_replica_holding_the_longest_prefix_and_sees_evictions(tokenizer_dir):
    scorer = PrecisePrefix(Params(tokenizer=str(tokenizer_dir)))
    a, b = replica("a"), replica("b")
    a.kv_index, b.kv_index = BlockIndex(), BlockIndex()
    request = chat("you are a helpful agent", "tell me about the sea")
    tokens = load_prompt_tokenizer(str(tokenizer_dir)).tokens(request.endpoint, request.prompt.body)
    assert len(tokens) == 18  # 4 blocks
    a.kv_index.feed(message(0, stored([1], tokens[:4])))
    b.kv_index.feed(message(0, stored([1, 2, 3], tokens[:12])))
    note = Note()
    assert scorer.score(request, [a, b], Stats(), note) == [0.0, 1.0] and note.outcome == "hit"  # beyond what both hold
    b.kv_index.feed(message(1, removed([1])))  # evicted on b: a now holds the longer prefix
    assert scorer.score(request, [a, b], Stats(), Note()) == [1.0, 0.0]
    other = chat("you are a helpful agent", "tell me about the sky")
    assert scorer.score(other, [a, b], Stats(), Note()) == [1.0, 0.0]  # the shared system prompt's block
    a.kv_index.feed(message(1, {"type": "AllBlocksCleared"}))
    note = Note()
    assert scorer.score(request, [a, b], Stats(), note) == [0.0, 0.0] and note.outcome == "miss"


def test_the_scorer_without_events_or_tokenizer_leaves_it_to_load(tokenizer_dir, tmp_path):
    request = chat("you are a helpful agent", "tell me about the sea")
    a, b = replica("a"), replica("b")
    assert PrecisePrefix(Params(tokenizer=str(tokenizer_dir))).score(request, [a, b], Stats(), Note()) == [0.0, 0.0]
    a.kv_index = BlockIndex()
    a.kv_index.feed(message(0, stored([1], [0, 2, 5, 6])))
    missing = PrecisePrefix(Params(tokenizer=str(tmp_path / "nothing")))
    note = Note()
    assert missing.score(request, [a, b], Stats(), note) == [0.0, 0.0] and note.outcome == "no_prompt"


def test_the_load_guard_moves_a_held_prefix_off_a_loaded_replica(tokenizer_dir):
    scorer = PrecisePrefix(Params(tokenizer=str(tokenizer_dir), imbalance=2))
    a, b = replica("a"), replica("b")
    a.kv_index, b.kv_index = BlockIndex(), BlockIndex()
    request = chat("you are a helpful agent", "tell me about the sea")
    tokens = load_prompt_tokenizer(str(tokenizer_dir)).tokens(request.endpoint, request.prompt.body)
    a.kv_index.feed(message(0, stored([1, 2], tokens[:8])))
    a.in_flight = 3
    note = Note()
    assert scorer.score(request, [a, b], Stats(), note) == [0.0, 1.0] and note.outcome == "load_guard"


def test_the_index_tells_a_prefix_continued_in_more_than_one_way():
    index = BlockIndex()
    other = PROMPT[:4] + [7, 7, 7, 7]
    index.feed(message(0, stored([1, 2, 3], PROMPT)))
    assert not any(index.shared(k) for k in keys(PROMPT))
    index.feed(message(1, stored([4], other[4:], parent=1)))  # a second continuation of the first block
    assert index.shared(keys(PROMPT)[0]) and not index.shared(keys(PROMPT)[1])
    index.feed(message(2, removed([4])))
    assert not index.shared(keys(PROMPT)[0])
    index.feed(message(3, stored([4], other[4:], parent=1)))
    assert index.shared(keys(PROMPT)[0])
    index.feed(message(4, {"type": "AllBlocksCleared"}))
    assert not index.shared(keys(PROMPT)[0]) and not index.continued


def test_the_shared_load_guard_reads_the_events_and_vllms_queue(tokenizer_dir):
    """prefix-affinity's guard: a prefix the events show continued two ways goes by load; a conversation's own
    history stays on its replica however uneven the load, unless that replica queues."""
    tokenize = load_prompt_tokenizer(str(tokenizer_dir)).tokens
    x, y, z = (chat("you are a helpful agent", u) for u in
               ("tell me about the sea", "me tell about the sea", "about me tell the sea"))
    tx, ty = (tokenize(c.endpoint, c.prompt.body) for c in (x, y))
    assert tx[:8] == ty[:8] and tx[8:12] != ty[8:12]  # the system prompt's two blocks, then their own
    a, b = replica("a"), replica("b")
    a.kv_index, b.kv_index = BlockIndex(), BlockIndex()
    a.kv_index.feed(message(0, stored([1, 2, 3], tx[:12])))
    a.in_flight = 1
    scorer = PrecisePrefix(Params(tokenizer=str(tokenizer_dir)))
    note = Note()
    assert scorer.score(z, [a, b], Stats(), note) == [1.0, 0.0] and note.outcome == "hit"  # one continuation
    a.kv_index.feed(message(1, stored([4], ty[8:12], parent=2)))
    note = Note()
    assert scorer.score(z, [a, b], Stats(), note) == [0.0, 1.0] and note.outcome == "guard_shared"
    note = Note()
    assert scorer.score(x, [a, b], Stats(), note) == [1.0, 0.0] and note.outcome == "hit"  # its own history
    unguarded = PrecisePrefix(Params(tokenizer=str(tokenizer_dir), guard=False))
    note = Note()
    assert unguarded.score(z, [a, b], Stats(), note) == [1.0, 0.0] and note.outcome == "hit"
    seen = {"a": VLLMStats(running=4, waiting=3), "b": VLLMStats(running=1, waiting=0)}
    note = Note()
    scores = scorer.score(x, [a, b], Stats(lambda r: seen[r.name]), note)
    assert note.outcome == "guard_queue" and scores[1] == 1.0 and scores[0] < 1.0


def test_the_policy_gives_a_backend_its_event_source():
    from pydantic import ValidationError

    from policies.compile import replicas_of
    from policies.config import Model

    model = Model.model_validate({"name": "m", "backends": [
        {"url": "http://127.0.0.1:8000", "kv_events": {"bind": "tcp://127.0.0.1:5557"}},
        {"url": "http://127.0.0.1:8001", "kv_events": {"connect": "tcp://10.0.0.2:5557", "max_blocks": 1024,
                                                        "replay": "tcp://10.0.0.2:5558"}},
        {"url": "http://127.0.0.1:8002"},
    ]})
    a, b, c = replicas_of(model)
    assert a.kv_events == KVEventSource("tcp://127.0.0.1:5557", bind=True)
    assert b.kv_events == KVEventSource("tcp://10.0.0.2:5557", bind=False, max_blocks=1024,
                                        replay="tcp://10.0.0.2:5558")
    assert c.kv_events is None
    for bad in ({}, {"bind": "tcp://127.0.0.1:1", "connect": "tcp://127.0.0.1:2"}, {"bind": "ipc:///tmp/x"},
                {"connect": "tcp://h:1; rm"}):
        with pytest.raises(ValidationError):
            Model.model_validate({"name": "m", "backends": [{"url": "http://127.0.0.1:8000", "kv_events": bad}]})
