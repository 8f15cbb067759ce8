"""The bits of raw ASGI that the tests' small stand-in servers share."""

from __future__ import annotations


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
