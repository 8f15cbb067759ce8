"""Shadow traffic: a sampled share of a model's requests is also sent to its shadow variant once the live
answer is under way (its first streamed bytes are relayed, or a whole answer's status line is in), and the
shadow's answer is compared with the live one and thrown away.

What keeps a shadow from ever hurting real traffic or leaking:

- it starts only once the live call has its answer coming (so it never competes with it for its first token),
  in the background: the live path only creates a task;
- it goes only to the shadow variant's own (owned) replicas, never to a rented provider, whatever the key's
  data policy: the copy is the cluster's business alone;
- it never enters the pipeline: no rate limit, budget, usage or ledger entry is taken or recorded for it;
- it takes a slot under the shadow variant's own cap or is dropped at once (counted), never queued; and at
  most MAX_PENDING copies are under way in this process. A live call that fails before its answer is under
  way sends no copy (counted as dropped too).

Its answer is read like a live one (policies/variant_signals.py: errors, TTFT, ITL, structured validity) and,
when the live request ran at temperature 0, compared with the live answer (exactly, and as JSON) once the live
call has finished (at most LIVE_WAIT seconds after the copy's). Those figures go to the shadow variant's
window, where the guard reads them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import orjson

from backends.replicas import Replica
from backends.upstream import UpstreamError
from gateway.endpoints.base import ROUTE
from gateway.relay import SSERelay
from policies.admission import Admission
from policies.finished import Finished
from policies.json_types import JSONObject
from policies.metrics import GatewayMetrics
from policies.pipeline import MODEL, Call
from policies.variant_signals import ANSWER, StreamAnswer, agreement, answer_of, compared, sample_of
from policies.variants import SHADOW, Variants

log = logging.getLogger("gateway.variants")

MAX_PENDING = 256
LIVE_WAIT = 600.0  # seconds a finished copy waits for its live call's end, to compare the two
COMPARED = ("chat/completions", "completions")  # the routes whose answers a shadow's are compared with


class Shadow:
    """An observer of finished calls (policies/finished.py) that the proxy also tells when a live answer is under
    way (`start`)."""

    name = "shadow"

    def __init__(self, admission: Admission, metrics: GatewayMetrics, variants: Variants) -> None:
        self.admission = admission  # the snapshot's: its queues hold the shadow variants' slots
        self.metrics = metrics
        self.variants = variants  # where the copy's signals go
        self.tasks: set[asyncio.Task[None]] = set()
        self.live: dict[Call, asyncio.Future[None] | None] = {}  # live calls under way whose copy was handled: until they end

    def start(self, live: Call) -> None:
        """Called once a live call copied to a shadow has its answer under way: send the copy now, in the
        background, unless it would wait."""
        if live.request.route not in COMPARED or live in self.live:
            return
        name, group = SHADOW.of(live)  # only a call copied to a shadow is told its answer is under way
        if len(self.tasks) >= MAX_PENDING:
            self.live[live] = None
            self.dropped(live.model, name)
            return
        done = self.live[live] = asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(self.send(live, name, group, dict(live.body), done))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def observe(self, record: Finished) -> None:
        """A live call copied to a shadow has ended: its copy may compare; a copy never sent (the live call
        failed before its answer was under way) is counted as dropped."""
        live = record.call
        if live is None or SHADOW.get(live) is None or live.request.route not in COMPARED:
            return
        if live not in self.live:
            self.dropped(live.model, SHADOW.of(live)[0])
            return
        done = self.live.pop(live)
        if done is not None and not done.done():
            done.set_result(None)

    def dropped(self, model: str, variant: str) -> None:
        self.metrics.variant_shadow_dropped.labels(model, variant).inc()

    async def send(self, live: Call, name: str, group: str, body: JSONObject, done: asyncio.Future[None]) -> None:
        queue = self.admission.queues.get(group)
        replica = None if queue is None else await queue.take_now(None, (), 0, will_wait=False)
        if replica is None:  # its cap is full (or it has no replica up): dropped, never queued
            self.dropped(live.model, name)
            return
        copy = ROUTE.of(live).call(f"{live.request.id}-shadow", {}, "", time.perf_counter())
        MODEL.put(copy, live.model)
        copy.stream, copy.replica, copy.load = live.stream, replica, replica.server_in_flight
        body["model"] = replica.served_name
        body.pop("priority", None)
        if live.stream:
            body["stream_options"] = {"include_usage": True}
            ANSWER.put(copy, StreamAnswer(whole=True))
        copy.body = body
        try:
            await self.exchange(copy, replica, body, live.request.params)
        except UpstreamError:
            copy.status = 502
        except Exception:  # noqa: BLE001 - a shadow's failure must never reach anyone
            log.exception("shadow copy of request %s failed", live.request.id)
            copy.status = 500
        finally:
            self.admission.release(replica)
        sample = sample_of(copy, time.perf_counter())
        if copy.status < 400 and compared(body):
            try:
                await asyncio.wait_for(asyncio.shield(done), LIVE_WAIT)
            except TimeoutError:
                pass
            else:
                if live.status < 400:
                    sample.exact, sample.agreed = agreement(answer_of(live), answer_of(copy))
        self.variants.record(live.model, name, sample, copy.status)

    async def exchange(self, copy: Call, replica: Replica, body: JSONObject, params: Mapping[str, str]) -> None:
        upstream = replica.upstream
        if upstream is None:  # not connected yet: the app connects the live set before serving
            raise UpstreamError(f"replica {replica.name} has no connection yet")
        copy.sent_at = time.perf_counter()
        response = await upstream.open(ROUTE.of(copy).upstream_path(params), orjson.dumps(body), copy.request.id)
        try:
            copy.status = response.status if response.status < 500 else 502
            if copy.stream and response.status == 200:
                relay = SSERelay(strip_usage=False)  # cut at event boundaries, its usage taken
                answer = ANSWER.of(copy)  # a copy always reads its answer's signals
                while chunk := await response.next_chunk():
                    if not copy.first_token_at:
                        copy.first_token_at = time.perf_counter()
                    answer.feed(relay.feed(chunk))
                answer.feed(relay.flush())
                copy.usage = relay.usage
            else:
                raw = await response.read()
                if response.status == 200:
                    answer_json = orjson.loads(raw)
                    copy.response = answer_json if isinstance(answer_json, dict) else None
                    usage = copy.response.get("usage") if copy.response is not None else None
                    copy.usage = usage if isinstance(usage, dict) else None
        finally:
            response.close()
