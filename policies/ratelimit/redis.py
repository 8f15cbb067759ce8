"""Rate limits in Redis, so N gateway replicas enforce one global limit.

One Lua script per admission (every bucket and slot of every scope checked and taken atomically, one round
trip) and one per release. Time comes from the Redis server (TIME), so replicas' clocks never disagree.

    {prefix}rl:{scope}:requests     hash  l (level), t (time): the requests-per-minute bucket
    {prefix}rl:{scope}:tokens       hash  the same for tokens
    {prefix}rl:{scope}:inflight     zset  member (request) -> lease expiry
"""

from __future__ import annotations

import time

from policies.ratelimit.base import Decision, Scope, Ticket
from policies.store.redis import RedisStore

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

# KEYS: 3 per scope (requests, tokens, inflight). ARGV: n, cost, member, lease, then rpm, tpm, max per scope
# (0 = no limit). Returns {admitted 1/0, refusing scope index, kind, retry after seconds, then scope 0's
# request level, request reset, token level, token reset} ('' where a scope has no such limit).
ACQUIRE = LEVEL + """
local n, cost, member, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
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

# KEYS: 2 per scope (tokens, inflight). ARGV: n, refund, member, then tpm, max per scope.
RELEASE = LEVEL + """
local n, refund, member = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
for i = 0, n - 1 do
  local tpm, maxc = tonumber(ARGV[4 + i * 2]), tonumber(ARGV[5 + i * 2])
  if tpm > 0 and refund ~= 0 then
    save(KEYS[1 + i * 2], math.min(tpm, level(KEYS[1 + i * 2], tpm, now) + refund), now)
  end
  if maxc > 0 then redis.call('ZREM', KEYS[2 + i * 2], member) end
end
return 0
"""


class RedisLimiter:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.prefix = f"{store.prefix}rl:"
        self._acquire = store.client.register_script(ACQUIRE)
        self._release = store.client.register_script(RELEASE)

    def _keys(self, scope: str) -> tuple[str, str, str]:
        base = f"{self.prefix}{scope}:"
        return base + "requests", base + "tokens", base + "inflight"

    async def acquire(self, scopes: tuple[Scope, ...], cost: int, member: str, lease: float) -> Decision:
        keys: list[str] = []
        args: list[object] = [len(scopes), cost, member, lease]
        for scope in scopes:
            keys.extend(self._keys(scope.name))
            args.extend([scope.requests_per_minute or 0, scope.tokens_per_minute or 0, scope.max_concurrent or 0])
        async with self.store.guard("rate_limit_acquire"):
            reply = await self._acquire(keys=keys, args=args)
        decision = Decision(bool(int(reply[0])))
        if not decision.allowed:
            decision.scope, decision.kind = scopes[int(reply[1])].name, str(reply[2])
            decision.retry_after = float(reply[3])
        if reply[4] != "":
            decision.remaining_requests, decision.reset_requests = int(float(reply[4])), float(reply[5])
        if reply[6] != "":
            decision.remaining_tokens, decision.reset_tokens = max(0, int(float(reply[6]))), float(reply[7])
        return decision

    async def release(self, ticket: Ticket, used: int) -> None:
        keys: list[str] = []
        args: list[object] = [len(ticket.scopes), ticket.reserved - used, ticket.member]
        for scope in ticket.scopes:
            _, tokens, inflight = self._keys(scope.name)
            keys.extend([tokens, inflight])
            args.extend([scope.tokens_per_minute or 0, scope.max_concurrent or 0])
        async with self.store.guard("rate_limit_release"):
            await self._release(keys=keys, args=args)

    async def slots(self, scope: str) -> int:
        async with self.store.guard("rate_limit_slots"):
            return int(await self.store.client.zcount(self._keys(scope)[2], f"({time.time()}", "+inf"))
