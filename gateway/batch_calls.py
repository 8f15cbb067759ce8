"""A batch's line as a call: the same proxy, pipeline and admission as a client's request on the line's route, so
it is limited, budgeted, queued (in the batch class, behind interactive work), routed and accounted like one.

The line runs as its batch's key, read afresh (a key revoked or expired since stops its batch's remaining lines),
from the address its batch was created from (the key's and the policy's network rules hold for it too). It stays
on owned replicas unless `batch.allow_rented` says otherwise (and the key's data policy allows renting).

A line its runner lets be preempted runs its call in a task of its own, filed for admission to stop when a better
class's request must wait for its slot (policies/preemption.py): stopped, the call ends as one whose client hung
up, and the line raises Preempted, so its runner runs it again (never an answer of its own).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import orjson

from gateway.endpoints import chat, completions, embeddings
from gateway.needs import Configured, Stored
from gateway.proxy import Proxy, Reply
from policies.auth import INVALID
from policies.batches.runner import Answer, Preempted, TryLater
from policies.errors import GatewayError
from policies.ids import unique_id
from policies.pipeline import KEY, Call
from policies.preemption import PREEMPTIBLE, stoppable
from policies.store import StoreUnavailable

ROUTES = {route.path: route for route in (chat.ROUTE, completions.ROUTE, embeddings.ROUTE)}
LATER = (429, 503)  # a queue's refusal, no backend up, the store failing over: the line is tried again


def error_body(error: GatewayError) -> Any:
    try:
        return orjson.loads(error.body())
    except orjson.JSONDecodeError:
        return {"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}}


async def handled(proxy: Proxy, call: Call, body: bytes) -> Reply:
    """`proxy.handle(call, body)`; while the line may be preempted, in a task admission may stop: then Preempted."""
    if not PREEMPTIBLE.get():
        return await proxy.handle(call, body)
    task = asyncio.create_task(proxy.handle(call, body))
    with stoppable(call, task.cancel) as stop:
        try:
            return await task  # cancelling this task (the runner stopping) cancels `task` too
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if stop.preempted and (current is None or not current.cancelling()):
                raise Preempted from None
            raise
        except GatewayError:
            if stop.preempted:  # stopped, whatever the call made of it: no answer of the line's own
                raise Preempted from None
            raise


class LineGateway(Configured, Stored, Protocol):
    """What a line needs of the gateway (gateway/wiring.py `Gateway`): the policy and the store (gateway/needs.py's
    shared parts) and the proxy that runs its call."""

    @property
    def proxy(self) -> Proxy | None: ...


class BatchCalls:
    def __init__(self, gateway: LineGateway) -> None:
        self.gateway = gateway

    async def __call__(self, batch: dict[str, Any], line: dict[str, Any]) -> Answer:
        gateway = self.gateway
        request_id = unique_id()
        try:
            key = await gateway.store.get_key(batch["_owner"])
        except StoreUnavailable:
            raise TryLater from None
        if key is None or not key.usable(time.time()):
            return Answer(401, {"error": {"message": INVALID, "type": "invalid_request_error", "param": None,
                                          "code": "invalid_api_key"}}, request_id)
        route = ROUTES[line["url"]]
        call = route.call(request_id, {}, batch["_client"], time.perf_counter(), batch=batch["id"])
        KEY.put(call, key)
        call.rent_allowed = gateway.policy.batch.allow_rented
        proxy = gateway.proxy
        if proxy is None:  # not serving yet
            raise TryLater
        try:
            reply = await handled(proxy, call, orjson.dumps(line["body"]))
        except GatewayError as exc:
            if exc.status in LATER:
                raise TryLater from None
            return Answer(exc.status, error_body(exc), request_id)
        try:
            body = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            body = reply.body.decode("utf-8", "replace")
        return Answer(reply.status, body, request_id)
