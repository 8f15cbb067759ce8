"""A simulated vLLM replica (backends/simulator) behind a switch that makes it fail on purpose, and counts the
API requests that reach it (its health check and /metrics are never touched: a replica whose engine fails
still answers /health, as vLLM's does).

`mode`: "ok" (the simulator answers), "5xx" (500 with vLLM's error body), "429", "hang" (no answer head until
the client goes away), "break_after_first_chunk" (the head and the first body chunk, then the connection drops).
"""

from __future__ import annotations

import asyncio

import orjson

from backends.simulator import SimConfig, create_app

MODES = ("ok", "5xx", "429", "hang", "break_after_first_chunk")
HANG_AT_MOST = 60.0  # seconds a hung answer waits for its client to leave


class Faulty:
    def __init__(self, served: str = "served-m", **sim) -> None:
        self.app = create_app(SimConfig(model=served, **sim))
        self.mode = "ok"
        self.requests = 0  # API requests that reached this replica

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        self.requests += 1
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
        return await self.app(scope, receive, send)
