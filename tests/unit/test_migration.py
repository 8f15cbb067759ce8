"""gateway/migration.py: what a stream relayed so far, the request that continues it on another replica, and the
continuation's chunks under the first attempt's id."""

from __future__ import annotations

import orjson
import pytest

from gateway.endpoints import chat, completions, embeddings, messages, responses
from gateway.migration import ErrorEvent, Migration, last_events, unfaithful, watch


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


def test_an_error_event_ending_a_long_read_is_found_where_vllm_puts_it():
    moving = chat_stream({**CHAT, "max_tokens": 5000})
    before = sse(*[chat_chunk("tok") for _ in range(400)])  # ~60 KB in one read (a fast replica)
    error = b'data: {"error": {"message": "engine dead", "code": 500}}\n\ndata: [DONE]\n\n'
    with pytest.raises(ErrorEvent) as info:
        moving.feed(before + error)
    assert info.value.passed == before and info.value.rest == error


@pytest.mark.parametrize("tail", [
    b"",  # the error event ends the read; its [DONE] comes in the next
    b"data: [DONE]\n\n",
])
def test_an_error_event_is_looked_for_in_a_reads_last_event_or_the_one_before_done(tail):
    error = b'data: {"error": {"message": "engine dead", "code": 500}}\n\n'
    for before in (b"", sse(chat_chunk("a"))):
        with pytest.raises(ErrorEvent) as info:
            chat_stream(CHAT).feed(before + error + tail)
        assert info.value.passed == before and info.value.rest == error + tail


def test_an_error_event_with_text_after_it_in_the_same_read_goes_on_to_the_client_as_it_came():
    moving = chat_stream(CHAT)
    read = sse(chat_chunk("a")) + b'data: {"error": {"message": "a warning"}}\n\n' + sse(chat_chunk("b"))
    assert moving.feed(read) == read


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


def with_ids(chunk: dict, ids: list[int], prompt: list[int] | None = None) -> dict:
    """A chunk as vLLM sends it when asked for token ids (`return_token_ids`)."""
    chunk = {**chunk, "choices": [{**c, "token_ids": ids} for c in chunk["choices"]]}
    if prompt is not None:
        chunk["prompt_token_ids"] = prompt
    return chunk


def test_a_chat_with_token_ids_goes_on_as_a_completion_of_its_tokens_and_the_client_never_sees_them():
    moving = watch(chat.ROUTE, {**CHAT, "return_token_ids": True}, 1, hide=True)
    assert moving is not None
    out = moving.feed(sse(with_ids(chat_chunk(role=True), [], prompt=[1, 2, 3]), with_ids(chat_chunk("He"), [7]),
                          with_ids(chat_chunk("llo"), [8])))
    assert b"token_ids\":[" not in out  # vLLM's null, as for a client that did not ask
    assert [e["choices"][0].get("token_ids") for e in events(out)] == [None, None, None]
    assert events(out)[0]["prompt_token_ids"] is None
    assert moving.token_exact() and moving.sent_as(chat.ROUTE) is completions.ROUTE
    body = moving.continuation({**CHAT, "temperature": 0, "seed": 5, "return_token_ids": True})
    # nothing re-tokenized: the prompt's ids and the generated ones, the budget less those two tokens
    assert body == {"model": "m", "stream": True, "temperature": 0, "seed": 5, "max_tokens": 8,
                    "prompt": [1, 2, 3, 7, 8], "return_token_ids": True}


