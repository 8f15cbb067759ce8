import json
import random
from pathlib import Path

import orjson
import pytest

from backends.http1 import TooLarge
from gateway.relay import EventRelay, SSERelay, model_rename

SAMPLES = Path(__file__).resolve().parents[1] / "fixtures/vllm-0.32-cpu"
CHAT = (SAMPLES / "chat_stream.sse").read_bytes()
COMPLETIONS = (SAMPLES / "completions_stream.sse").read_bytes()


def events(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e.strip()]


def run(relay: SSERelay, data: bytes, rng: random.Random) -> bytes:
    out, i = [], 0
    while i < len(data):
        step = rng.randint(1, 200)
        out.append(relay.feed(data[i : i + step]))
        i += step
    out.append(relay.flush())
    return b"".join(out)


@pytest.mark.parametrize("sample", [CHAT, COMPLETIONS], ids=["chat", "completions"])
@pytest.mark.parametrize("seed", range(5))
def test_strips_usage_chunk_but_records_it(sample, seed):
    relay = SSERelay(strip_usage=True)
    out = run(relay, sample, random.Random(seed))
    usage_events = [e for e in events(sample) if b'"choices":[]' in e]
    assert len(usage_events) == 1
    assert events(out) == [e for e in events(sample) if e not in usage_events]
    assert relay.usage == orjson.loads(usage_events[0][6:])["usage"]
    assert events(out)[-1] == b"data: [DONE]"


@pytest.mark.parametrize("seed", range(3))
def test_keeps_stream_byte_identical_when_usage_wanted(seed):
    relay = SSERelay(strip_usage=False)
    assert run(relay, CHAT, random.Random(seed)) == CHAT
    assert relay.usage["completion_tokens"] == 8


def test_output_only_at_event_boundaries():
    relay = SSERelay(strip_usage=False)
    first = CHAT.index(b"\n\n") + 2
    assert relay.feed(CHAT[: first - 1]) == b""
    assert relay.feed(CHAT[first - 1 : first + 5]) == CHAT[:first]


def test_rename_rewrites_model_field_in_every_chunk():
    relay = SSERelay(strip_usage=False, rename=model_rename("tiny", "public/Model-1"))
    out = relay.feed(CHAT) + relay.flush()
    assert b'"model":"tiny"' not in out
    assert out.count(b'"model":"public/Model-1"') == CHAT.count(b'"model":"tiny"')
    assert model_rename("same", "same") is None


@pytest.mark.parametrize("strip", [True, False])
def test_whole_stream_in_one_chunk(strip):
    relay = SSERelay(strip_usage=strip)
    out = relay.feed(CHAT) + relay.flush()
    expected = [e for e in events(CHAT) if not (strip and b'"choices":[]' in e)]
    assert events(out) == expected and relay.usage["completion_tokens"] == 8


@pytest.mark.parametrize("seed", range(3))
def test_events_are_counted_while_no_usage_came(seed):
    cut = CHAT.index(b'"choices":[]')
    cut = CHAT.rindex(b"\n\n", 0, cut) + 2  # the stream as it was before the usage event: ended early
    relay = SSERelay(strip_usage=True)
    run(relay, CHAT[:cut], random.Random(seed))
    assert relay.usage is None and relay.events == len(events(CHAT[:cut]))


USAGE = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}


@pytest.mark.parametrize("write", [
    lambda d: orjson.dumps(d),
    lambda d: json.dumps(d).encode(),  # "usage": {  and  "choices": []
    lambda d: json.dumps({"usage": d["usage"] and {"vendor": {"x": 1}, **d["usage"]}, **d}, indent=None,
                         separators=(" , ", " :  ")).encode(),  # usage first, an unknown field, odd spacing
], ids=["compact", "json.dumps", "odd"])
@pytest.mark.parametrize("seed", range(3))
def test_usage_is_read_as_json_whatever_its_formatting(write, seed):
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}],
             "usage": None}
    stream = (b"data: " + write(chunk) + b"\n\n") * 3 + b"data:" + write({**chunk, "choices": [], "usage": USAGE}) \
        + b"\n\ndata: [DONE]\n\n"
    relay = SSERelay(strip_usage=True)
    out = run(relay, stream, random.Random(seed))
    assert {k: relay.usage[k] for k in USAGE} == USAGE
    assert events(out) == events(stream)[:3] + [b"data: [DONE]"]  # the usage event cut, the rest untouched


