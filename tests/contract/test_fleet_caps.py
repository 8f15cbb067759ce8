"""The Redis side of fleet-wide caps, on a real redis-server: exact counts under races, leases that end,
claims that make the fleet serve the longest waiter first, and one hash slot per backend."""

from __future__ import annotations

import asyncio
import time
from functools import partial

import pytest
from redis.crc import key_slot

from policies.config import Caps
from policies.fleet_caps import FleetModelQueue, FleetSlots
from policies.store import open_store
from tests.support.redis_fixtures import redis_prefix, redis_server  # noqa: F401


@pytest.fixture
async def store(redis_server, redis_prefix):  # noqa: F811
    store = open_store("redis", url=redis_server.url, prefix=redis_prefix)
    yield store
    await store.close()


def fleet(store, lease=30.0, poll=0.2, **caps) -> FleetSlots:
    """One gateway process's view (each has its own process id). A claim goes stale after five polls: 1 s here,
    so a slow machine between two calls of a test does not look like a starved process."""
    return FleetSlots(store, Caps(lease_seconds=lease, poll_interval=poll, **caps))


async def test_racing_processes_get_exactly_the_cap_and_releases_give_it_back(store):
    procs = [fleet(store) for _ in range(3)]
    results = await asyncio.gather(*(procs[i % 3].acquire("b", 8, 0, 0.0, False) for i in range(60)))
    granted = [(procs[i % 3], r.member) for i, r in enumerate(results) if r.member is not None]
    assert len(granted) == 8 and await procs[0].held("b") == 8
    assert max(r.held for r in results) == 8
    for proc, member in granted:
        await proc.release("b", 8, [member])
    assert await procs[0].held("b") == 0


async def test_leases_given_back_with_an_acquire_make_room_for_it_in_the_same_call(store):
    a = fleet(store)
    held = [(await a.acquire("e", 2, 0, 0.0, False))[0] for _ in range(2)]
    assert (await a.acquire("e", 2, 0, 0.0, False))[0] is None  # full
    member, count, _, _ = await a.acquire("e", 2, 0, 0.0, False, give_back=held)
    assert member is not None and count == 1  # both went back, then one was taken
    assert await a.release("e", 2, [member]) == 0


async def test_leases_of_a_process_that_stops_renewing_end_and_renewed_ones_stay(store):
    alive, dead = fleet(store, lease=1.0), fleet(store, lease=1.0)
    kept = [(await alive.acquire("b", 4, 0, 0.0, False))[0] for _ in range(2)]
    for _ in range(2):
        await dead.acquire("b", 4, 0, 0.0, False)
    assert await alive.held("b") == 4
    for _ in range(4):  # 1.2 s: past the dead process's leases; the live one renews every third of a lease
        await asyncio.sleep(0.3)
        held, lost = await alive.renew("b", kept)
        assert lost == 0
    assert held == 2 and await alive.held("b") == 2
    assert (await dead.acquire("b", 4, 0, 0.0, False))[0] is not None  # the room came back


async def test_the_longest_waiting_process_is_served_first(store):
    a, b = fleet(store), fleet(store)
    first = (await a.acquire("b", 1, 0, 0.0, False))[0]
    assert (await b.acquire("b", 1, 0, 2.0, True))[0] is None  # b waits (2 s already) and says so
    await a.release("b", 1, [first])
    assert (await a.acquire("b", 1, 0, 0.5, True))[0] is None  # a asks first, but its waiter is fresher
    assert (await b.acquire("b", 1, 0, 2.1, True))[0] is not None
    assert await store.client.hlen(b.waiting("b")) == 1  # b's claim went with its slot; a's stays


async def test_a_process_whose_waiter_arrived_within_fair_within_takes_the_slot_itself(store):
    """Strict order would hand every freed slot to another process (a refusal and a wake-up per slot); waiters
    that arrived within `caps.fair_within` of each other count as level.

    A claim is when its head arrived, the script's clock less the time waited, so the time between two calls
    here makes a's head look later still. With the default 0.05 s and a's head 20 ms later, 30 ms between two
    round trips (a busy machine, a GC pause) put b first; at 1 s, as the stale bound, they stay level."""
    a, b = fleet(store, fair_within=1.0), fleet(store, fair_within=1.0)
    held = (await a.acquire("f", 1, 0, 0.0, False))[0]
    assert (await b.acquire("f", 1, 0, 2.0, True))[0] is None  # b's head has waited 2 s
    member = (await a.acquire("f", 1, 0, 1.9, True, give_back=[held])).member  # a's has waited 0.1 s less
    assert member is not None
    assert (await a.acquire("f", 1, 0, 0.5, True, give_back=[member]))[0] is None  # 1.5 s less: b goes first
    assert (await b.acquire("f", 1, 0, 2.1, True))[0] is not None


