"""Talking HTTP to an OpenAI-compatible upstream: an owned vLLM replica today, a rented provider later.

Responses are always opened as streams; the caller reads or relays them and must close them. Failures
surface as httpx exceptions and are classified by `classify`, so the proxy treats every upstream alike.
"""

from __future__ import annotations

import httpx

CONNECT, TIMEOUT, BROKEN = "connect", "timeout", "broken"


class Upstream:
    def __init__(self, client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None = None) -> None:
        self.client = client
        self.base_url = base_url
        self.headers = {"content-type": "application/json", "accept-encoding": "identity", **(headers or {})}

    async def open(self, path: str, body: bytes, request_id: str) -> httpx.Response:
        request = self.client.build_request(
            "POST", f"{self.base_url}/v1/{path}", content=body, headers={**self.headers, "x-request-id": request_id}
        )
        return await self.client.send(request, stream=True)


def classify(exc: httpx.HTTPError) -> str:
    """connect: nothing reached the backend, safe to retry elsewhere; timeout; broken: failed mid-exchange."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return CONNECT
    if isinstance(exc, httpx.TimeoutException):
        return TIMEOUT
    return BROKEN


def new_client(connect: float, read: float, write: float) -> httpx.AsyncClient:
    """The one client pool every upstream request shares."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=connect, read=read, write=write, pool=connect),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=30),
        follow_redirects=False,
        trust_env=False,
    )
