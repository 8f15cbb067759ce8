"""What a variant's answers say: structured validity, tool-call arguments, streamed answers, load levels."""

from __future__ import annotations

import orjson
import pytest

from gateway.relay import SSERelay
from policies.pipeline import Call, Request
from policies.variant_signals import (
    ANSWER,
    StreamAnswer,
    Window,
    load_level,
    sample_of,
    structured_validity,
    summary,
)
from tests.support.calls import settled

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}


@pytest.mark.parametrize("body, content, calls, expected", [
    ({"response_format": {"type": "json_object"}}, '{"a": 1}', [], True),
    ({"response_format": {"type": "json_object"}}, '{"a": 1', [], False),
    ({"response_format": {"type": "json_object"}}, '[1, 2]', [], False),  # JSON, but not an object
    ({"response_format": JSON_SCHEMA}, '{"city": "Oslo", "days": 3}', [], True),
    ({"response_format": JSON_SCHEMA}, '{"city": "Oslo", "days": 0}', [], False),  # below the minimum
    ({"response_format": JSON_SCHEMA}, '{"city": "Oslo"}', [], False),  # a required property missing
    ({"response_format": {"type": "text"}}, "not json", [], None),  # nothing structured asked for
    ({}, "plain", [], None),
    ({"tools": TOOLS}, None, [{"name": "weather", "arguments": '{"city": "Rome", "days": 2}'}], True),
    ({"tools": TOOLS}, None, [{"name": "weather", "arguments": '{"city": "Rome", "days": "two"}'}], False),
    ({"tools": TOOLS}, None, [{"name": "weather", "arguments": '{"city": "Rome", "days": 2'}], False),
    ({"tools": TOOLS}, None, [{"name": "forecast", "arguments": '{}'}], False),  # a tool nobody declared
    ({"tools": TOOLS}, "I'd rather talk", [], None),  # tools offered, none called: not a structured answer
    ({"response_format": JSON_SCHEMA, "tools": TOOLS}, '{"city": "Oslo", "days": 3}',
     [{"name": "weather", "arguments": '{"city": 1, "days": 2}'}], False),  # every part must hold
])
def test_structured_validity(body, content, calls, expected):
    assert structured_validity(body, content, calls) is expected


def test_a_broken_schema_is_the_clients_not_the_variants():
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}}
    assert structured_validity(body, '{"a": 1}', []) is True


def call(body: dict, stream: bool, **fields) -> Call:
    c = Call(Request("r", "chat/completions", {}, "127.0.0.1", 0.0))
    settled(c, model="m")
    c.variant, c.body, c.stream, c.status = "a", body, stream, 200
    answer = fields.pop("answer", None)
    if answer is not None:
        ANSWER.put(c, answer)
    for name, value in fields.items():
        setattr(c, name, value)
    return c


def sse(*events: dict) -> list[bytes]:
    out = [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    return [b"".join(out)[i:i + 7] for i in range(0, len(b"".join(out)), 7)]  # cut anywhere, as a socket does


def relayed(chunks: list[bytes], whole: bool) -> StreamAnswer:
    """What the proxy's relay does: cut the upstream bytes at event boundaries, feed each batch of events on."""
    relay, answer = SSERelay(strip_usage=True), StreamAnswer(whole)
    for chunk in chunks:
        out = relay.feed(chunk)
        if out:
            answer.feed(out)
    answer.feed(relay.flush())
    return answer


def test_a_streamed_tool_call_is_assembled_from_its_deltas():
    chunks = sse(
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "weather",
                                                                                      "arguments": '{"city": '}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo", "da'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ys": 4}'}}]},
                      "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"completion_tokens": 11}},
    )
    c = call({"tools": TOOLS}, True, answer=relayed(chunks, whole=True), sent_at=1.0, first_token_at=1.25, load=3,
             usage={"completion_tokens": 11})
    s = sample_of(c, now=2.25)
    assert s.structured is True and s.length is False and s.load == "4"
    assert s.ttft == pytest.approx(0.25) and s.itl == pytest.approx(0.1) and s.tokens_per_second == pytest.approx(10)
    assert ANSWER.of(c).answer() == ("", [{"name": "weather", "arguments": '{"city": "Oslo", "days": 4}'}])


