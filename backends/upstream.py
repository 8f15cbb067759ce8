"""Talking HTTP to an OpenAI-compatible upstream: an owned vLLM replica today, a rented provider later.

Responses are always opened as streams; the caller reads or relays them and must close them. Failures
surface as httpx exceptions and are classified by `classify`, so the proxy treats every upstream alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import httpx

from policies.egress import GuardedNetwork, Resolver, SystemResolver, guarded_transport

CONNECT, TIMEOUT, BROKEN = "connect", "timeout", "broken"


class Upstream:
    """One OpenAI-compatible API: `api_base` ends in /v1 (an owned vLLM's URL + /v1, a provider's base_url)."""

    def __init__(self, client: httpx.AsyncClient, api_base: str, headers: dict[str, str] | None = None,
                 timeout: float | None = None) -> None:
        self.client = client
        self.api_base = api_base
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0)) if timeout else None
        self.headers = {"content-type": "application/json", "accept-encoding": "identity", **(headers or {})}

    async def open(self, path: str, body: bytes, request_id: str) -> httpx.Response:
        request = self.client.build_request(
            "POST", f"{self.api_base}/{path}", content=body, headers={**self.headers, "x-request-id": request_id},
            **({"timeout": self.timeout} if self.timeout else {}),
        )
        return await self.client.send(request, stream=True)


def classify(exc: httpx.HTTPError) -> str:
    """connect: nothing reached the backend, safe to retry elsewhere; timeout; broken: failed mid-exchange."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return CONNECT
    if isinstance(exc, httpx.TimeoutException):
        return TIMEOUT
    return BROKEN


def new_client(
    connect: float,
    read: float,
    write: float,
    *,
    private_cidrs: Iterable[str] | None = None,
    resolver: Resolver | None = None,
    exempt: Iterable[tuple[str, int]] = (),
    on_refused: Callable[[str, int, str], None] | None = None,
) -> httpx.AsyncClient:
    """The one client pool every upstream request shares.

    With `private_cidrs`, every new connection is checked at connect time (policies/egress.py): a host must
    resolve only inside them, except the (host, port) origins in `exempt` (the rented providers).
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=30)
    transport = None
    if private_cidrs is not None:
        network = GuardedNetwork(private_cidrs, resolver or SystemResolver(), exempt, on_refused)
        transport = guarded_transport(network, limits)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=connect, read=read, write=write, pool=connect),
        limits=limits,
        transport=transport,
        follow_redirects=False,
        trust_env=False,
    )
