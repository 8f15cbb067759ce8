"""The endpoint registry, the body checks, the wrapping of non-OpenAI error bodies and the event-frame relay."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from backends.replicas import Replica
from gateway.endpoints import ROUTES, Registry, responses
from gateway.endpoints.base import Route, parse_json
from gateway.endpoints.messages import anthropic_error
from gateway.relay import EventRelay
from policies.errors import BadRequest, NotFound, UpstreamStatus
from policies.pipeline import Call, Request

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu"


def test_every_route_is_found_by_its_path_and_method():
    registry = Registry()
    for route in ROUTES:
        path = route.path.replace("{id}", "resp_abc").replace("{model:path}", "org/model-1")
        methods, _ = registry.match(path)
        for method in route.methods:
            assert methods[method] is route


def test_path_parameters_are_taken_and_unsafe_ones_refused():
    registry = Registry()
    methods, params = registry.match("/v1/responses/resp_1/cancel")
    assert params == {"id": "resp_1"} and methods["POST"].name == "responses/cancel"
    assert registry.match("/v1/models/Qwen/Qwen3-4B")[1] == {"model": "Qwen/Qwen3-4B"}
    assert registry.match("/v1/responses/a b") is None  # nothing that could bend the upstream request line
    assert registry.match("/v1/responses/a\r\nx") is None
    assert registry.match("/v1/nothing") is None


def test_a_route_declared_twice_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        Registry((Route("a", "/x"), Route("b", "/x")))


@pytest.mark.parametrize("field, value", [
    ("stream", "yes"), ("stream", 1), ("stream_options", "usage"), ("stream_options", {"include_usage": "yes"}),
    ("n", 0), ("n", "2"), ("n", True), ("max_tokens", "10"), ("max_tokens", -1), ("max_tokens", 1.5),
    ("max_completion_tokens", []), ("max_output_tokens", {"a": 1}),
])
def test_fields_that_steer_the_gateway_are_type_checked(field, value):
    with pytest.raises(BadRequest) as refused:
        parse_json(orjson.dumps({"model": "m", field: value}))
    assert refused.value.param == field and field in refused.value.message


def test_well_typed_fields_pass():
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": False}, "n": 2, "max_tokens": 0,
            "max_output_tokens": None}
    assert parse_json(orjson.dumps(body)) == body


def test_vllm_detail_bodies_are_wrapped_in_an_openai_error_object():
    error = UpstreamStatus(404, b'{"detail":"Not Found"}')
    assert orjson.loads(error.body()) == {"error": {"message": "Not Found", "type": "invalid_request_error",
                                                    "param": None, "code": 404}}
    long = UpstreamStatus(400, b"<html>" + b"x" * 5000)
    assert error.status == 404 and len(orjson.loads(long.body())["error"]["message"]) == 500
    listed = UpstreamStatus(422, orjson.dumps({"detail": [{"loc": ["body", "n"], "msg": "bad"}]}))
    assert "bad" in orjson.loads(listed.body())["error"]["message"]


def test_openai_error_bodies_pass_unchanged():
    raw = b'{"error":{"message":"too long","type":"BadRequestError","param":"max_tokens","code":400}}'
    assert UpstreamStatus(400, raw).body() == raw


def test_anthropic_routes_render_errors_in_anthropic_shape():
    body = orjson.loads(anthropic_error(NotFound("no such model")))
    assert body == {"type": "error", "error": {"type": "not_found_error", "message": "no such model"}}
    wrapped = orjson.loads(anthropic_error(UpstreamStatus(400, b'{"error":{"message":"bad","type":"x"}}')))
    assert wrapped["error"] == {"type": "invalid_request_error", "message": "bad"}


def relay_all(relay: EventRelay, raw: bytes, size: int) -> bytes:
    out = b"".join(relay.feed(raw[i:i + size]) for i in range(0, len(raw), size))
    return out + relay.flush()


def a_call(**body) -> Call:
    return Call(Request("r", "responses", {}, "127.0.0.1", 0.0), body=body)


def test_a_background_responses_stream_ends_at_its_last_frame_even_if_the_backend_keeps_it_open():
    failed = b'event: response.created\ndata: {}\n\nevent: error\ndata: {"message":"engine failed"}\n\n'
    for relay in (responses.relay(a_call(background=True), None), responses.replay(a_call(), None)):
        assert relay.feed(failed[:30]) == b"" and not relay.ended
        assert relay.feed(failed[30:]) == failed and relay.ended
    foreground = responses.relay(a_call(), None)  # vLLM ends those itself: the connection may be reused
    foreground.feed(failed)
    assert not foreground.ended


@pytest.mark.parametrize("size", [1, 7, 100, 100_000])
def test_responses_frames_pass_through_and_usage_comes_from_response_completed(size):
    raw = (FIXTURES / "responses_stream.sse").read_bytes()
    relay = responses.relay(a_call(), (b'"model":"tiny"', b'"model":"public"'))
    out = relay_all(relay, raw, size)
    assert out == raw.replace(b'"model":"tiny"', b'"model":"public"')
    assert relay.usage == {"prompt_tokens": 13, "completion_tokens": 6}


@pytest.mark.parametrize("size", [1, 100_000])
def test_a_replayed_response_stream_passes_through_with_nothing_counted(size):
    raw = (FIXTURES / "responses_stream.sse").read_bytes()
    relay = responses.replay(None, (b'"model":"tiny"', b'"model":"public"'))
    assert relay_all(relay, raw, size) == raw.replace(b'"model":"tiny"', b'"model":"public"')
    assert relay.usage is None and relay.events == 0 and relay.replay  # no tokens, no stand-in for them


def test_a_retrieve_forwards_its_known_query_fields_re_encoded():
    read = responses.RETRIEVE.query
    assert read(b"") == ""
    assert read(b"stream=true&starting_after=4") == "?stream=true&starting_after=4"
    assert read(b"include%5B%5D=message.output_text.logprobs&include%5B%5D=a%20b") == \
        "?include%5B%5D=message.output_text.logprobs&include%5B%5D=a+b"
    for other in ROUTES:  # no other route forwards a query
        assert other.query is None or other is responses.RETRIEVE


@pytest.mark.parametrize("raw", [b"stream=yes", b"stream", b"starting_after=-1", b"starting_after=1e3",
                                 b"stream=true&stream=true", b"colour=red", b"include=%ff", b"include=\xc3\xa9",
                                 b"a=1&&b=2", b"include=" + b"x" * 2100, b"&".join([b"include=a"] * 40)])
def test_a_malformed_or_over_long_retrieve_query_is_a_400(raw):
    with pytest.raises(BadRequest) as refused:
        responses.RETRIEVE.query(raw)
    assert refused.value.code == "invalid_query"


def test_anthropic_stream_usage_is_merged_from_start_and_delta():
    from gateway.endpoints import messages

    raw = (FIXTURES / "messages_stream.sse").read_bytes()
    relay = messages.relay(None, None)
    assert relay_all(relay, raw, 9) == raw
    assert relay.usage == {"prompt_tokens": 11, "completion_tokens": 4}


def test_response_ids_lead_back_to_their_replica():
    a = Replica("vllm-a", "m", "http://127.0.0.1:1", "tiny")
    b = Replica("vllm-b", "m", "http://127.0.0.1:2", "tiny")
    made = responses.new_id(b, lambda rest: "0" * 16)
    assert made.startswith("resp_") and responses.replica_of(made, [a, b]) is b
    assert responses.replica_of(made, [a]) is None  # its replica is gone
    assert responses.replica_of("resp_8514732114e24fc8", [a, b]) is None  # an id vLLM made on its own
    assert responses.replica_of(None, [a, b]) is None
