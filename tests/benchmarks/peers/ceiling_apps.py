"""Minimal ASGI apps that bound what any Python gateway can do on one core (see ceilings.py).

- `fixed`: reads the request body and answers a fixed chat.completion: the ASGI server's own ceiling.
- `via_httpx`: forwards the body to the stand-in with one shared httpx.AsyncClient (the gateway's client, with
  the gateway's pool limits) and returns the upstream body: server + HTTP client, nothing else.
- `via_aiohttp`: the same with one shared aiohttp.ClientSession.
- `via_http1`: the same with the gateway's own upstream client (backends/http1.py, imported from this repo).
- `via_httpx_taskgroup`: `via_httpx` plus what the gateway's /v1 route does around every call: an anyio task
  group with a task that watches for the client's disconnect.

Each forwards to $CEIL_UPSTREAM (the stand-in's JSON port). Streams are not covered: these are request-cost
ceilings. Run only by ceilings.py, in the bench's own venv.
"""

from __future__ import annotations

import os

UPSTREAM = os.environ.get("CEIL_UPSTREAM", "http://127.0.0.1:9") + "/v1/chat/completions"
FIXED = (b'{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench","choices":'
         b'[{"index":0,"message":{"role":"assistant","content":"Hello! How can I help you today?"},'
         b'"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":9,'
         b'"total_tokens":21}}')
HEADERS = [(b"content-type", b"application/json")]
_clients: dict[str, object] = {}


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _reply(send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [*HEADERS, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def fixed(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    await _body(receive)
    await _reply(send, FIXED)


def _httpx():
    client = _clients.get("httpx")
    if client is None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=30)
        client = _clients["httpx"] = httpx.AsyncClient(limits=limits, trust_env=False, timeout=30)
    return client


async def via_httpx(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    body = await _body(receive)
    response = await _httpx().post(UPSTREAM, content=body, headers={"content-type": "application/json"})
    await _reply(send, response.content)


async def via_aiohttp(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    body = await _body(receive)
    session = _clients.get("aiohttp")
    if session is None:
        import aiohttp

        session = _clients["aiohttp"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    async with session.post(UPSTREAM, data=body, headers={"content-type": "application/json"}) as response:
        data = await response.read()
    await _reply(send, data)


async def via_httpx_taskgroup(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    import anyio

    body = await _body(receive)

    async def watch(cancel_scope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        cancel_scope.cancel()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(watch, tasks.cancel_scope)
        response = await _httpx().post(UPSTREAM, content=body, headers={"content-type": "application/json"})
        await _reply(send, response.content)
        tasks.cancel_scope.cancel()


async def via_http1(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    body = await _body(receive)
    client = _clients.get("http1")
    if client is None:
        from backends.http1 import Client, parse_origin

        origin = parse_origin(UPSTREAM)
        head = (f"POST {origin.path} HTTP/1.1\r\nhost: {origin.host_header}\r\n"
                "content-type: application/json\r\n").encode()
        client = _clients["http1"] = (Client(10, 30), origin, head)
    pool, origin, head = client
    response = await pool.request(origin, head + b"content-length: %d\r\n\r\n" % len(body), body)
    try:
        data = await response.read()
    finally:
        response.close()
    await _reply(send, data)
