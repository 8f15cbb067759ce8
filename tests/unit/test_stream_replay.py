"""gateway/stream_replay.py: a Messages stream asked again of another replica, cut by what the client has."""

from __future__ import annotations

import orjson
import pytest

from gateway.endpoints import chat, messages
from gateway.migration import ErrorEvent
from gateway.stream_replay import Replay, unfaithful, watch

BODY = {"model": "m", "max_tokens": 20, "stream": True, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}


def frame(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def start(mid: str = "msg-1", prompt: int = 9) -> bytes:
    return frame("message_start", {"message": {"id": mid, "type": "message", "role": "assistant", "content": [],
                                               "usage": {"input_tokens": prompt, "output_tokens": 0}}})


def block() -> bytes:
    return frame("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})


def text(t: str) -> bytes:
    return frame("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": t}})


def end(output: int) -> bytes:
    return (frame("content_block_stop", {"index": 0})
            + frame("message_delta", {"delta": {"stop_reason": "max_tokens"},
                                      "usage": {"input_tokens": 9, "output_tokens": output}})
            + frame("message_stop", {}))


def kinds_and_texts(raw: bytes) -> list[tuple[str, str | None]]:
    out = []
    for part in raw.split(b"\n\n"):
        if b"data: " in part:
            data = orjson.loads(part.split(b"data: ", 1)[1])
            out.append((data["type"], (data.get("delta") or {}).get("text")))
    return out


def replay() -> Replay:
    moving = watch(messages.MESSAGES, BODY, 1)
    assert moving is not None and moving.refused is None
    return moving


def test_the_replay_is_cut_where_the_client_text_ends_and_goes_on_from_there():
    moving = replay()
    moving.feed(start() + block() + text("Once") + text(" upon"))
    assert moving.may_move() and moving.continuation(BODY) == BODY
    moving.moved({"prompt_tokens": 9})
    out = moving.feed(start("msg-2") + block() + text("Once") + text(" up") + text("on a") + text(" time") + end(4))
    # no second start, the made-again text skipped (a delta cut where it straddles the client's end)
    assert kinds_and_texts(out) == [("content_block_delta", " a"), ("content_block_delta", " time"),
                                    ("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    usage = orjson.loads(out.split(b"event: message_delta\ndata: ")[1].split(b"\n\n")[0])["usage"]
    assert usage == {"input_tokens": 18, "output_tokens": 6}  # both prompts; the first's 2 tokens and the replay's 4
    assert moving.summed({"prompt_tokens": 9, "completion_tokens": 4}) == \
        {"prompt_tokens": 18, "completion_tokens": 6, "total_tokens": 24}


def test_a_replay_that_says_other_text_ends_the_stream_with_an_error_frame_and_nothing_after():
    moving = replay()
    moving.feed(start() + block() + text("Once"))
    moving.moved(None)
    out = moving.feed(start() + block() + text("Twice") + text(" more"))
    assert [k for k, _ in kinds_and_texts(out)] == ["error"]
    assert moving.feed(text(" and more") + end(3)) == b""  # what the replica still sends goes nowhere
    assert moving.refused is not None and not moving.may_move()


def test_a_block_end_the_client_had_is_not_sent_twice():
    moving = replay()
    moving.feed(start() + block() + text("All") + frame("content_block_stop", {"index": 0}))
    moving.moved(None)
    out = moving.feed(start() + block() + text("All") + end(1))
    assert [k for k, _ in kinds_and_texts(out)] == ["message_delta", "message_stop"]


def test_an_error_frame_mid_body_is_raised_with_what_came_before_it():
    moving = replay()
    before = start() + block() + text("a")
    error = frame("error", {"error": {"type": "api_error", "message": "engine dead"}})
    with pytest.raises(ErrorEvent) as info:
        moving.feed(before + error)
    assert info.value.passed == before and info.value.rest == error


@pytest.mark.parametrize("extra, why", [
    ({"temperature": 0.7}, "temperature"), ({"temperature": None}, "temperature"),
    ({"tools": [{"name": "f", "input_schema": {}}]}, "tools"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": "auto"}, "tools"),  # not Anthropic's shape
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking")])
def test_requests_that_would_not_replay_to_the_same_text_are_refused(extra, why):
    assert unfaithful({**BODY, **extra}) == why
    moving = watch(messages.MESSAGES, {**BODY, **extra}, 1)
    assert moving is not None and not moving.may_move()


def test_a_tool_call_already_relayed_stops_a_move():
    moving = replay()
    moving.feed(start() + frame("content_block_start", {"index": 0, "content_block": {"type": "tool_use", "id": "t",
                                                                                      "name": "f", "input": {}}}))
    assert not moving.may_move()


def test_only_messages_streams_are_replayed_and_only_with_migrations_allowed():
    assert watch(chat.ROUTE, BODY, 1) is None
    assert watch(messages.MESSAGES, BODY, 0) is None
    assert unfaithful({**BODY, "top_k": 1, "temperature": 1.0}) is None  # greedy either way
    assert unfaithful({**BODY, "tools": [{"name": "f"}], "tool_choice": {"type": "none"}}) is None


def test_the_usage_the_client_reads_is_the_records_when_the_failed_attempt_never_said_its_prompt():
    moving = replay()
    moving.feed(block() + text("Once"))  # no message_start came before the replica failed: its prompt unsaid
    moving.moved(None)
    out = moving.feed(start("msg-2") + block() + text("Once") + text(" more") + end(2))
    usage = orjson.loads(out.split(b"event: message_delta\ndata: ")[1].split(b"\n\n")[0])["usage"]
    record = moving.summed({"prompt_tokens": 9, "completion_tokens": 2})
    assert (usage["input_tokens"], usage["output_tokens"]) == (record["prompt_tokens"], record["completion_tokens"])
    assert usage == {"input_tokens": 18, "output_tokens": 3}  # the replay's prompt for the failed attempt's too
