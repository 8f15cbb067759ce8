"""Pipeline steps: who is calling (Authenticate) and what that key may use (Authorize).

Every failure to authenticate gets the same 401, whatever was wrong (missing, malformed, unknown, expired,
revoked, wrong secret), and never echoes the key. Verified records are cached per process for
`auth.cache_seconds`; on Redis a change is also announced to every replica at once (policies/store/key_events.py),
so the TTL is only the bound when such a message is lost. While the
store cannot be reached (an outage, a Redis failover) a record verified within `auth.stale_seconds` is used
as it was, so keys issued before the failover keep working; a key never seen by this process gets a 503.
A key's team (policies/teams.py) is looked up and cached the same way, under `team:<name>`, and announced the
same way when it changes; Authorize holds the call to the team's models and data policy as well as the key's.
Calls that miss the cache together (its entry expired under load: 64 calls in flight at one moment) share one
store read per id, instead of one each.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from backends.egress import inside, networks
from policies.background import Background
from policies.errors import AuthenticationFailed, PermissionDenied, StateUnavailable
from policies.keys import KeyRecord, key_id_of
from policies.pipeline import KEY, TEAM, Call
from policies.store import Store, StoreUnavailable
from policies.teams import OWNER_PREFIX, TeamRecord

INVALID = "Incorrect or missing API key. Pass a valid key as `Authorization: Bearer sk-...`."
MAX_HEADER = 512
CACHE_ENTRIES = 10_000
TOUCH_EVERY = 60.0  # seconds between last_used_at writes for one key, per process


def bearer_key(authorization: str | None) -> str | None:
    if not authorization or len(authorization) > MAX_HEADER:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


Cached = KeyRecord | TeamRecord  # a team's id is `team:<name>`, never a key's (hex)


class KeyCache:
    """key id (or team:<name>) -> (record, fetched at): a small LRU with a time bound.

    `doubt_all` (the key-change listener (re)connected: changes made while it was not listening are unknown)
    makes every record fetched until then unfit to serve while the store answers (each is read again on its
    next use), yet still the outage fallback within `keep`, as any record is: a record verified just before an
    outage keeps serving through it (`auth.stale_seconds`), even when the listener connected in between."""

    def __init__(self, ttl: float, keep: float = 0.0) -> None:
        self.ttl = ttl
        self.keep = keep  # how long an entry may serve while the store is unreachable
        self.entries: OrderedDict[str, tuple[Cached, float]] = OrderedDict()
        self.doubted_until = -math.inf  # monotonic: records fetched then or earlier are read again
        self.reading: dict[str, asyncio.Future[Cached | None]] = {}  # id -> the read a call may join
        # every read under way whose record may still be cached -> its id (`drop` takes a changed record's out)
        self.in_flight: dict[asyncio.Future[Cached | None], str] = {}

    def get(self, key_id: str, now: float, ttl: float | None = None) -> Cached | None:
        """The record if fetched less than `ttl` ago; by default, the cache's own TTL and not doubted since."""
        entry = self.entries.get(key_id)
        if entry is None or now - entry[1] >= (self.ttl if ttl is None else ttl):
            return None
        if ttl is None and entry[1] <= self.doubted_until:
            return None
        self.entries.move_to_end(key_id)
        return entry[0]

    def put(self, record: Cached, now: float) -> None:
        if self.ttl <= 0 and self.keep <= 0:
            return
        self.entries[record.id] = (record, now)
        self.entries.move_to_end(record.id)
        while len(self.entries) > CACHE_ENTRIES:
            self.entries.popitem(last=False)

    async def read(self, entry: str, fetch: Callable[[], Awaitable[Cached | None]]) -> Cached | None:
        """`fetch()` from the store, one at a time per id: a call that misses while a read of its id is under
        way awaits that read's answer (or its StoreUnavailable) rather than starting another. A read shared
        this way outlives a caller that gives up on it (the client went away): the others still await it."""
        reading = self.reading.get(entry)
        if reading is None:
            started = time.monotonic()
            reading = self.reading[entry] = asyncio.ensure_future(fetch())
            self.in_flight[reading] = entry
            reading.add_done_callback(lambda done: self.read_done(entry, done, started))
        return await asyncio.shield(reading)

    def read_done(self, entry: str, done: asyncio.Future[Cached | None], started: float) -> None:
        """A read ended: its record is cached as fetched when the read began, so a `doubt_all` since leaves it
        doubted (read again on its next use, yet the outage fallback), as a read of one's own would be; a
        read of a record dropped under it is not cached at all, nor one older than the entry already held."""
        if self.reading.get(entry) is done:
            del self.reading[entry]
        if self.in_flight.pop(done, None) is None:  # dropped while it was read
            return
        if done.cancelled() or done.exception() is not None:  # retrieved here too: its callers may have gone
            return
        record = done.result()
        held = self.entries.get(entry)
        if record is not None and (held is None or held[1] < started):
            self.put(record, started)

    def drop(self, key_id: str) -> None:
        """The record changed: forget it, and any read of it under way (it may predate the change), so the
        next call reads it again."""
        self.entries.pop(key_id, None)
        self.reading.pop(key_id, None)
        for reading in [reading for reading, entry in self.in_flight.items() if entry == key_id]:
            del self.in_flight[reading]

    def doubt_all(self) -> None:
        """Changes may have been missed: every record fetched until now is read again on its next use, and
        a call from now on starts a read of its own rather than join one that began before."""
        self.doubted_until = time.monotonic()
        self.reading.clear()


