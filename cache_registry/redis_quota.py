"""Token quotas counted in Redis, for every router and replica of a cluster (issue 17).

One script a call, so a check and its charge are atomic across processes. The arithmetic is
``cache_registry/quota_rules.py``'s, written again in Lua (a parity test runs both). Keys,
under the registry's hash tag ``P = "{namespace}"``:

- ``P:q:<tenant>:<window ms>``  HASH w (fixed window index), cur, prev: tokens (PX 2 windows)
- ``P:qa:<tenant>`` ZSET request id -> lease end (ms): the tenant's running requests; an entry
                    whose process died without settling leaves when its lease ends

The time comes from the caller (wall clock), as the in-process store's does.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from prefixmesh.cache_registry.quota_rules import LIMIT_CODES, Admission, QuotaAsk
from prefixmesh.cache_registry.redis_connection import RedisEndpoint

_ROLL = """
local P, tenant, rid = ARGV[1], ARGV[2], ARGV[3]
local now = tonumber(ARGV[4])
local tokens = tonumber(ARGV[5])
local W = tonumber(ARGV[6])
local wk = P .. ':q:' .. tenant .. ':' .. W
local ak = P .. ':qa:' .. tenant
local stored = redis.call('HMGET', wk, 'w', 'cur', 'prev')
local win = math.floor(now / W)
local w = tonumber(stored[1]) or win
local cur = tonumber(stored[2]) or 0
local prev = tonumber(stored[3]) or 0
if win == w + 1 then prev = cur; cur = 0 elseif win > w + 1 then prev = 0; cur = 0 end
if win < w then win = w end
local frac = (now - win * W) / W
if frac < 0 then frac = 0 elseif frac > 1 then frac = 1 end
local function save()
  redis.call('HSET', wk, 'w', win, 'cur', cur, 'prev', prev)
  redis.call('PEXPIRE', wk, 2 * W)
end
"""

ADMIT = (
    _ROLL
    + """
local tpm = tonumber(ARGV[7])
local concurrent = tonumber(ARGV[8])
local lease = tonumber(ARGV[9])
local used = prev * (1 - frac) + cur
redis.call('ZREMRANGEBYSCORE', ak, '-inf', now)
local active = redis.call('ZCARD', ak)
local used_floor = math.floor(used)
if concurrent > 0 and active >= concurrent then return {2, 1000, used_floor, active} end
if tpm > 0 and tokens > tpm then return {3, 0, used_floor, active} end
local allowed = tpm * W / 60000
if tpm > 0 and used > 0 and used + tokens > allowed then
  local room = allowed - tokens
  if room < 0 then room = 0 end
  local retry
  if cur > room then
    retry = math.ceil((1 - frac) * W + (1 - room / cur) * W)
  elseif prev <= 0 then
    retry = 1
  else
    retry = math.ceil((1 - (room - cur) / prev - frac) * W)
  end
  if retry < 1 then retry = 1 end
  return {1, retry, used_floor, active}
end
cur = cur + tokens
save()
if concurrent > 0 then
  redis.call('ZADD', ak, now + lease, rid)
  redis.call('PEXPIRE', ak, lease)
end
return {0, 0, used_floor, active}
"""
)

SETTLE = (
    _ROLL
    + """
if tokens > 0 then
  cur = cur + tokens
  save()
end
redis.call('ZREM', ak, rid)
return 1
"""
)


class RedisQuotaStore:
    """``QuotaStore`` on the registry's Redis (its own client: a slow quota call never holds
    a routing lookup's connection)."""

    def __init__(self, endpoint: RedisEndpoint, namespace: str, timeout_s: float) -> None:
        self._prefix = "{" + namespace + "}"
        self._redis: aioredis.Redis = endpoint.async_client(
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._admit = self._redis.register_script(ADMIT)
        self._settle = self._redis.register_script(SETTLE)

    async def admit(self, ask: QuotaAsk) -> Admission:
        args: list[Any] = [self._prefix, ask.tenant, ask.request_id, ask.now_ms, ask.tokens]
        args += [ask.window_ms, ask.tokens_per_minute, ask.concurrent_requests, ask.lease_ms]
        code, retry, used, active = await self._admit(args=args)
        return Admission(LIMIT_CODES[int(code)], int(retry), int(used), int(active))

    async def settle(
        self, tenant: str, request_id: str, tokens: int, now_ms: int, window_ms: int
    ) -> None:
        await self._settle(args=[self._prefix, tenant, request_id, now_ms, tokens, window_ms])

    async def close(self) -> None:
        await self._redis.aclose()
