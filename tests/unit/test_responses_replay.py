"""gateway/responses_replay.py: a Responses stream asked again of another replica, cut by what the client has,
under the client's response id, item ids and sequence numbers."""

from __future__ import annotations

import orjson
import pytest

from gateway.endpoints import chat, messages, responses
from gateway.migration import ErrorEvent
from gateway.responses_replay import ResponsesReplay, unfaithful, watch

BODY = {"model": "m", "input": "hi", "max_output_tokens": 20, "stream": True, "temperature": 0}


class Stream:
    """One replica's frames, as vLLM streams them: its own response and item ids, its own sequence numbers."""

    def __init__(self, response_id: str, item_id: str) -> None:
        self.response_id, self.item_id, self.sequence = response_id, item_id, -1

    def frame(self, kind: str, data: dict) -> bytes:
        self.sequence += 1
        body = {"type": kind, "sequence_number": self.sequence, **data}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def response(self, status: str, usage: dict | None = None, text: str = "") -> dict:
        output = [{"id": self.item_id, "type": "message", "role": "assistant", "status": status,
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}] if text else []
        return {"id": self.response_id, "object": "response", "status": status, "output": output, "usage": usage}

    def head(self) -> bytes:
        item = {"id": self.item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return (self.frame("response.created", {"response": self.response("in_progress")})
                + self.frame("response.in_progress", {"response": self.response("in_progress")})
                + self.frame("response.output_item.added", {"output_index": 0, "item": item})
                + self.frame("response.content_part.added", {"output_index": 0, "content_index": 0,
                                                             "item_id": self.item_id,
                                                             "part": {"type": "output_text", "text": ""}}))

    def text(self, delta: str) -> bytes:
        return self.frame("response.output_text.delta", {"output_index": 0, "content_index": 0,
                                                         "item_id": self.item_id, "delta": delta})

    def end(self, text: str, prompt: int, output: int) -> bytes:
        usage = {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output}
        item = {"id": self.item_id, "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}
        return (self.frame("response.output_text.done", {"output_index": 0, "content_index": 0,
                                                         "item_id": self.item_id, "text": text})
                + self.frame("response.content_part.done", {"output_index": 0, "content_index": 0,
                                                            "item_id": self.item_id,
                                                            "part": {"type": "output_text", "text": text}})
                + self.frame("response.output_item.done", {"output_index": 0, "item": item})
                + self.frame("response.completed", {"response": self.response("completed", usage, text)}))


def parsed(raw: bytes) -> list[dict]:
    return [orjson.loads(part.split(b"data: ", 1)[1]) for part in raw.split(b"\n\n") if b"data: " in part]


def replay() -> ResponsesReplay:
    moving = watch(responses.CREATE, BODY, 1)
    assert moving is not None and moving.refused is None
    return moving


def test_the_replay_goes_on_where_the_client_text_ends_under_the_first_ids_and_sequence():
    moving = replay()
    first, second = Stream("resp_a", "msg_a"), Stream("resp_b", "msg_b")
    relayed = first.head() + first.text("Once") + first.text(" upon")
    assert moving.feed(relayed) == relayed  # the first attempt goes on as it came
    assert moving.may_move() and moving.continuation(BODY) == BODY
    moving.moved(None)  # a Responses stream says its usage only at its end
    out = parsed(moving.feed(second.head() + second.text("Once") + second.text(" up") + second.text("on a")
                             + second.text(" time") + second.end("Once upon a time", 9, 4)))
    assert [f["type"] for f in out] == ["response.output_text.delta", "response.output_text.delta",
                                        "response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.completed"]
    assert [f["delta"] for f in out[:2]] == [" a", " time"]  # made again: skipped, a delta cut where it straddles
    assert [f["sequence_number"] for f in out] == list(range(6, 12))  # one after the 0-5 the client read
    assert {f.get("item_id") for f in out[:4]} == {"msg_a"} and out[4]["item"]["id"] == "msg_a"
    final = out[-1]["response"]
    assert final["id"] == "resp_a" and final["output"][0]["id"] == "msg_a"
    assert final["output"][0]["content"][0]["text"] == "Once upon a time"
    # the failed attempt's prompt is the replay's (the same request), its 2 deltas its output
    assert final["usage"] == {"input_tokens": 18, "output_tokens": 6, "total_tokens": 24}
    assert moving.summed({"prompt_tokens": 9, "completion_tokens": 4}) == \
        {"prompt_tokens": 18, "completion_tokens": 6, "total_tokens": 24}


def test_a_replay_that_says_other_text_ends_the_stream_with_an_error_frame_and_nothing_after():
    moving = replay()
    first, second = Stream("resp_a", "msg_a"), Stream("resp_b", "msg_b")
    moving.feed(first.head() + first.text("Once"))
    moving.moved(None)
    out = parsed(moving.feed(second.head() + second.text("Twice") + second.text(" more")))
    assert [f["type"] for f in out] == ["error"] and out[0]["sequence_number"] == 5
    assert moving.feed(second.text(" and more") + second.end("Twice and more", 9, 3)) == b""
    assert moving.refused is not None and not moving.may_move()


def test_frames_the_client_had_are_not_sent_twice():
    moving = replay()
    first, second = Stream("resp_a", "msg_a"), Stream("resp_b", "msg_b")
    moving.feed(first.head() + first.text("All") + first.end("All", 9, 1)[:-1].rsplit(b"\n\n", 2)[0] + b"\n\n")
    moving.moved(None)
    out = parsed(moving.feed(second.head() + second.text("All") + second.end("All", 9, 1)))
    assert [f["type"] for f in out] == ["response.output_item.done", "response.completed"]


def test_an_error_frame_mid_body_is_raised_with_what_came_before_it():
    moving = replay()
    first = Stream("resp_a", "msg_a")
    before = first.head() + first.text("a")
    error = first.frame("error", {"code": "server_error", "message": "engine dead"})
    with pytest.raises(ErrorEvent) as info:
        moving.feed(before + error)
    assert info.value.passed == before and info.value.rest == error


@pytest.mark.parametrize("extra, why", [
    ({"temperature": 0.7}, "temperature"), ({"temperature": None}, "temperature"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"), ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"previous_response_id": "resp_x"}, "previous_response_id"), ({"background": True}, "background"),
    ({"top_logprobs": 2}, "logprobs"), ({"include": ["message.output_text.logprobs"]}, "logprobs")])
def test_requests_that_would_not_replay_to_the_same_text_are_refused(extra, why):
    assert unfaithful({**BODY, **extra}) == why
    moving = watch(responses.CREATE, {**BODY, **extra}, 1)
    assert moving is not None and not moving.may_move()


def test_a_function_call_already_relayed_stops_a_move():
    moving = replay()
    first = Stream("resp_a", "fc_a")
    moving.feed(first.frame("response.created", {"response": first.response("in_progress")})
                + first.frame("response.output_item.added", {"output_index": 0, "item": {
                    "id": "fc_a", "type": "function_call", "name": "f", "arguments": "", "call_id": "c"}}))
    assert not moving.may_move()


def test_only_responses_streams_are_replayed_and_only_with_migrations_allowed():
    assert watch(chat.ROUTE, BODY, 1) is None and watch(messages.MESSAGES, BODY, 1) is None
    assert watch(responses.RETRIEVE, BODY, 1) is None
    assert watch(responses.CREATE, BODY, 0) is None
    assert unfaithful({**BODY, "top_k": 1, "temperature": 1.0}) is None  # greedy either way
    assert unfaithful({**BODY, "tools": [{"type": "function", "name": "f"}], "tool_choice": "none"}) is None
