"""The types of what arrives over HTTP, as the gateway's code names them.

The gateway's own ASGI code (gateway/openai_routes.py, and the admin paths' wrapper in gateway/admin/variants.py)
takes plain mappings, as a server sends them; Litestar declares its own, as TypedDicts per scope type, and the
app factory (gateway/app.py) hands its ops/admin app over as an `App`. Litestar's requests and connections are
generic in what its routes' user, auth and state are, which no route of the gateway uses: `AnyRequest` and
`AnyConnection` are those of any route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Coroutine[Any, Any, Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

AnyRequest = Request[Any, Any, Any]  # an HTTP request to a route
AnyConnection = ASGIConnection[Any, Any, Any, Any]  # what a guard sees, and what an audit record reads of a request
