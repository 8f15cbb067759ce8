"""Start a real gateway (uvicorn on a loopback port) from a policy given as a dict, with a key issued.

Every gateway started here stores its keys in a fresh SQLite file (unless the policy names a store) and
knows TEST_KEY, which the shared test clients send; tests about keys issue their own.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from gateway.app import create_app
from gateway.wiring import Gateway
from policies.config import Policy
from policies.keys import KeyRecord, hash_key, key_id_of, new_key, new_key_id
from tests.support.probes import metric_sum
from tests.support.servers import serve_app

TEST_KEY = new_key(new_key_id())
AUTH = {"authorization": f"Bearer {TEST_KEY}"}


@dataclass
class RunningGateway:
    url: str
    state: Gateway

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when there are none), from /metrics."""
        async with httpx.AsyncClient() as client:
            return metric_sum((await client.get(f"{self.url}/metrics")).text, name, **labels)


def default_key_record(**fields) -> KeyRecord:
    return KeyRecord(id=key_id_of(TEST_KEY), name="tests", created_at=time.time(), hash=hash_key(TEST_KEY),
                     **fields)


@contextlib.asynccontextmanager
async def running_gateway(policy: dict, issue_test_key: bool = True, resolver=None) -> AsyncIterator[RunningGateway]:
    with tempfile.TemporaryDirectory(prefix="llmgw-") as tmp:
        policy = {"store": {"kind": "sqlite", "path": f"{tmp}/keys.db"}, **policy}
        app = create_app(Policy.model_validate(policy), resolver=resolver)
        async with serve_app(app, proxy_headers=False) as url:  # as `serve` runs it: XFF is the gateway's call
            if issue_test_key:
                await app.state.store.create_key(default_key_record())
            yield RunningGateway(url, app.state)


def one_model(*urls: str, name: str = "m", served: str = "served-m", **extra) -> dict:
    return {
        "models": [{"name": name, "aliases": [f"{name}-alias"], "served_name": served,
                    "backends": [{"url": u} for u in urls]}],
        "health": {"interval": 0.2, "backoff_initial": 0.2, "backoff_max": 1},
        **extra,
    }
