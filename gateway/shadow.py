"""Shadow traffic: a sampled share of a model's requests is also sent to its shadow variant, once the live
answer is complete, and the shadow's answer is compared with it and thrown away.

What keeps a shadow from ever hurting real traffic or leaking:

- it starts only after the live call finished (its client has its whole answer), in the background;
- it goes only to the shadow variant's own (owned) replicas, never to a rented provider, whatever the key's
  data policy: the copy is the cluster's business alone;
- it never enters the pipeline: no rate limit, budget, usage or ledger entry is taken or recorded for it;
- it takes a slot under the shadow variant's own cap or is dropped at once (counted), never queued; and at
  most MAX_PENDING copies are under way in this process.

Its answer is read like a live one (policies/variant_signals.py: errors, TTFT, ITL, structured validity) and,
when the live request ran at temperature 0, compared with the live answer (exactly, and as JSON). Those
figures go to the shadow variant's window, where the guard reads them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from backends.upstream import UpstreamError
from policies.pipeline import Call
from policies.variant_signals import agreement, answer_of, sample_of, sse_events

log = logging.getLogger("gateway.variants")

MAX_PENDING = 256
COMPARED = ("chat/completions", "completions")  # the routes whose answers a shadow's are compared with


class Shadow:
    def __init__(self, proxy, variants) -> None:
        self.proxy = proxy
        self.variants = variants  # policies.variants.Variants: where the copy's signals go
        self.tasks: set[asyncio.Task] = set()

    def after(self, live: Call) -> None:
        """Called once a live call copied to a shadow has finished: send the copy, unless it would wait."""
        name, group = live.shadow
        if live.endpoint not in COMPARED:
            return
        if live.status >= 400 or len(self.tasks) >= MAX_PENDING:
            self.dropped(live.model, name)
            return
        task = asyncio.get_running_loop().create_task(self.send(live, name, group))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def dropped(self, model: str, variant: str) -> None:
        self.proxy.metrics.variant_shadow_dropped.labels(model, variant).inc()

    async def send(self, live: Call, name: str, group: str) -> None:
        queue = self.proxy.admission.queues.get(group)
        replica = None if queue is None else await queue.take_now(None, (), 0, will_wait=False)
        if replica is None:  # its cap is full (or it has no replica up): dropped, never queued
            self.dropped(live.model, name)
            return
        copy = Call(f"{live.request_id}-shadow", live.endpoint, {}, "", time.perf_counter())
        copy.model, copy.stream, copy.route, copy.replica, copy.load = live.model, live.stream, live.route, \
            replica, replica.in_flight
        body = dict(live.body)
        body["model"] = replica.served_name
        body.pop("priority", None)
        if live.stream:
            body["stream_options"] = {"include_usage": True}
            copy.tap = []
        copy.body = body
        try:
            await self.exchange(copy, replica, body, live.params)
        except UpstreamError:
            copy.status = 502
        except Exception:  # noqa: BLE001 - a shadow's failure must never reach anyone
            log.exception("shadow copy of request %s failed", live.request_id)
            copy.status = 500
        finally:
            self.proxy.admission.release(replica)
        sample = sample_of(copy, time.perf_counter())
        temperature = live.body.get("temperature")
        if copy.status < 400 and temperature == 0 and not isinstance(temperature, bool):
            sample.exact, sample.agreed = agreement(answer_of(live), answer_of(copy))
        self.variants.record(live.model, name, sample, copy.status)

    async def exchange(self, copy: Call, replica, body: dict, params: dict) -> None:
        upstream = self.proxy.upstreams.get(replica) or self.proxy.add_upstream(replica)
        copy.sent_at = time.perf_counter()
        response = await upstream.open(copy.route.upstream_path(params), orjson.dumps(body), copy.request_id)
        try:
            copy.status = response.status if response.status < 500 else 502
            if copy.stream and response.status == 200:
                while chunk := await response.next_chunk():
                    if not copy.first_token_at:
                        copy.first_token_at = time.perf_counter()
                    copy.tap.append(chunk)
                events = [e for e in sse_events(copy.tap) if e.get("usage")]
                copy.usage = events[-1]["usage"] if events else None
            else:
                raw = await response.read()
                if response.status == 200:
                    copy.response = orjson.loads(raw)
                    copy.usage = copy.response.get("usage") if isinstance(copy.response, dict) else None
        finally:
            response.close()

