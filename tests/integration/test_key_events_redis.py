"""Key-change announcements on a real redis-server: every listener drops the key before the writer returns,
and a listener that lost Redis, or whose connection froze without closing, reads every cached key again when it is
back (messages may have been missed)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from tools.simulator import SimConfig
from tools.simulator import create_app as create_sim
from gateway.app import create_app as gateway_app
from policies.config import Policy
from policies.keys import KeyRecord, hash_key, key_id_of, new_key, new_key_id
from policies.store import open_store
from policies.store.key_events import FROZEN_AFTER, READ_WAIT
from tests.support.redis_server import RedisServer
from tests.support.servers import free_port, serve_app
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
    doubts its cache (a change it missed meanwhile is read on the next use), then hears changes again."""
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


async def test_a_key_verified_before_the_listener_reconnected_is_read_again_yet_still_serves_an_outage(caplog):
    """The gateway's own listener, on a real Redis that restarts: once it listens again, each key it verified
    before is read again on its next use (a revocation written while it was away, unannounced, is seen at
    once), while one not used since still serves through the outage that follows (auth.stale_seconds), as a
    record verified just before an outage must, whenever the listener (re)connected in between (a gateway
    whose listener subscribed only after its first requests refused them all in an outage: 503)."""
    caplog.set_level(logging.INFO, logger="policies.store.key_events")
    keys = {name: new_key(new_key_id()) for name in ("kept", "revoked")}
    records = {name: KeyRecord(id=key_id_of(key), name=name, created_at=time.time(), hash=hash_key(key))
               for name, key in keys.items()}

    def listening() -> int:  # its first subscription, and each time it found itself reconnected
        return sum(("listening for key changes" in r.getMessage() or "listener reconnected" in r.getMessage())
                   for r in caplog.records)

    with RedisServer() as redis:
        async with serve_app(create_sim(SimConfig(model="served-m"))) as backend:
            app = gateway_app(Policy.model_validate({
                "models": [{"name": "m", "served_name": "served-m", "backends": [{"url": backend}]}],
                "store": {"kind": "redis", "url": redis.url, "prefix": "doubt:"},
                "auth": {"cache_seconds": 120}}))
            for record in records.values():
                await app.state.store.create_key(record)
            async with serve_app(app) as gw, httpx.AsyncClient(base_url=gw, timeout=30) as http:
                async def status(name: str) -> int:
                    r = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {keys[name]}"},
                                        json={"model": "m", "max_tokens": 1, "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
                    return r.status_code

                assert [await status("kept"), await status("revoked")] == [200, 200]  # both verified, cached
                await until(lambda: listening() >= 1, 20)
                redis.restart()  # the listener loses Redis and listens again: it may have missed a change
                await until(lambda: listening() >= 2, 30)
                writer = open_store("redis", url=redis.url, prefix="doubt:")
                try:  # revoked behind the gateway's back: no announcement
                    await writer.put_key(records["revoked"].model_copy(update={"revoked": True}))
                finally:
                    await writer.close()
                assert await status("revoked") == 401  # read again, though cached for 120 s
                redis.stop()
                assert await status("kept") == 200  # verified within stale_seconds: serves through the outage
