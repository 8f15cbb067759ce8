"""gateway/migration.py: what a stream relayed so far, the request that continues it on another replica, and the
continuation's chunks under the first attempt's id."""

from __future__ import annotations

import orjson
import pytest

from gateway.endpoints import chat, completions, embeddings, messages, responses
from gateway.migration import ErrorEvent, Migration, unfaithful, watch


def sse(*objs: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objs)


def events(raw: bytes) -> list[dict]:
    return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


def chat_chunk(text: str | None = None, role: bool = False, finish: str | None = None, cid: str = "chatcmpl-1",
               model: str = "m", created: int = 100) -> dict:
    delta: dict = {"role": "assistant", "content": ""} if role else {"content": text}
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def cmpl_chunk(text: str, cid: str = "cmpl-1", created: int = 100, model: str = "m") -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}


def chat_stream(body: dict, allowed: int = 1) -> Migration:
    moving = watch(chat.ROUTE, body, allowed)
    assert moving is not None
    return moving


CHAT = {"model": "m", "stream": True, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_continuation_carries_the_text_as_a_partial_assistant_message_and_the_rest_of_the_budget():
    moving = chat_stream({**CHAT, "max_completion_tokens": 12, "min_tokens": 5})
    relayed = sse(chat_chunk(role=True), chat_chunk("Hello"), chat_chunk(" wor"), chat_chunk("ld"))
    assert moving.feed(relayed) == relayed  # the first attempt's events go on untouched
    body = moving.continuation({**CHAT, "max_completion_tokens": 12, "min_tokens": 5})
    assert body is not None
    assert body["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello world"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["max_completion_tokens"], body["min_tokens"]) == (7, 9, 2)
    assert CHAT["messages"] == [{"role": "user", "content": "hi"}]  # the client's body is not touched


def test_a_chat_that_continued_an_assistant_message_already_extends_it():
    body = {**CHAT, "continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]}
    moving = chat_stream(body)
    moving.feed(sse(chat_chunk(" upon"), chat_chunk(" a")))
    continued = moving.continuation(body)
    assert continued is not None
    assert continued["messages"][-1] == {"role": "assistant", "content": "Once upon a"}
    assert len(continued["messages"]) == 2


def test_a_completion_continuation_appends_the_text_to_its_prompt():
    body = {"model": "m", "prompt": ["Once"], "max_tokens": 4, "stream": True}
    moving = watch(completions.ROUTE, body, 1)
    assert moving is not None
    moving.feed(sse(cmpl_chunk(" upon"), cmpl_chunk(" a")))
    continued = moving.continuation(body)
    assert continued is not None
    assert continued["prompt"] == "Once upon a" and continued["max_tokens"] == 2


def test_nothing_is_continued_once_the_budget_is_spent():
    body = {"model": "m", "prompt": "Once", "max_tokens": 2, "stream": True}
    moving = watch(completions.ROUTE, body, 1)
    assert moving is not None
    moving.feed(sse(cmpl_chunk(" upon"), cmpl_chunk(" a")))
    assert moving.continuation(body) is None


def test_the_continuation_takes_the_first_attempts_id_created_and_model_and_drops_its_role_chunk():
    moving = chat_stream(CHAT)
    moving.feed(sse(chat_chunk(role=True, cid="chatcmpl-first", created=7, model="public"),
                    chat_chunk("Hel", cid="chatcmpl-first", created=7, model="public")))
    moving.moved(None)
    out = events(moving.feed(sse(chat_chunk(role=True, cid="chatcmpl-second", created=9, model="other"),
                                 chat_chunk("lo", cid="chatcmpl-second", created=9, model="other"),
                                 chat_chunk("", finish="length", cid="chatcmpl-second", created=9))))
    assert [(e["id"], e["created"], e["model"]) for e in out] == [("chatcmpl-first", 7, "public")] * 2
    assert [e["choices"][0]["delta"]["content"] for e in out] == ["lo", ""]  # no second role chunk
    assert out[-1]["choices"][0]["finish_reason"] == "length"
    assert moving.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_usage_sums_what_both_replicas_computed():
    moving = chat_stream(CHAT)
    moving.feed(sse(chat_chunk(role=True), chat_chunk("a"), chat_chunk(" b"), chat_chunk(" c")))
    moving.moved(None)  # the first broke before its usage chunk: 3 tokens out, its prompt as yet unknown
    usage_event = {**chat_chunk(cid="x"), "choices": [],
                   "usage": {"prompt_tokens": 23, "completion_tokens": 5, "total_tokens": 28}}
    out = events(moving.feed(sse(usage_event)))
    # the continuation's prompt (23) is the first's (20) plus the 3 tokens it made
    assert out[0]["usage"] == {"prompt_tokens": 43, "completion_tokens": 8, "total_tokens": 51}
    assert moving.summed({"prompt_tokens": 23, "completion_tokens": 5}) == \
        {"prompt_tokens": 43, "completion_tokens": 8, "total_tokens": 51}


def test_usage_after_two_moves_counts_each_attempts_prompt():
    moving = chat_stream(CHAT, allowed=2)
    moving.feed(sse(chat_chunk("a"), chat_chunk(" b")))  # first: 2 tokens from prompt P
    moving.moved(None)
    moving.feed(sse(chat_chunk(" c")))  # second: prompt P+2, 1 token
    moving.moved(None)
    # third: prompt P+3 = 13 (P = 10), 4 tokens; prompts 10 + 12 + 13, outputs 2 + 1 + 4
    assert moving.summed({"prompt_tokens": 13, "completion_tokens": 4}) == \
        {"prompt_tokens": 35, "completion_tokens": 7, "total_tokens": 42}
    assert moving.left == 0 and not moving.may_move()


def test_an_error_event_mid_body_is_raised_with_what_came_before_it():
    moving = chat_stream(CHAT)
    before = sse(chat_chunk("a"))
    error = b'data: {"error": {"message": "engine dead", "code": 500}}\n\ndata: [DONE]\n\n'
    with pytest.raises(ErrorEvent) as info:
        moving.feed(before + error)
    assert info.value.passed == before and info.value.rest == error


@pytest.mark.parametrize("extra, why", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"echo": True}, "echo"), ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_requests_that_cannot_be_continued_faithfully_are_refused(extra, why):
    assert unfaithful({**CHAT, **extra}) == why
    moving = chat_stream({**CHAT, **extra})
    error = b'data: {"error": {"message": "x"}}\n\n'
    assert moving.feed(error) == error  # as before: the error event goes on
    assert not moving.may_move()


@pytest.mark.parametrize("extra", [{"n": 1}, {"logprobs": False}, {"stop": ["\n"]}, {"seed": 3},
                                   {"tools": [{"type": "function"}], "tool_choice": "none"},
                                   {"response_format": {"type": "text"}}])
def test_plain_options_do_not_stop_a_move(extra):
    assert unfaithful({**CHAT, **extra}) is None


def test_a_half_written_tool_call_is_not_continued():
    moving = chat_stream(CHAT)
    call = {**chat_chunk(), "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "arguments": '{"ci'}}]}, "finish_reason": None}]}
    moving.feed(sse(call))
    assert not moving.may_move() and moving.refused is not None


def test_only_chat_and_completions_streams_are_watched_and_only_with_migrations_allowed():
    assert watch(chat.ROUTE, CHAT, 0) is None
    for route in (embeddings.ROUTE, responses.CREATE, messages.MESSAGES):
        assert watch(route, CHAT, 1) is None


def test_a_long_stream_keeps_its_text_not_its_events():
    moving = chat_stream({**CHAT, "max_tokens": 100_000})
    event = sse(chat_chunk(" word"))
    for _ in range(2000):  # ~300 KB of events
        assert moving.feed(event) == event
    assert moving.kept <= 64 * 1024
    body = moving.continuation({**CHAT, "max_tokens": 100_000})
    assert body is not None
    assert body["messages"][-1]["content"] == " word" * 2000 and body["max_tokens"] == 100_000 - 2000
