"""Rate limits in Redis, so N gateway replicas enforce one global limit.

One Lua script per admission (every bucket and slot of every scope checked and taken atomically, one round
trip). Releases are off the request path and batched: a release travels with the next admission of the same
scopes (the script applies it first), or within 2 ms in one call with every other release of those scopes, so
under load a request costs one script call, not two. Time comes from the Redis server (TIME), so replicas'
clocks never disagree.

    P rl:{<scope>}:requests     hash  l (level), t (time): the requests-per-minute bucket
    P rl:{<scope>}:tokens       hash  the same for tokens
    P rl:{<scope>}:inflight     zset  member (request) -> lease expiry

The braces are a Cluster hash tag: one scope's three keys share a slot. A request's key scope and model scope
do not, so on a Cluster admission runs the script once per scope, each atomic on its own slot, all sent at
once; if one refuses, what the others took is given back (UNDO). No limit is ever exceeded: every take is
checked atomically against its own limit, and a give-back only returns what was taken. The price: a refused
request costs a second round trip, and briefly holds the other scopes' share (that can cause a refusal, never
an excess). docs/redis-ha.md has the figures. On one server or behind Sentinel every slot is on the same
server, and the one-call script runs as before.
"""

from __future__ import annotations

import asyncio
import time

from policies.ratelimit.base import Decision, Scope, Ticket
from policies.store import StoreError
from policies.store.redis import RedisStore
from policies.store.pipelined import Arg, row
from policies.store.release_batch import ReleaseBatch

LEVEL = """
local function level(key, cap, now)
  local v = redis.call('HMGET', key, 'l', 't')
  if not v[1] then return cap end
  local l = tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * cap / 60
  if l > cap then return cap end
  return l
end
local function save(key, l, now)
  redis.call('HSET', key, 'l', string.format('%.6f', l), 't', string.format('%.6f', now))
  redis.call('EXPIRE', key, 3600)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# Releases first: ARGV[first], [first + 1], ... are (member, refund) pairs; `tok` and `inflight` name a scope's
# tokens and inflight keys, `tpm` and `maxc` its limits (0 = none).
GIVE_BACK = """
local function give_back(first, tok, inflight, tpm, maxc)
  local refund = 0
  for j = first, #ARGV, 2 do
    refund = refund + tonumber(ARGV[j + 1])
    if maxc > 0 then redis.call('ZREM', inflight, ARGV[j]) end
  end
  if tpm > 0 and refund ~= 0 then save(tok, math.min(tpm, level(tok, tpm, now) + refund), now) end
end
"""

# KEYS: 3 per scope (requests, tokens, inflight). ARGV: n, cost, member, lease, then rpm, tpm, max per scope
# (0 = no limit), then (member, refund) pairs of earlier admissions to release first. Returns {admitted 1/0, refusing scope index, kind, retry after seconds, then scope 0's
# request level, request reset, token level, token reset} ('' where a scope has no such limit).
ACQUIRE = LEVEL + GIVE_BACK + """
local n, cost, member, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
if #ARGV > 4 + n * 3 then
  for i = 0, n - 1 do
    give_back(5 + n * 3, KEYS[2 + i * 3], KEYS[3 + i * 3], tonumber(ARGV[6 + i * 3]), tonumber(ARGV[7 + i * 3]))
  end
end
local plan = {}
for i = 0, n - 1 do
  local rpm, tpm, maxc = tonumber(ARGV[5 + i * 3]), tonumber(ARGV[6 + i * 3]), tonumber(ARGV[7 + i * 3])
  local rl, tl = false, false
  if rpm > 0 then rl = level(KEYS[1 + i * 3], rpm, now) end
  if tpm > 0 then tl = level(KEYS[2 + i * 3], tpm, now) end
  plan[i] = {rpm, tpm, maxc, rl, tl}
end
local function report(out)
  local rpm, tpm, maxc, rl, tl = unpack(plan[0])
  if rl then out[5] = tostring(rl); out[6] = tostring((rpm - rl) / (rpm / 60)) end
  if tl then out[7] = tostring(tl); out[8] = tostring((tpm - tl) / (tpm / 60)) end
  return out
end
for i = 0, n - 1 do
  local rpm, tpm, maxc, rl, tl = unpack(plan[i])
  if rl and rl < 1 then return report({0, i, 'requests', tostring((1 - rl) / (rpm / 60)), '', '', '', ''}) end
  if tl and math.min(cost, tpm) > tl then
    return report({0, i, 'tokens', tostring((math.min(cost, tpm) - tl) / (tpm / 60)), '', '', '', ''})
  end
  if maxc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[3 + i * 3], '-inf', now)
    if redis.call('ZCARD', KEYS[3 + i * 3]) >= maxc then return report({0, i, 'concurrency', '1', '', '', '', ''}) end
  end
