"""A key-change listener stops when cancelled, even where redis-py swallows the cancel (redis/redis-py#2551)."""

import asyncio

import pytest

from policies.store.key_events import KeyEvents


class SwallowingPubSub:
    """A pub/sub connection whose read swallows a cancel that lands in it, as redis-py's can inside its own
    read timeout: the read just returns nothing (or, with `fail`, raises a lost connection)."""

    def __init__(self, client: "Client") -> None:
        self.client = client
        self.connection = self
        self.reads = 0

    def register_connect_callback(self, _callback: object) -> None:
        pass

    async def subscribe(self, *_channels: str) -> None:
        pass

    async def get_message(self, timeout: float) -> None:
        self.reads += 1
        try:
            await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            if self.client.honest:  # (only so that a failing test ends)
                raise
            if self.client.fail:
                raise ConnectionError("Connection closed by server.") from None
        return None

    async def ping(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class Client:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.honest = False
        self.opened: list[SwallowingPubSub] = []

    def pubsub(self) -> SwallowingPubSub:
        self.opened.append(SwallowingPubSub(self))
        return self.opened[-1]


@pytest.mark.parametrize("fail", [False, True], ids=["read returns", "read fails"])
async def test_a_listener_whose_read_swallowed_the_cancel_still_stops(fail):
    client = Client(fail)
    events = KeyEvents(client, "t:")  # type: ignore[arg-type]
    task = asyncio.create_task(events.run(lambda key: None, lambda: None))
    await asyncio.sleep(0.1)
    assert client.opened and client.opened[0].reads > 1  # listening
    task.cancel()
    stopped, _ = await asyncio.wait({task}, timeout=2)
    if not stopped:
        client.honest = True
        task.cancel()
    assert stopped and task.cancelled()