def test_a_streamed_json_answer_cut_at_the_length_limit():
    chunks = sse({"choices": [{"index": 0, "delta": {"content": '{"city": "Os'}}]},
                 {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]})
    answer = relayed(chunks, whole=True)
    s = sample_of(call({"response_format": {"type": "json_object"}}, True, answer=answer), now=1.0)
    assert s.structured is False and s.length is True and answer.answer() == ('{"city": "Oslo', [])


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_an_unstructured_stream_keeps_nothing_but_its_finish_reason(finish):
    chunks = sse({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]},
                 {"choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": finish}]},
                 {"choices": [], "usage": {"completion_tokens": 2}})
    answer = relayed(chunks, whole=False)
    assert answer.finish == finish and answer.text == [] and answer.calls == {}
    s = sample_of(call({}, True, answer=answer), now=1.0)
    assert s.length is (finish == "length") and s.structured is None


def test_a_whole_answer_and_a_failed_call():
    answer = {"choices": [{"message": {"content": '{"city": "Oslo", "days": 2}'}, "finish_reason": "stop"}]}
    s = sample_of(call({"response_format": JSON_SCHEMA}, False, response=answer), now=1.0)
    assert s.structured is True and s.error is None and s.ttft is None
    failed = sample_of(call({}, False, status=502), now=1.0)
    assert failed.error == "upstream_error" and failed.structured is None
    assert sample_of(call({}, False, status=499), now=1.0).error == "client_closed"
    assert sample_of(call({}, False, status=400), now=1.0).error == "rejected"


@pytest.mark.parametrize("in_flight, level", [(-1, "1"), (0, "1"), (1, "1"), (2, "2"), (3, "4"), (9, "16"), (64, "64"), (65, ">64")])
def test_load_levels(in_flight, level):
    assert load_level(in_flight) == level


def test_summary_counts_only_the_variants_own_faults_as_errors():
    window = Window(size=100)
    ok = {"choices": [{"message": {"content": '{"a": 1}'}, "finish_reason": "stop"}]}
    bad = {"choices": [{"message": {"content": '{"a": '}, "finish_reason": "length"}]}
    for i in range(8):
        window.add(sample_of(call({"response_format": {"type": "json_object"}}, False,
                                  response=bad if i < 2 else ok), now=1.0))
    for status in (502, 429):
        window.add(sample_of(call({}, False, status=status), now=1.0))
    s = summary(window.recent())
    assert s["requests"] == 10 and s["errors"] == {"upstream_error": 1, "at_capacity": 1}
    assert s["error_rate"] == pytest.approx(0.1)  # the 429 is the gateway's cap, not the variant's fault
    assert s["structured"] == 8 and s["structured_valid_rate"] == pytest.approx(0.75)
    assert s["length_rate"] == pytest.approx(0.25)
    assert s["agreement_rate"] is None


def test_agreement_exact_or_as_json():
    from policies.variant_signals import agreement

    call = [{"name": "weather", "arguments": '{"city": "Oslo", "days": 2}'}]
    assert agreement(("", call), ("", call)) == (True, True)
    spaced = [{"name": "weather", "arguments": '{"days":2,"city":"Oslo"}'}]
    assert agreement(("", call), ("", spaced)) == (False, True)  # the same object, written otherwise
    other = [{"name": "weather", "arguments": '{"city": "Oslo", "days": 3}'}]
    assert agreement(("", call), ("", other)) == (False, False)
    assert agreement(("", call), ("", [{"name": "forecast", "arguments": call[0]["arguments"]}])) == (False, False)
    assert agreement(("hello", []), ("hello!", [])) == (False, False)
    assert agreement(('{"a": 1}', []), ('{ "a":1 }', [])) == (False, True)