end
for i = 0, n - 1 do
  local rpm, tpm, maxc, rl, tl = unpack(plan[i])
  if rl then
    plan[i][4] = rl - 1
    save(KEYS[1 + i * 3], rl - 1, now)
  end
  if tl then
    plan[i][5] = tl - cost
    save(KEYS[2 + i * 3], tl - cost, now)
  end
  if maxc > 0 then
    redis.call('ZADD', KEYS[3 + i * 3], now + lease, member)
    redis.call('EXPIRE', KEYS[3 + i * 3], math.ceil(lease) + 60)
  end
end
return report({1, -1, '', '0', '', '', '', ''})
"""

# KEYS: 2 per scope (tokens, inflight). ARGV: n, then tpm, max per scope, then (member, refund) pairs.
RELEASE = LEVEL + GIVE_BACK + """
local n = tonumber(ARGV[1])
for i = 0, n - 1 do
  give_back(2 + n * 2, KEYS[1 + i * 2], KEYS[2 + i * 2], tonumber(ARGV[2 + i * 2]), tonumber(ARGV[3 + i * 2]))
end
return 0
"""

# KEYS: one scope's three. ARGV: rpm, tpm, max, cost, member. Gives back what ACQUIRE took in that scope.
UNDO = LEVEL + """
local rpm, tpm, maxc, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if rpm > 0 then save(KEYS[1], math.min(rpm, level(KEYS[1], rpm, now) + 1), now) end
if tpm > 0 then save(KEYS[2], math.min(tpm, level(KEYS[2], tpm, now) + cost), now) end
if maxc > 0 then redis.call('ZREM', KEYS[3], ARGV[5]) end
return 0
"""


Release = tuple[str, int, "asyncio.Future[None]"]  # (member, refund, settled when Redis has it)
Reply = list[int | str]  # an ACQUIRE script's: Lua numbers and strings
Pending = list[Release]


class RedisLimiter:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.prefix = f"{store.prefix}rl:"
        self._acquire = store.script(ACQUIRE)
        self._release = store.script(RELEASE)
        self._undo = store.script(UNDO)
        self.per_scope = store.cluster  # one script may not span the scopes' slots
        self.loaded = False
        # releases not yet sent, by the scopes they free: with the next admission of those scopes, or in a batch
        self.returning: ReleaseBatch[tuple[Scope, ...], Release] = ReleaseBatch(self.flush)

    async def load_scripts(self) -> None:
        """SCRIPT LOAD every script once, on every primary, so no admission pays a NOSCRIPT round trip midway
        (a primary promoted later gets them the same way redis-py always does: on its first NOSCRIPT)."""
        async with self.store.guard("rate_limit_load"):
            for script in (self._acquire, self._release, self._undo):
                await self.store.client.script_load(script.script)
        self.loaded = True

    def _keys(self, scope: str) -> tuple[str, str, str]:
        base = f"{self.prefix}{{{scope}}}:"
        return base + "requests", base + "tokens", base + "inflight"

    async def acquire(self, scopes: tuple[Scope, ...], cost: int, member: str, lease: float) -> Decision:
        if not self.loaded:
            await self.load_scripts()
        if self.per_scope and len(scopes) > 1:
            return await self.acquire_per_scope(scopes, cost, member, lease)
        return decide(await self.run_acquire(scopes, cost, member, lease), scopes)

    async def run_acquire(self, scopes: tuple[Scope, ...], cost: int, member: str, lease: float) -> Reply:
        keys: list[str] = []
        args: list[Arg] = [len(scopes), cost, member, lease]
        for scope in scopes:
            keys.extend(self._keys(scope.name))
            args.extend(limits(scope))
        pending = self.returning.take(scopes)
        if pending:
            args.extend(x for m, refund, _ in pending for x in (m, refund))
        try:
            async with self.store.guard("rate_limit_acquire"):
                reply = row(await self._acquire(keys=keys, args=args))
        except BaseException as exc:
            self.settle(scopes, pending, exc)
            raise
        self.settle(scopes, pending, None)
        return reply

    async def acquire_per_scope(self, scopes: tuple[Scope, ...], cost: int, member: str,
                                lease: float) -> Decision:
        """Each scope's script on its own slot, all sent at once (one round trip, as each is independent);
        if any refuses, or fails, give back what the others took. The first refusal in scope order answers."""
        results = await asyncio.gather(*(self.run_acquire((s,), cost, member, lease) for s in scopes),
                                       return_exceptions=True)
        refused = next((i for i, r in enumerate(results) if isinstance(r, BaseException) or not int(r[0])), None)
        if refused is None:
            reply = results[0]
            assert not isinstance(reply, BaseException)  # none failed (nor refused)
            return decide(reply, scopes)
        await asyncio.gather(*(self.undo(s, cost, member) for s, r in zip(scopes, results)
                               if not isinstance(r, BaseException) and int(r[0])))
        failed = results[refused]
        if isinstance(failed, BaseException):
            raise failed
        first = results[0] if not isinstance(results[0], BaseException) and refused else failed
        decision = decide(first, scopes)
        decision.allowed, decision.scope = False, scopes[refused].name
        decision.kind, decision.retry_after = str(failed[2]), float(failed[3])
        return decision

    async def undo(self, scope: Scope, cost: int, member: str) -> None:
        """Give back one scope's share. If the store is gone the lease (and the bucket's refill) still end it."""
        try:
            async with self.store.guard("rate_limit_undo"):
                await self._undo(keys=list(self._keys(scope.name)), args=[*limits(scope), cost, member])
        except StoreError:  # never hide the acquire's own outcome behind the undo's
            pass

    async def release(self, ticket: Ticket, used: int) -> None:
        """Returns once Redis has the release; raises what the call that carried it raised (StoreUnavailable:
        the caller tries again)."""
        groups = [(s,) for s in ticket.scopes] if self.per_scope and len(ticket.scopes) > 1 else [ticket.scopes]
        loop = asyncio.get_running_loop()
        waits = []
        for scopes in groups:
            settled = loop.create_future()
            self.returning.add(scopes, (ticket.member, ticket.reserved - used, settled))
            waits.append(settled)
        failed = [r for r in await asyncio.gather(*waits, return_exceptions=True) if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def close(self) -> None:
        """At shutdown: send the releases still queued now, and wait (bounded) until Redis has them."""
        await self.returning.close()

    async def flush(self, batch: dict[tuple[Scope, ...], Pending]) -> None:
        """The releases queued meanwhile, one script call per set of scopes, all sent at once."""
        await asyncio.gather(*(self.run_release(scopes, pending) for scopes, pending in batch.items()))

    async def run_release(self, scopes: tuple[Scope, ...], pending: Pending) -> None:
        keys: list[str] = []
        args: list[Arg] = [len(scopes)]
        for scope in scopes:
            _, tokens, inflight = self._keys(scope.name)
            keys.extend([tokens, inflight])
            args.extend([scope.tokens_per_minute or 0, scope.max_concurrent or 0])
        args.extend(x for m, refund, _ in pending for x in (m, refund))
        try:
            async with self.store.guard("rate_limit_release"):
                await self._release(keys=keys, args=args)
        except BaseException as exc:
            self.settle(scopes, pending, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.settle(scopes, pending, None)

    def settle(self, scopes: tuple[Scope, ...], pending: Pending | None, exc: BaseException | None) -> None:
        """Tell the releases carried by a call how it went. A call cancelled midway may or may not have run: its
        slots go back again (removing a lease twice is harmless), their refunds not (twice would exceed)."""
        for member, _refund, settled in pending or ():
            if settled.done():
                continue
            if isinstance(exc, asyncio.CancelledError):
                self.returning.add(scopes, (member, 0, settled))
            elif exc is not None:
                settled.set_exception(exc)
            else:
                settled.set_result(None)

    async def slots(self, scope: str) -> int:
        async with self.store.guard("rate_limit_slots"):
            return int(await self.store.client.zcount(self._keys(scope)[2], f"({time.time()}", "+inf"))


def limits(scope: Scope) -> list[int]:
    return [scope.requests_per_minute or 0, scope.tokens_per_minute or 0, scope.max_concurrent or 0]


def decide(reply: Reply, scopes: tuple[Scope, ...]) -> Decision:
    """The Decision an ACQUIRE reply says (levels for the x-ratelimit headers are the first scope's)."""
    decision = Decision(bool(int(reply[0])))
    if not decision.allowed:
        decision.scope, decision.kind = scopes[int(reply[1])].name, str(reply[2])
        decision.retry_after = float(reply[3])
    if reply[4] != "":
        decision.remaining_requests, decision.reset_requests = int(float(reply[4])), float(reply[5])
    if reply[6] != "":
        decision.remaining_tokens, decision.reset_tokens = max(0, int(float(reply[6]))), float(reply[7])
    return decision