def test_event_frames_read_usage_without_the_space_and_one_event_is_bounded():
    relay = EventRelay({b"response.completed": lambda d: d["response"]["usage"]})
    frame = b"event:response.completed\ndata:" + json.dumps({"response": {"usage": USAGE}}).encode() + b"\n\n"
    assert relay.feed(frame) == frame and relay.usage == USAGE

    relay = SSERelay(strip_usage=False)
    relay.max_event = 1000
    assert relay.feed(b"data: {}\n\n" + b"x" * 900) == b"data: {}\n\n"
    with pytest.raises(TooLarge, match="upstream.max_event_bytes of 1000"):
        relay.feed(b"x" * 200)
    assert relay.pending == b""


@pytest.mark.parametrize("seed", range(5))
def test_crlf_framing_is_cut_into_events_and_its_usage_metered(seed):
    """SSE allows CRLF line ends: a provider that uses them is streamed event by event and metered, not held to
    the end (or to the event bound) with its usage unseen."""
    crlf = CHAT.replace(b"\n", b"\r\n")
    relay = SSERelay(strip_usage=True)
    out = run(relay, crlf, random.Random(seed))  # chunks of 1-200 bytes: many split a \r from its \n
    assert relay.usage["completion_tokens"] == 8
    assert events(out) == [e for e in events(CHAT) if b'"choices":[]' not in e]
    relay = SSERelay(strip_usage=False)
    first = crlf.index(b"\r\n\r\n") + 4
    assert relay.feed(crlf[:first]) == CHAT[: CHAT.index(b"\n\n") + 2]  # the first event goes on at once


def usage_stream(usages: list[dict]) -> bytes:
    """A chat stream whose every chunk but the last two carries one of `usages` (OpenAI's `null` where None)."""
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    return b"".join(b"data: " + orjson.dumps({**chunk, "usage": u}) + b"\n\n" for u in usages) + \
        b'data: {"id":"c","choices":[{"index":0,"delta":{}}]}\n\ndata: [DONE]\n\n'


def relayed_usage(stream: bytes, cuts: list[int]) -> dict | None:
    relay = SSERelay(strip_usage=False)
    at = 0
    for cut in [*cuts, len(stream)]:
        relay.feed(stream[at:cut])
        at = cut
    relay.flush()
    return relay.usage


@pytest.mark.parametrize("seed", range(40))
def test_usage_is_the_same_however_the_stream_is_cut_into_reads(seed):
    rng = random.Random(seed)
    shapes = [None, {"prompt_tokens": 300}, {"completion_tokens": 40}, {"prompt_tokens": 0, "completion_tokens": 7},
              {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
              {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}, {"total_tokens": 50}, {}]
    stream = usage_stream([rng.choice(shapes) for _ in range(rng.randint(1, 8))])
    whole = relayed_usage(stream, [])  # one read: searched from its end, down to its last total only
    by_event = relayed_usage(stream, [i + 2 for i in range(len(stream)) if stream.startswith(b"\n\n", i)][:-1])
    by_bytes = relayed_usage(stream, sorted(rng.sample(range(1, len(stream)), min(12, len(stream) - 1))))
    assert whole == by_event == by_bytes


def test_a_total_stands_for_the_usage_before_it_and_separate_counts_are_all_kept():
    separate = usage_stream([{"prompt_tokens": 300}, None, {"completion_tokens": 40, "total_tokens": 340}])
    repeated = usage_stream([{"prompt_tokens": 300, "completion_tokens": n} for n in (0, 10, 40, 40)])
    anthropic_like = usage_stream([{"prompt_tokens": 300, "completion_tokens": 1}, {"completion_tokens": 40}])
    for stream in (separate, repeated, anthropic_like):
        usage = relayed_usage(stream, [])
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (300, 40)
