"""Key-change announcements on a real redis-server: every listener drops the key before the writer returns,
and a listener that lost Redis, or whose connection froze without closing, drops its whole cache when it is
back (messages may have been missed)."""

from __future__ import annotations

import asyncio
import time

from policies.store import open_store
from policies.store.key_events import FROZEN_AFTER, READ_WAIT
from tests.support.redis_server import RedisServer
from tests.support.servers import free_port
from tests.support.tcp_proxy import tcp_proxy


async def until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def until_subscribed(events, count: int, timeout: float = 20) -> None:
    """Until Redis counts `count` subscribers on the key-change channel (PUBSUB NUMSUB): a listener is
    `connected` once its SUBSCRIBE is sent, and a PUBLISH that Redis runs before that SUBSCRIBE reaches nobody."""
    deadline = time.monotonic() + timeout
    while True:  # bounded: the deadline
        [(_, subscribed)] = await events.client.pubsub_numsub(events.changed)
        if int(subscribed) >= count:
            return
        assert time.monotonic() < deadline, f"{subscribed} of {count} listeners subscribed in Redis"
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
            await until_subscribed(writer.key_events, 2)
            await writer.key_events.announce("k1")
            assert dropped == {"writer": ["k1"], "other": ["k1"]}  # both, before announce returned

            base = dict(cleared)
            redis.restart()
            await until(lambda: cleared["other"] > base["other"] and cleared["writer"] > base["writer"], 30)
            await until(lambda: other.key_events.connected, 20)
            await until_subscribed(writer.key_events, 2)  # the restarted Redis knows only the new connections
            await writer.key_events.announce("k2")
            assert dropped["other"][-1] == "k2"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await writer.close()
            await other.close()


async def test_a_listener_whose_connection_froze_without_closing_reconnects_and_drops_its_cache():
    """Its connection to Redis goes through a proxy that stops forwarding without closing (no RST): reads only
    time out. The listener's unanswered pings give it away within FROZEN_AFTER and a read; it reconnects and
    drops its cache (a change it missed meanwhile goes with it), then hears changes again."""
    with RedisServer() as redis:
        async with tcp_proxy("127.0.0.1", redis.port, free_port()) as proxy:
            writer = open_store("redis", url=redis.url)
            listener = open_store("redis", url=f"redis://127.0.0.1:{proxy.port}/0")
            dropped: list[str] = []
            cleared = [0]

            def clear() -> None:
                cleared[0] += 1

            task = asyncio.create_task(listener.key_events.run(dropped.append, clear))
            try:
                await until(lambda: listener.key_events.connected, 20)
                await until_subscribed(writer.key_events, 1)
                await writer.key_events.announce("k1")
                assert dropped == ["k1"]

                base = cleared[0]
                assert proxy.freeze() >= 1
                frozen_at = time.monotonic()
                await writer.key_events.announce("k2")  # still subscribed in Redis, but nothing reaches it
                assert "k2" not in dropped
                await until(lambda: cleared[0] > base, 30)  # reconnected through a new connection, cache dropped
                noticed = time.monotonic() - frozen_at
                # FROZEN_AFTER of silence plus one read, and the reconnection; generous for a loaded machine
                assert noticed < 3 * (FROZEN_AFTER + READ_WAIT), noticed

                # the frozen connection stays open (and subscribed) in Redis: the new one makes two
                await until_subscribed(writer.key_events, 2)
                await writer.key_events.announce("k3")
                await until(lambda: "k3" in dropped, 10)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await writer.close()
                await listener.close()
