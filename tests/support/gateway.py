"""Start a real gateway (uvicorn on a loopback port) from a policy given as a dict."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from gateway.app import Gateway, create_app
from gateway.config import Policy
from tests.support.probes import metric_sum
from tests.support.servers import serve_app


@dataclass
class RunningGateway:
    url: str
    state: Gateway

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when there are none), from /metrics."""
        async with httpx.AsyncClient() as client:
            return metric_sum((await client.get(f"{self.url}/metrics")).text, name, **labels)


@contextlib.asynccontextmanager
async def running_gateway(policy: dict) -> AsyncIterator[RunningGateway]:
    app = create_app(Policy.model_validate(policy))
    async with serve_app(app) as url:
        yield RunningGateway(url, app.state)


def one_model(*urls: str, name: str = "m", served: str = "served-m", **extra) -> dict:
    return {
        "models": [{"name": name, "aliases": [f"{name}-alias"], "served_name": served,
                    "backends": [{"url": u} for u in urls]}],
        "health": {"interval": 0.2, "backoff_initial": 0.2, "backoff_max": 1},
        **extra,
    }