JSON_OBJECT = {"response_format": {"type": "json_object"}}
WITH_SCHEMA = {"response_format": JSON_SCHEMA}


@pytest.mark.parametrize("body, content, calls, finish, refused", [
    (JSON_OBJECT, "", [], "stop", False),  # empty: nothing a client can parse
    (JSON_OBJECT, None, [], "stop", False),  # null content
    (WITH_SCHEMA, "", [], "stop", False),
    (WITH_SCHEMA, None, [], "stop", False),
    (JSON_OBJECT, '{"a": 1}', [], "length", False),  # whole JSON, but cut at the length limit
    (WITH_SCHEMA, '{"city": "Oslo", "days": 3}', [], "length", False),
    (JSON_OBJECT, None, [], "stop", True),  # a refusal where JSON was required
    (JSON_OBJECT, "I can't help with that.", [], "stop", True),
    ({"tools": TOOLS}, None, [{"name": "weather", "arguments": None}], "tool_calls", False),  # missing arguments
    ({"tools": TOOLS}, None, [{"name": "weather", "arguments": ""}], "tool_calls", False),
    ({"tools": TOOLS}, None, [{"name": "weather", "arguments": "city=Oslo"}], "tool_calls", False),  # not JSON
    ({"tools": TOOLS}, None, [{"name": "weather", "arguments": '{"city": "Oslo"}'}], "tool_calls", False),  # schema
    ({"tools": TOOLS}, None, [{"name": "weather", "arguments": '{"city": "Oslo", "days": 2}'}], "length", False),
])
def test_every_structured_answer_counts_empty_cut_or_refused_is_invalid(body, content, calls, finish, refused):
    assert structured_validity(body, content, calls, finish, refused) is False


@pytest.mark.parametrize("message, finish", [
    ({"content": ""}, "stop"), ({"content": None}, "stop"), ({"content": '{"a": 1'}, "length"),
    ({"content": None, "refusal": "I can't help with that."}, "stop"),
])
def test_a_whole_answer_empty_cut_or_refused_is_an_invalid_sample(message, finish):
    response = {"choices": [{"message": message, "finish_reason": finish}]}
    for body in (JSON_OBJECT, {"response_format": JSON_SCHEMA}):
        assert sample_of(call(body, False, response=response), now=1.0).structured is False


def test_a_streamed_refusal_or_empty_json_answer_is_invalid():
    refusal = sse({"choices": [{"index": 0, "delta": {"refusal": "I can't"}}]},
                  {"choices": [{"index": 0, "delta": {"refusal": " help."}, "finish_reason": "stop"}]})
    assert sample_of(call(JSON_OBJECT, True, answer=relayed(refusal, whole=True)), now=1.0).structured is False
    empty = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert sample_of(call(JSON_OBJECT, True, answer=relayed(empty, whole=True)), now=1.0).structured is False


def test_79_empty_structured_answers_give_validity_0_and_a_rollback():
    from policies.config import Guard
    from policies.variant_guard import verdict

    window = Window(size=500)
    empty = {"choices": [{"message": {"content": ""}, "finish_reason": "stop"}]}
    for i in range(79):
        body = JSON_OBJECT if i % 2 else {"response_format": JSON_SCHEMA}
        window.add(sample_of(call(body, False, response=empty), now=1.0))
    s = summary(window.recent())
    assert s["structured"] == 79 and s["structured_valid_rate"] == 0
    good = {"choices": [{"message": {"content": '{"city": "Oslo", "days": 2}'}, "finish_reason": "stop"}]}
    base = [sample_of(call({"response_format": JSON_SCHEMA}, False, response=good), now=1.0) for _ in range(79)]
    assert verdict(Guard(), window.recent(), base)[0] == "structured_validity"
