"""The types of what arrives over HTTP, as the gateway's code names them.

The gateway's own ASGI code (gateway/openai_routes.py, and the admin paths' wrapper in gateway/admin/variants.py)
takes plain mappings, as a server sends them, their values read through the typed readers below (`text_of`,
`body_of`, `raw_headers`, ...) so nothing untyped reaches the request path; Litestar declares its own, as
TypedDicts per scope type, and the app factory (gateway/app.py) hands its ops/admin app over as an `App`.
Litestar's requests and connections are generic in what its routes' user, auth and state are, which no route
of the gateway uses: `AnyRequest` and `AnyConnection` are those of any route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection

Scope = MutableMapping[str, object]
Message = MutableMapping[str, object]
Receive = Callable[[], Coroutine[object, object, Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def text_of(mapping: Scope | Message, name: str) -> str:
    """A text field of a scope or message ("" when absent or not text: an ASGI server sends str here)."""
    value = mapping.get(name, "")
    return value if isinstance(value, str) else ""


def body_of(message: Message) -> bytes:
    """The bytes an http.request message carries (b"" for none)."""
    body = message.get("body", b"")
    return body if isinstance(body, bytes) else b""


def more_body(message: Message) -> bool:
    return message.get("more_body", False) is True


def raw_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The request's header pairs as the server sent them (an ASGI server sends a list of 2-tuples of bytes)."""
    headers = scope.get("headers")
    return headers if isinstance(headers, list) else []


def client_host(scope: Scope) -> str:
    """The peer's address ("" when the server gave none)."""
    client = scope.get("client")
    host = client[0] if isinstance(client, (tuple, list)) and client else ""
    return host if isinstance(host, str) else ""


def query_of(scope: Scope) -> bytes:
    query = scope.get("query_string", b"")
    return query if isinstance(query, bytes) else b""


AnyRequest = Request[Any, Any, Any]  # an HTTP request to a route
AnyConnection = ASGIConnection[Any, Any, Any, Any]  # what a guard sees, and what an audit record reads of a request
