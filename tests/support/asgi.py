"""The bits of raw ASGI that the tests' small stand-in servers share."""

from __future__ import annotations

import asyncio


async def lifespan(receive, send) -> None:
    """Answer startup and shutdown; returns at shutdown."""
    while True:
        message = await receive()
        kind = "startup" if message["type"] == "lifespan.startup" else "shutdown"
        await send({"type": f"lifespan.{kind}.complete"})
        if kind == "shutdown":
            return


async def read_body(receive) -> bytes:
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            return raw


class InFlight:
    """Wraps a backend stand-in's ASGI app and counts the requests it serves at once, as the backend sees them:
    from the request's arrival until the app hands over the response's last bytes. The count drops before those
    bytes are sent, so a gateway that reacts to the end of one response can never be seen overlapping it; a
    peak above a cap is a real breach. `gate`, when cleared, holds every counted request at the door (already
    counted) until it is set again. Only paths under `prefix` are counted and gated (not /health, /metrics)."""

    def __init__(self, app, prefix: str = "/v1/") -> None:
        self.app = app
        self.prefix = prefix
        self.now = 0
        self.peak = 0
        self.served = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        self.now += 1
        self.served += 1
        self.peak = max(self.peak, self.now)
        done = False

        async def counted(message) -> None:
            nonlocal done
            if not done and message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
                self.now -= 1
            await send(message)

        try:
            await self.gate.wait()
            await self.app(scope, receive, counted)
        finally:
            if not done:
                self.now -= 1
