"""The batcher both kinds of give-back share (cap leases, rate-limit slots): policies/store/release_batch.py."""

from __future__ import annotations

import asyncio

from policies.store.release_batch import ReleaseBatch


class Sink:
    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.arrived = asyncio.Event()

    async def send(self, batch: dict) -> None:
        await asyncio.sleep(0)  # a round trip's suspension
        self.sent.append(batch)
        self.arrived.set()


async def test_what_is_queued_meanwhile_goes_in_one_send_every_key_at_once():
    sink = Sink()
    batch = ReleaseBatch(sink.send, delay=0.001)
    batch.add("a", 1)
    batch.add("b", 2)
    batch.add("a", 3)
    await asyncio.wait_for(sink.arrived.wait(), 5)
    assert sink.sent == [{"a": [1, 3], "b": [2]}]
    assert batch.queued == {} and batch.timer is None
    sink.arrived.clear()
    batch.add("c", 4)  # a later give-back arms a timer of its own
    await asyncio.wait_for(sink.arrived.wait(), 5)
    assert sink.sent[1:] == [{"c": [4]}]


async def test_a_key_taken_for_a_call_of_its_own_is_not_sent_again():
    sink = Sink()
    batch = ReleaseBatch(sink.send, delay=3600.0)
    batch.add("a", 1)
    batch.add("b", 2)
    assert batch.take("a") == [1] and batch.take("a") == []
    await batch.close()  # the timer never fires here: close sends what is left, at once
    assert sink.sent == [{"b": [2]}]


async def test_close_waits_for_a_flush_already_on_its_way():
    gate = asyncio.Event()
    sent: list[dict] = []

    async def slow(got: dict) -> None:
        await gate.wait()
        sent.append(got)

    batch = ReleaseBatch(slow, delay=0.0)
    batch.add("a", 1)
    async with asyncio.timeout(5):
        while not batch.flushing:  # the timer fired: its flush waits on the store
            await asyncio.sleep(0.001)
    closing = asyncio.create_task(batch.close())
    await asyncio.sleep(0.01)
    assert not closing.done()
    gate.set()
    await asyncio.wait_for(closing, 5)
    assert {"a": [1]} in sent