def test_a_completion_continued_from_ids_is_told_back_as_chat_chunks_under_the_first_head():
    moving = watch(chat.ROUTE, CHAT, 1, hide=True)
    assert moving is not None
    moving.feed(sse(with_ids(chat_chunk(role=True, cid="chatcmpl-a", created=7), [], prompt=[1, 2]),
                    with_ids(chat_chunk("a", cid="chatcmpl-a", created=7), [5])))
    moving.moved(None, as_chat=True)
    first = {**with_ids(cmpl_chunk("b", cid="cmpl-x"), [6]), "object": "text_completion"}
    first["choices"][0]["prompt_token_ids"] = [1, 2, 5]
    usage = {**cmpl_chunk("", cid="cmpl-x"), "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    out = events(moving.feed(sse(first, usage)))
    assert [(e["id"], e["created"], e["object"]) for e in out] == [("chatcmpl-a", 7, "chat.completion.chunk")] * 2
    choice = out[0]["choices"][0]
    assert choice["delta"] == {"content": "b"} and "text" not in choice and "token_ids" not in choice
    # both replicas' work: the first's prompt (2) and token (1), the continuation's prompt (3) and tokens (2)
    assert out[1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert moving.ids == [5, 6]


def test_tokens_whose_text_was_held_back_are_made_again_not_skipped():
    moving = watch(completions.ROUTE, {"model": "m", "stream": True, "prompt": "x", "max_tokens": 10}, 1)
    assert moving is not None
    head = with_ids(cmpl_chunk("a"), [5])
    head["choices"][0]["prompt_token_ids"] = [1]
    # the third token is half a character: vLLM holds its text back until the next completes it
    moving.feed(sse(head, with_ids(cmpl_chunk("b"), [6]), with_ids(cmpl_chunk(""), [7])))
    body = moving.continuation({"model": "m", "stream": True, "prompt": "x", "max_tokens": 10})
    assert body is not None and body["prompt"] == [1, 5, 6] and body["max_tokens"] == 8


def test_without_ids_from_every_chunk_the_stream_goes_on_from_its_text():
    moving = chat_stream(CHAT)
    moving.feed(sse(with_ids(chat_chunk(role=True), [], prompt=[1]), with_ids(chat_chunk("a"), [5]),
                    chat_chunk(" b")))  # a chunk that did not say its ids
    assert not moving.token_exact() and moving.sent_as(chat.ROUTE) is chat.ROUTE
    body = moving.continuation(CHAT)
    assert body is not None and body["messages"][-1] == {"role": "assistant", "content": "a b"}


@pytest.mark.parametrize("ids, prompt", [([5, "6"], [1]), ([5, True], [1]), ([5], [1, 2.5]), ([5], ["x"])])
def test_token_ids_that_are_not_integers_make_the_stream_go_on_from_its_text(ids, prompt):
    moving = watch(chat.ROUTE, {**CHAT, "return_token_ids": True}, 1, hide=True)
    assert moving is not None
    moving.feed(sse(with_ids(chat_chunk(role=True), [], prompt=prompt), with_ids(chat_chunk("a"), ids)))
    assert not moving.token_exact()
    body = moving.continuation(CHAT)
    assert body is not None and body["messages"][-1] == {"role": "assistant", "content": "a"}


@pytest.mark.parametrize("choices", [5, "abc", None, {"a": 1}, [3, None]])
def test_a_continuation_chunk_whose_choices_are_not_a_list_of_objects_passes_without_a_crash(choices):
    moving = watch(completions.ROUTE, {"model": "m", "stream": True, "prompt": "x", "max_tokens": 10}, 2, hide=True)
    assert moving is not None
    head = with_ids(cmpl_chunk("a"), [5])
    head["choices"][0]["prompt_token_ids"] = [1]
    moving.feed(sse(head))
    moving.moved(None)
    odd = {**cmpl_chunk(""), "choices": choices, "prompt_token_ids": [1, 5]}
    out = events(moving.feed(sse(odd)))
    assert out[0]["choices"] == choices and out[0]["prompt_token_ids"] is None


def call_of(body: dict):
    from policies.pipeline import Call, Request

    return Call(Request("r", "chat/completions", {}, "127.0.0.1", 0.0),
                body=body, stream=True)


@pytest.mark.parametrize("extra, rented, asked", [
    ({}, False, True), ({}, True, False), ({"stop": ["\n"]}, False, False), ({"return_token_ids": False}, False, False),
    ({"n": 2}, False, False), ({"logprobs": True}, False, False)])
def test_the_ids_are_asked_for_only_where_a_stream_can_go_on_from_them(extra, rented, asked):
    from gateway.migration import IDS, ask_for_ids

    body = {**CHAT, **extra}
    call = call_of(body)
    ask_for_ids(call, body, chat.ROUTE, 1, rented)
    assert (body.get(IDS) is True and "return_token_ids" not in extra) is asked
    if asked:  # the same call sent on to a rented API later: the field it would refuse goes
        ask_for_ids(call, body, chat.ROUTE, 1, True)
        assert IDS not in body


def test_a_replica_that_does_not_say_its_tokens_is_relayed_as_it_came_and_not_scanned_again():
    moving = watch(chat.ROUTE, CHAT, 1, hide=True)
    assert moving is not None
    raw = sse(chat_chunk(role=True), chat_chunk("a"))
    assert moving.feed(raw) == raw and not moving.hide  # not vLLM (no ids in its first event): nothing to put back
    body = moving.continuation(CHAT)
    assert body is not None and body["messages"][-1]["content"] == "a"  # from the text


def test_a_completion_continuation_keeps_counting_its_ids_for_a_second_move_and_hides_them():
    body = {"model": "m", "stream": True, "prompt": "x", "max_tokens": 10, "return_token_ids": True}
    moving = watch(completions.ROUTE, body, 2, hide=True)
    assert moving is not None
    head = with_ids(cmpl_chunk("a"), [5])
    head["choices"][0]["prompt_token_ids"] = [1]
    moving.feed(sse(head))
    moving.moved(None)
    second = with_ids(cmpl_chunk("b", cid="cmpl-2"), [6])
    second["choices"][0]["prompt_token_ids"] = [1, 5]
    out = events(moving.feed(sse(second)))
    assert out[0]["choices"][0]["token_ids"] is None and out[0]["choices"][0]["prompt_token_ids"] is None
    assert moving.ids == [5, 6] and moving.token_exact()
    again = moving.continuation(body)
    assert again is not None and again["prompt"] == [1, 5, 6] and again["max_tokens"] == 8


def test_the_last_events_of_a_read_begin_after_the_blank_line_before_them():
    one, done = b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"
    assert last_events(one) == 0
    assert last_events(one + one) == len(one)
    assert last_events(one + one + done) == len(one)
    assert last_events(one + done) == 0
    assert last_events(b"data: {}") == 0  # a tail at the stream's end, with no blank line
