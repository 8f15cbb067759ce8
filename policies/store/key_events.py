"""Key changes announced to every gateway replica over Redis pub/sub, so a cached key record never outlives
a change (revocation, data policy, models, limits, budgets) by more than a message's round trip.

The replica that writes a change publishes the key id with a fresh token on `<prefix>keys:changed`. Every
replica, the writer included, listens on that channel: it drops the key from its auth cache, then publishes
the token on `<prefix>keys:dropped`. The writer counts those acknowledgements and returns once as many came
back as PUBLISH said received the change, or after `ACK_WAIT` (it logs how many were missing). The cache's own
TTL stays the fallback for a lost message; a listener that loses its connection doubts its whole cache when
it is back, since messages may have been missed meanwhile (every record is read again on its next use, and
serves meanwhile only as an outage's fallback: policies/auth.py), and reconnects with capped, jittered backoff.

A connection can also freeze without closing (a peer or a middlebox that stops forwarding, no RST): reads
then only time out, and changes would be missed for as long as it lasts. So a listener that heard nothing for
`PING_AFTER` seconds pings on its pub/sub connection, and one that heard nothing, not even the pong, for
`FROZEN_AFTER` seconds treats the connection as lost: it reconnects and doubts its whole cache. A frozen
connection is thus noticed within FROZEN_AFTER plus one read (about 4 s), under the auth cache's TTL.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

log = logging.getLogger("policies.store.key_events")

ACK_WAIT = 1.0  # s the writer waits for every replica to drop its copy
BACKOFF_MAX = 5.0  # s between reconnection attempts, at most
MAX_MESSAGE = 256  # bytes: a key id and a token; anything longer is not ours
READ_WAIT = 1.0  # s one read waits for a message (the client's socket timeout would end a quiet listen())
PING_AFTER = 1.0  # s of silence after which the listener pings on its connection (one ping per read after)
FROZEN_AFTER = 3.0  # s of silence, pings unanswered, after which the connection counts as lost


class FrozenConnection(Exception):
    """The pub/sub connection stayed open but answered nothing, not even pings."""


class KeyEvents:
    def __init__(self, client: Redis | RedisCluster, prefix: str) -> None:
        self.client = client
        self.changed = f"{prefix}keys:changed"
        self.dropped = f"{prefix}keys:dropped"
        self.waiting: dict[str, tuple[asyncio.Event, list[int]]] = {}
        self.connected = False
        self.acking: set[asyncio.Task[Any]] = set()
        self.lost = False  # the pub/sub connection was reopened: messages may have been missed

    async def announce(self, key_id: str) -> None:
        """Tell every replica that `key_id` changed; return once they dropped it (bounded by ACK_WAIT)."""
        token = secrets.token_hex(8)
        done, acks = asyncio.Event(), [0]
        self.waiting[token] = (done, acks)
        try:
            receivers = int(await self.client.publish(self.changed, f"{key_id} {token}"))
            try:
                async with asyncio.timeout(ACK_WAIT):
                    while acks[0] < receivers:
                        await done.wait()
                        done.clear()
            except TimeoutError:
                log.warning("key change: %d of %d replicas acknowledged within %.1f s; the others follow within "
                            "auth.cache_seconds", acks[0], receivers, ACK_WAIT)
        except Exception as exc:  # noqa: BLE001 - Redis down: the other replicas follow within the cache TTL
            log.warning("key change not announced (%s); other replicas follow within auth.cache_seconds",
                        type(exc).__name__)
        finally:
            self.waiting.pop(token, None)

    async def run(self, drop: Callable[[str], None], doubt_all: Callable[[], None]) -> None:
        """Listen for changes until cancelled, reconnecting after an outage.

        redis-py can swallow a cancel that lands inside its own read timeout (redis/redis-py#2551): the read
        then returns, or fails as a lost connection, and a loop that waited for CancelledError listened on,
        so a stopping gateway waited for it for ever (seen in CI: the process never exited after SIGTERM). The
        task's pending cancel is asked after every read and every failure instead."""
        backoff = 0.1
        me = asyncio.current_task()

        def stop_if_cancelled() -> None:
            if me is not None and me.cancelling():
                raise asyncio.CancelledError

        while True:
            stop_if_cancelled()
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.changed, self.dropped)
                # redis-py reconnects a pub/sub connection by itself, silently: hear of it to doubt the cache
                assert pubsub.connection is not None  # subscribe opened it
                pubsub.connection.register_connect_callback(self.reconnected)
                if not self.connected:
                    doubt_all()  # changes made while we were not listening are unknown
                    self.connected = True
                    log.info("listening for key changes")
                backoff = 0.1
                clock = asyncio.get_running_loop().time
                heard = clock()
                while True:
                    message = await pubsub.get_message(timeout=READ_WAIT)
                    stop_if_cancelled()
                    if self.lost:
                        self.lost = False
                        doubt_all()
                        log.info("key change listener reconnected to Redis; every cached key is read again on its"
                                 " next use")
                    if message is not None:
                        heard = clock()  # a pong too: the connection answers
                        self.handle(message, drop)
                    elif clock() - heard > FROZEN_AFTER:
                        raise FrozenConnection(f"no answer on the pub/sub connection for {FROZEN_AFTER:g} s")
                    elif clock() - heard >= PING_AFTER:
                        async with asyncio.timeout(READ_WAIT):  # a send that blocks is a frozen connection too
                            await pubsub.ping()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any loss of the connection: reconnect
                stop_if_cancelled()
                if self.connected:
                    log.warning("key change listener lost Redis (%s); reconnecting, then reading every cached key again",
                                type(exc).__name__)
                self.connected = False
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001 - the connection is already gone
                    pass
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, BACKOFF_MAX)

    def reconnected(self, _connection: object) -> None:
        self.lost = True

    def handle(self, message: dict[str, Any], drop: Callable[[str], None]) -> None:
        if message.get("type") != "message":
            return
        data = message.get("data")
        if not isinstance(data, bytes | str) or len(data) > MAX_MESSAGE:
            return
        text = data.decode(errors="replace") if isinstance(data, bytes) else data
        channel = message.get("channel")
        channel = channel.decode() if isinstance(channel, bytes) else channel
        if channel == self.changed:
            key_id, _, token = text.partition(" ")
            drop(key_id)
            task = asyncio.get_running_loop().create_task(self.ack(token))
            self.acking.add(task)
            task.add_done_callback(self.acking.discard)
        elif channel == self.dropped and text in self.waiting:
            done, acks = self.waiting[text]
            acks[0] += 1
            done.set()

    async def ack(self, token: str) -> None:
        try:
            await self.client.publish(self.dropped, token)
        except Exception:  # noqa: BLE001 - the writer stops waiting after ACK_WAIT
            pass