async def test_a_better_class_goes_first_however_long_the_other_waited(store):
    a, b = fleet(store), fleet(store)
    held = (await a.acquire("c", 1, 0, 0.0, False))[0]
    assert (await b.acquire("c", 1, 1, 60.0, True))[0] is None  # batch (rank 1), waiting a minute
    await a.release("c", 1, [held])
    assert (await a.acquire("c", 1, 0, 0.0, False))[0] is not None  # interactive, just arrived: first


async def test_a_class_with_min_share_is_owed_its_share_of_the_leases_freed_while_it_waits(store):
    """Each lease freed while batch (rank 1, min_share 0.5) waits in any process adds 0.5 to its credit; once the
    credit is whole the next slot is batch's, although interactive (rank 0) asks for it too."""
    shares = "0 0.5"
    a, b = fleet(store), fleet(store)
    held = (await a.acquire("ms", 1, 0, 0.0, False, shares=shares)).member
    assert (await b.acquire("ms", 1, 1, 1.0, True, shares=shares)).member is None  # batch waits in b
    got = await a.acquire("ms", 1, 0, 0.0, True, give_back=[held], shares=shares)  # credit 0.5: interactive's
    assert got.member is not None and got.due is None
    refused = await a.acquire("ms", 1, 0, 0.0, True, give_back=[got.member], shares=shares)  # credit 1: batch's
    assert refused.member is None and refused.due == 1
    granted = await b.acquire("ms", 1, 1, 1.1, True, shares=shares)
    assert granted.member is not None and granted.due is None  # its credit spent
    await b.release("ms", 1, [granted.member], shares)  # batch waits no more: interactive's again
    assert (await a.acquire("ms", 1, 0, 0.0, True, shares=shares)).member is not None


async def test_a_starved_class_estimates_its_wait_from_the_fleets_rate_not_this_processs(store):
    """This process frees 10 slots a second holding 1 of a backend's 4 leases; the fleet so frees about 40, a
    fifth of them batch's (min_share 0.2), shared with one other process whose batch waits: 4 a second here,
    so a batch request with one ahead of it expects 0.5 s (this process's own rate alone would say 1 s)."""
    import random

    from backends.replicas import Replica
    from policies.config import Priorities, PriorityClass, Queue
    from policies.metrics import GatewayMetrics
    from policies.routing.least_in_flight import LeastInFlight
    from policies.routing.pickers import MaxScore
    from policies.routing.profile import Profile

    replica = Replica(name="r0", model="m", url="http://10.0.0.1:1", served_name="m", cap=4)
    priorities = Priorities(classes=[PriorityClass(name="interactive"),
                                     PriorityClass(name="batch", max_wait=300, min_share=0.2)])
    q = FleetModelQueue("m", [replica], Queue(max_wait=30), Profile([(LeastInFlight(), 1.0)],
                        picker=MaxScore(random.Random(0))), GatewayMetrics(), priorities, fleet=fleet(store),
                        on_store_failure="fail_closed")
    now = __import__("time").monotonic()
    for i in range(11):
        q.drain.tick(now - 1.0 + i * 0.1)
    replica.in_flight, q.fleet_count[replica], q.peers[1] = 1, 4, 1
    assert q.share_rate(1) == pytest.approx(4.0)
    q.line.depths[1] = 1  # one batch request waits ahead
    assert q.starved_wait(1) == pytest.approx(0.5)


async def test_a_claim_not_refreshed_for_five_polls_holds_nobody_back(store):
    a, slow = fleet(store), fleet(store)
    held = (await a.acquire("s", 1, 0, 0.0, False))[0]
    assert (await slow.acquire("s", 1, 0, 9.0, True))[0] is None  # slow waits, longest
    await a.release("s", 1, [held])
    assert (await a.acquire("s", 1, 0, 0.0, True))[0] is None  # slow's claim is fresh: it goes first
    await asyncio.sleep(slow.stale + 0.05)  # slow stops polling (starved of CPU, say)
    assert (await a.acquire("s", 1, 0, 0.0, True))[0] is not None  # the slot does not wait for it


