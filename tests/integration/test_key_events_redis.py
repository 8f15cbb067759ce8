"""Key-change announcements on a real redis-server: every listener drops the key before the writer returns,
and a listener that lost Redis drops its whole cache when it is back (messages may have been missed)."""

from __future__ import annotations

import asyncio
import time

from policies.store import open_store
from tests.support.redis_server import RedisServer


async def until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_announce_returns_after_every_listener_dropped_and_an_outage_drops_everything():
    with RedisServer() as redis:
        writer, other = open_store("redis", url=redis.url), open_store("redis", url=redis.url)
        dropped: dict[str, list] = {"writer": [], "other": []}
        cleared: dict[str, int] = {"writer": 0, "other": 0}

        def listen(store, name: str):
            def clear() -> None:
                cleared[name] += 1
            return asyncio.create_task(store.key_events.run(dropped[name].append, clear))

        tasks = [listen(writer, "writer"), listen(other, "other")]
        try:
            await until(lambda: writer.key_events.connected and other.key_events.connected, 20)
            await asyncio.sleep(0.2)  # SUBSCRIBE is answered before PUBLISH may count it
            await writer.key_events.announce("k1")
            assert dropped == {"writer": ["k1"], "other": ["k1"]}  # both, before announce returned

            base = dict(cleared)
            redis.restart()
            await until(lambda: cleared["other"] > base["other"] and cleared["writer"] > base["writer"], 30)
            await until(lambda: other.key_events.connected, 20)
            await asyncio.sleep(0.2)
            await writer.key_events.announce("k2")
            assert dropped["other"][-1] == "k2"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await writer.close()
            await other.close()
