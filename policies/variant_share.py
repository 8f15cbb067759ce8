"""Variant weights and guard verdicts shared by every gateway replica through Redis (with the Redis store).

A change made in one replica (the admin API, its guard pulling a candidate back or promoting it) is written
to one hash per model, `{prefix}variants:{model}`: the weights now in force, the weights of the policy file
they were made from, each guarded variant's state and reason, and a version that every write increments.
Every replica reads each model's version every `interval` seconds and adopts a newer document, so three
gateways roll back together within about a second, although each guard sees only its own traffic. A document
made from other file weights (an older policy) is ignored: the file's new weights win until someone changes
them again. Redis being unreachable only delays this: each replica keeps serving with what it has.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from policies.background import Background
from policies.store.redis import RedisStore
from policies.variants import Variants

log = logging.getLogger("gateway.variants")

SHARED = "shared"  # the `why` of a change adopted from another replica (not written back)


class SharedVariants:
    def __init__(self, store: RedisStore, variants: Variants, background: Background,
                 interval: float = 0.5) -> None:
        self.redis = store.client
        self.prefix = store.prefix
        self.variants = variants
        self.background = background
        self.interval = interval
        self.seen: dict[str, int] = {}  # model -> the last version adopted or written
        variants.on_change.append(self.changed)

    def key(self, model: str) -> str:
        return f"{self.prefix}variants:{model}"

    def changed(self, model: str, _before: dict[str, float], weights: dict[str, float], why: str) -> None:
        if not why.startswith(SHARED):
            self.background(self.write(model, dict(weights), why))

    async def write(self, model: str, weights: dict[str, float], why: str) -> None:
        guard = self.variants.guard
        states = {v: guard.state(model, v).view(guard.load_matching_left(model, v)) for v in weights
                  if (model, v) in guard.states}
        doc = {"weights": weights, "filed": self.variants.filed.get(model), "why": why, "guard": states}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.key(model), "version", 1)
            pipe.hset(self.key(model), "doc", orjson.dumps(doc))
            version, _ = await pipe.execute()
        self.seen[model] = int(version)

    async def poll(self) -> None:
        for model in list(self.variants.models):
            version, raw = await self.redis.hmget(self.key(model), ["version", "doc"])
            if version is None or raw is None or int(version) <= self.seen.get(model, 0):
                continue
            self.seen[model] = int(version)
            doc = orjson.loads(raw)
            if doc.get("filed") != self.variants.filed.get(model) or model not in self.variants.models:
                continue  # made from another version of the policy file
            self.variants.adopt(model, doc["weights"], doc.get("guard") or {}, f"{SHARED}: {doc.get('why')}")

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception as exc:  # noqa: BLE001 - Redis away for a moment: keep serving with what we have
                log.debug("variants: shared state not read: %s", type(exc).__name__)
            await asyncio.sleep(self.interval)