async def test_a_claim_not_refreshed_holds_nobody_back(store):
    a, gone = fleet(store), fleet(store)
    seconds, micros = await store.client.time()
    now = seconds + micros / 1e6
    await store.client.hset(gone.waiting("d"), f"{gone.process}|0", f"0.000000 {now:.6f}")  # waiting since 1970
    assert (await a.acquire("d", 1, 0, 0.0, False))[0] is None  # a live claim ahead: no room for a
    await store.client.hset(gone.waiting("d"), f"{gone.process}|0", f"0.000000 {now - 5:.6f}")  # its process died
    assert (await a.acquire("d", 1, 0, 0.0, False))[0] is not None
    assert await store.client.hlen(gone.waiting("d")) == 0


@pytest.mark.parametrize("setup", ["redis", "redis-cluster"])
async def test_room_left_by_one_process_wakes_the_one_first_in_line(setup, store):
    a, b, c = fleet(store), fleet(store), fleet(store)
    held = (await a.acquire("w", 1, 0, 0.0, False))[0]
    assert (await b.acquire("w", 1, 0, 3.0, True))[0] is None  # b waits longest
    assert (await c.acquire("w", 1, 0, 1.0, True))[0] is None
    assert not await b.woken("w", 0.05)  # nothing pushed yet: the wait times out
    waiting = asyncio.create_task(b.woken("w", 2.0))
    await asyncio.sleep(0.05)
    for proc, waited in ((b, 3.2), (c, 1.2)):  # their polls refresh the claims (a claim left alone goes stale)
        assert (await proc.acquire("w", 1, 0, waited, True))[0] is None
    await a.release("w", 1, [held])
    assert await asyncio.wait_for(waiting, 1.0)  # b, first in line, was woken by a's release
    assert not await c.woken("w", 0.05)  # c was not
    # a process that gives back and is refused (others ahead) wakes the first in line too
    held = (await b.acquire("w", 1, 0, 3.3, True))[0]
    assert held is not None
    assert (await c.acquire("w", 1, 0, 1.3, True))[0] is None  # c polls on
    assert (await b.acquire("w", 1, 0, 0.1, True, give_back=[held]))[0] is None  # c's waiter waited longer
    assert await c.woken("w", 0.5)
    assert not await b.woken("w", 0.05)


def test_every_key_of_a_backend_is_in_one_cluster_slot():
    class Store:
        prefix = "llmgw:"

        def script(self, source):
            return None

    f = FleetSlots(Store(), Caps())
    assert key_slot(f.leases("chat-0").encode()) == key_slot(f.waiting("chat-0").encode())
    assert key_slot(f.leases("chat-0").encode()) == key_slot(f.wake_list("chat-0").encode())
    assert key_slot(f.leases("chat-0").encode()) != key_slot(f.leases("chat-1").encode())


async def test_requests_that_go_away_while_their_slot_is_on_its_way_leave_no_lease(store):
    """A client that disconnects cancels its request while the acquire's script may already have run in Redis:
    the lease it granted must come back at once, not sit there until it ends (a minute, by default)."""
    from policies.admission import Admission
    from policies.compile import replica_set
    from policies.config import parse_policy, profile_of
    from policies.metrics import GatewayMetrics
    from policies.routing import Stats, build_profile

    policy = parse_policy('models: [{name: m, backends: [{url: "http://127.0.0.1:9", cap: 8}]}]\n'
                          'caps: {lease_seconds: 60, poll_interval: 0.02}')
    replicas = replica_set(policy)
    for r in replicas:
        r.state = "up"
    metrics = GatewayMetrics()
    profiles = {m.name: build_profile(profile_of(policy, m)[1], m.name, Stats(None), metrics) for m in policy.models}
    slots = FleetSlots(store, policy.caps)
    admission = Admission(policy, replicas, profiles, metrics,
                          partial(FleetModelQueue, fleet=slots, on_store_failure="fail_closed"))
    rng = __import__("random").Random(3)

    async def one() -> None:
        asked = asyncio.create_task(admission.acquire("m", "owner"))
        await asyncio.sleep(rng.uniform(0, 0.003))  # often while the script's reply is on its way
        asked.cancel()
        try:
            replica = await asked
        except asyncio.CancelledError:
            return
        await asyncio.sleep(rng.uniform(0, 0.002))
        admission.release(replica)

    for _ in range(20):
        await asyncio.gather(*(one() for _ in range(16)))
    backend = replicas.by_model["m"][0]
    assert backend.in_flight == 0
    # past the batching of given-back leases (2 ms) and the store's round trips for the last of them; bounded far
    # under the 60 s lease, so a lease left to end on its own still fails
    await asyncio.sleep(0.1)
    deadline = time.monotonic() + 5
    while (held := await slots.held(backend.name)) != 0:
        assert time.monotonic() < deadline, f"{held} leases of requests that went away stayed"
        await asyncio.sleep(0.05)
    await admission.close()
