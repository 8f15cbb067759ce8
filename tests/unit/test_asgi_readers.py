"""The typed readers of an ASGI scope and its messages (gateway/http/asgi.py): what a server sends is read as
it is; a field of another type or none at all reads as empty, never as a value of the wrong type."""

from __future__ import annotations

from gateway.http.asgi import body_of, client_host, more_body, query_of, raw_headers, text_of


def test_what_a_server_sends_is_read_as_it_is():
    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "query_string": b"a=1",
             "headers": [(b"authorization", b"Bearer k")], "client": ("10.0.0.7", 51000)}
    assert text_of(scope, "path") == "/v1/chat/completions" and text_of(scope, "method") == "POST"
    assert query_of(scope) == b"a=1" and raw_headers(scope) == [(b"authorization", b"Bearer k")]
    assert client_host(scope) == "10.0.0.7"
    message = {"type": "http.request", "body": b"{}", "more_body": True}
    assert body_of(message) == b"{}" and more_body(message) is True


def test_a_field_of_another_type_or_none_reads_as_empty():
    odd = {"type": "http", "path": b"/v1/x", "method": None, "query_string": "a=1", "headers": {"a": "b"},
           "client": None}
    assert text_of(odd, "path") == "" and text_of(odd, "method") == "" and text_of({}, "path") == ""
    assert query_of(odd) == b"" and raw_headers(odd) == [] and client_host(odd) == ""
    assert client_host({"client": ()}) == "" and client_host({"client": (7, 1)}) == ""
    assert client_host({"client": ["10.0.0.8", 1]}) == "10.0.0.8"  # a list where a tuple is usual
    assert body_of({"body": "text"}) == b"" and body_of({}) == b""
    assert more_body({"more_body": 1}) is False and more_body({}) is False  # only True says more follows