class Authenticate:
    name = "authenticate"
    writes = (KEY, TEAM)

    def __init__(self, store: Store, cache_seconds: float, background: Background, stale_seconds: float = 0.0,
                 on_outage: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.cache = KeyCache(cache_seconds, max(cache_seconds, stale_seconds))
        self.on_outage = on_outage or (lambda outcome: None)  # told "cached" or "refused" per lookup
        self.background = background  # schedules store writes off the request path
        self.touched: dict[str, float] = {}

    async def enter(self, call: Call) -> None:
        key = call.key
        if key is None:  # a batch's line comes with its key's record, checked as it was read; a request
            key = await self.verify(call.request.headers.get("authorization"))  # with its head's (gateway/)
            KEY.put(call, key)
        if key.team is not None:  # most keys have none: no coroutine made for them
            team = await self.team_of(key)
            if team is not None:
                TEAM.put(call, team)

    async def team_of(self, key: KeyRecord) -> TeamRecord | None:
        """The key's team (cached as keys are); 403 if it names a team that no longer exists."""
        if key.team is None:
            return None
        entry = OWNER_PREFIX + key.team
        mono = time.monotonic()
        team = self.cache.get(entry, mono)
        if team is None:
            name = key.team
            try:
                team = await self.cache.read(entry, lambda: self.store.get_team(name))
            except StoreUnavailable:
                team = self.cache.get(entry, mono, self.cache.keep)
                self.on_outage("refused" if team is None else "cached")
                if team is None:
                    raise StateUnavailable("the key store is unavailable; try again shortly") from None
        if not isinstance(team, TeamRecord):
            raise PermissionDenied(f"this API key's team {key.team} no longer exists", code="team_not_found")
        return team

    async def verify(self, authorization: str | None) -> KeyRecord:
        key = bearer_key(authorization)
        key_id = key_id_of(key) if key else None
        if key_id is None or key is None:
            raise AuthenticationFailed(INVALID)
        now = time.time()
        mono = time.monotonic()
        record = self.cache.get(key_id, mono)
        if record is None:
            try:
                record = await self.cache.read(key_id, lambda: self.store.get_key(key_id))
            except StoreUnavailable:
                record = self.cache.get(key_id, mono, self.cache.keep)
                self.on_outage("refused" if record is None else "cached")
                if record is None:
                    raise StateUnavailable("the key store is unavailable; try again shortly") from None
        if not isinstance(record, KeyRecord) or not record.matches(key, now) or not record.usable(now):
            raise AuthenticationFailed(INVALID)
        if mono - self.touched.get(key_id, -TOUCH_EVERY) >= TOUCH_EVERY:
            self.touched[key_id] = mono
            self.background(self.store.touch_key(key_id, now))
        return record

    async def may_rent_now(self, call: Call) -> bool:
        """Whether the call's key, as the store holds it at this moment, still lets it reach a rented provider:
        asked right before renting, however long ago the call was admitted (it may have queued while an admin
        made its key or team `private_only`, or revoked it; a batch line carries the record its batch was read
        with). Read from the store, not the cache: renting is rare, and a change announced late must not let
        one private prompt out. The fresh records replace the cached ones. A store that cannot answer says no."""
        key = call.key
        if key is None:
            return False
        try:
            record = await self.store.get_key(key.id)
            team = await self.store.get_team(record.team) if record is not None and record.team else None
        except StoreUnavailable:
            return False
        mono = time.monotonic()
        if not isinstance(record, KeyRecord) or not record.usable(time.time()):
            return False
        self.cache.put(record, mono)
        if team is not None:
            self.cache.put(team, mono)
        if record.data_policy != "allow_rented" or (record.models is not None and call.model not in record.models):
            return False
        return record.team is None or (isinstance(team, TeamRecord) and team.data_policy != "private_only")

    async def leave(self, call: Call) -> None:
        pass


class Authorize:
    """The key may use this model, from this client address."""

    name = "authorize"
    writes = ()  # only the call's own fields

    async def enter(self, call: Call) -> None:
        key = call.key
        assert key is not None  # the key step ran first
        if key.models is not None and call.model not in key.models:
            raise PermissionDenied(f"this API key may not use model {call.model}", param="model",
                                   code="model_not_allowed")
        team = call.team
        if team is not None:  # checked here too: a key's own settings are kept inside its team's when written
            if team.models is not None and call.model not in team.models:
                raise PermissionDenied(f"this API key's team {team.name} may not use model {call.model}",
                                       param="model", code="model_not_allowed")
            if team.data_policy == "private_only":
                call.rent_allowed = False
        check_key_source(key, call.client_host)

    async def leave(self, call: Call) -> None:
        pass


def check_key_source(key: KeyRecord, client_host: str) -> None:
    """403 when the key is limited to networks the client is not in (shared by /v1/models)."""
    if key.allowed_cidrs and not inside(client_host, networks(key.allowed_cidrs)):
        raise PermissionDenied("this API key may not be used from this network", code="source_not_allowed")

