"""A simulated vLLM replica (tools/simulator) behind a switch that makes it fail on purpose, and counts the
API requests that reach it (its health check and /metrics are never touched: a replica whose engine fails
still answers /health, as vLLM's does).

`mode`: "ok" (the simulator answers), "5xx" (500 with vLLM's error body), "429", "hang" (no answer head until
the client goes away), "break_after_first_chunk" (the head and the first body chunk, then the connection drops).
Mid-stream, after `cut_after` body chunks: "break_mid_stream" (the connection drops), "error_mid_stream" (an error
event, as vLLM sends when its engine fails, then `[DONE]`), "stall_mid_stream" (nothing more until the client
goes away). A simulator made with `context_seeded=True` continues a partial answer word for word, so a stream
moved to another replica can be compared with one that was not.
"""

from __future__ import annotations

import asyncio
import contextlib

import orjson

from tools.simulator import SimConfig, create_app

MODES = ("ok", "5xx", "429", "hang", "break_after_first_chunk", "break_mid_stream", "error_mid_stream",
         "stall_mid_stream")
ERROR_EVENT = b'data: {"error": {"message": "the simulated engine died", "type": "InternalServerError", ' \
              b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n'
HANG_AT_MOST = 60.0  # seconds a hung answer waits for its client to leave


class Faulty:
    def __init__(self, served: str = "served-m", **sim) -> None:
        self.app = create_app(SimConfig(model=served, **sim))
        self.mode = "ok"
        self.requests = 0  # API requests that reached this replica
        self.cut_after = 3  # body chunks sent before a *_mid_stream mode fails
        self.bodies: list[bytes] = []  # the bodies of the API requests that reached it

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        self.requests += 1
        receive = self._recorded(receive)
        mode = self.mode
        if mode in ("5xx", "429"):
            status = 500 if mode == "5xx" else 429
            body = orjson.dumps({"object": "error", "message": f"the simulated engine failed ({status})",
                                 "type": "InternalServerError" if status == 500 else "TooManyRequests",
                                 "param": None, "code": status})
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return None
        if mode == "hang":
            async with asyncio.timeout(HANG_AT_MOST):
                while (await receive())["type"] != "http.disconnect":
                    pass
            return None
        if mode == "break_after_first_chunk":
            chunks = 0

            async def cut(message) -> None:
                nonlocal chunks
                if message["type"] == "http.response.body" and message.get("body"):
                    chunks += 1
                    if chunks > 1:
                        raise ConnectionResetError("the replica died mid-answer")
                await send(message)

            return await self.app(scope, receive, cut)
        if mode.endswith("_mid_stream"):
            return await self._mid_stream(mode, scope, receive, send)
        return await self.app(scope, receive, send)

    def _recorded(self, receive):
        async def recorded():
            message = await receive()
            if message["type"] == "http.request":
                self.bodies.append(message.get("body", b""))
            return message
        return recorded

    async def _mid_stream(self, mode: str, scope, receive, send) -> None:
        sent = 0

        async def failing(message) -> None:
            nonlocal sent
            if message["type"] == "http.response.body" and message.get("body"):
                sent += 1
                if sent > self.cut_after:
                    if mode == "break_mid_stream":
                        raise ConnectionResetError("the replica died mid-answer")
                    if mode == "error_mid_stream":
                        await send({"type": "http.response.body", "body": ERROR_EVENT, "more_body": False})
                    else:  # stall_mid_stream: silent until the client leaves
                        async with asyncio.timeout(HANG_AT_MOST):
                            while (await receive())["type"] != "http.disconnect":
                                pass
                    raise _Over
            await send(message)

        with contextlib.suppress(_Over):
            await self.app(scope, receive, failing)


class _Over(Exception):
    """The failure was sent: the simulator's answer goes no further."""
