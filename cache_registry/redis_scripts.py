"""Lua scripts of the Redis backend: each operation is one atomic round trip.

Key layout, all under one hash tag ``P = "{namespace}"`` (one slot, so scripts may touch them):

- ``P:fp``               the cache fingerprint (JSON) the first client recorded
- ``P:ridx`` / ``P:rid`` HASHes replica id -> small index, and back; ``P:ridn`` next index,
                         ``P:ridfree`` LIST of indices freed by dropped replicas
- ``P:b:<hex>``          STRING, one byte per replica index: its tier bitmask for this block
                         (GPU 1, CPU 2, DISK 4). A lookup compares whole strings, so a block
                         whose holders equal the previous block's costs one GET.
- ``P:r:<replica>``      SET of hex hashes the replica holds (drop, clear and reset walk it)
- ``P:s:<hex>``          HASH replica index -> expiry ms: speculative holders (key TTL = longest)
- ``P:sr:<replica>``     ZSET hex -> expiry ms: the replica's speculative entries
- ``P:seq``              HASH replica -> "epoch:seq" of the last applied event
- ``P:alive``            ZSET replica -> when it last published or heartbeat in step (ms):
                         ``REAP`` drops the silent ones
- ``P:dead:<replica>``   STRING with PX TTL: dropped recently; speculative writes for it are
                         ignored until its own next event (``DROPPED_REPLICA_MEMORY_S``)
- ``P:if:<hex>``         STRING holder of an in-flight claim, with PX TTL
- ``P:ifr:<replica>``    SET of the replica's claims (for drop_replica)
- ``P:hot:<hex>``        HASH v (decayed value), t (last update, s)
- ``P:released``         pub/sub channel: hex of each released claim

The rules mirror ``memory.py`` and ``sequencing.py``; the contract suite runs both backends.
"""

from __future__ import annotations

_HELPERS = """
local P = ARGV[1]
local ALL = 7
local function index_of(who)
  local i = redis.call('HGET', P .. ':ridx', who)
  if i then return tonumber(i) end
  return nil
end
local function assign_index(who)
  local i = index_of(who)
  if i then return i end
  local free = redis.call('LPOP', P .. ':ridfree')
  if free then i = tonumber(free) else i = redis.call('INCR', P .. ':ridn') - 1 end
  redis.call('HSET', P .. ':ridx', who, i)
  redis.call('HSET', P .. ':rid', i, who)
  return i
end
local function remove_bits(h, idx, who, bits)
  local k = P .. ':b:' .. h
  local cur = string.byte(redis.call('GETRANGE', k, idx, idx)) or 0
  if bit.band(cur, bits) == 0 then return end
  local new = bit.band(cur, bit.bnot(bits))
  redis.call('SETRANGE', k, idx, string.char(new))
  if new == 0 then
    redis.call('SREM', P .. ':r:' .. who, h)
    if not string.find(redis.call('GET', k), '[^%z]') then redis.call('DEL', k) end
  end
end
local function purge_entries(who, idx)
  local index = P .. ':r:' .. who
  for _, h in ipairs(redis.call('SMEMBERS', index)) do remove_bits(h, idx, who, ALL) end
  redis.call('DEL', index)
end
local function drop_speculative(who, idx)
  local index = P .. ':sr:' .. who
  for _, h in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    redis.call('HDEL', P .. ':s:' .. h, idx)
  end
  redis.call('DEL', index)
end
local function drop_replica(who, memory_ms)
  -- The mark refuses speculative writes for it until its own next event (a late guess).
  redis.call('SET', P .. ':dead:' .. who, 1, 'PX', memory_ms)
  local idx = index_of(who)
  if idx then
    purge_entries(who, idx)
    drop_speculative(who, idx)
    redis.call('HDEL', P .. ':ridx', who)
    redis.call('HDEL', P .. ':rid', idx)
    redis.call('RPUSH', P .. ':ridfree', idx)
  end
  local claims = P .. ':ifr:' .. who
  for _, h in ipairs(redis.call('SMEMBERS', claims)) do
    local k = P .. ':if:' .. h
    if redis.call('GET', k) == who then
      redis.call('DEL', k)
      redis.call('PUBLISH', P .. ':released', h)
    end
  end
  redis.call('DEL', claims)
  redis.call('HDEL', P .. ':seq', who)
  redis.call('ZREM', P .. ':alive', who)
end
"""

PUBLISH = (
    _HELPERS
    + """
-- ARGV: P, replica, max_holders, now_ms, then per event: kind (s|r|c), epoch, seq,
-- tier (-1 = all), n, n hex hashes. Returns {applied, duplicates, gap, reset}.
local replica = ARGV[2]
local max_holders = tonumber(ARGV[3])
redis.call('DEL', P .. ':dead:' .. replica)
redis.call('ZADD', P .. ':alive', ARGV[4], replica)
local idx = assign_index(replica)
local index = P .. ':r:' .. replica
local seq_key = P .. ':seq'
local last_epoch, last_seq = nil, -1
local state = redis.call('HGET', seq_key, replica)
if state then
  local sep = string.find(state, ':', 1, true)
  last_epoch = tonumber(string.sub(state, 1, sep - 1))
  last_seq = tonumber(string.sub(state, sep + 1))
end
local function add_bits(h, bits)
  local k = P .. ':b:' .. h
  local cur = string.byte(redis.call('GETRANGE', k, idx, idx)) or 0
  if cur == 0 then
    local holders = redis.call('GET', k)
    if holders and #holders >= max_holders then
      local _, zeros = string.gsub(holders, '%z', '')
      if #holders - zeros >= max_holders then
        local victim = string.find(holders, '[^%z]') - 1
        remove_bits(h, victim, redis.call('HGET', P .. ':rid', victim), ALL)
      end
    end
    redis.call('SADD', index, h)
  end
  local new = bit.bor(cur, bits)
  if new ~= cur then redis.call('SETRANGE', k, idx, string.char(new)) end
  if bits == 1 then  -- confirmed on the GPU where the router guessed: drop the guess
    redis.call('HDEL', P .. ':s:' .. h, idx)
    redis.call('ZREM', P .. ':sr:' .. replica, h)
  end
end
local applied, duplicates, gap, reset = 0, 0, 0, 0
local i = 5
while i <= #ARGV do
  local kind, epoch, seq = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local tier, n = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  local first = i + 5
  i = first + n
  local apply = true
  if last_epoch == nil then
    if seq > 0 then gap = 1 end
  elseif epoch > last_epoch then
    purge_entries(replica, idx)
    drop_speculative(replica, idx)
    reset = 1
    if seq > 0 then gap = 1 end
  elseif epoch < last_epoch or seq <= last_seq then
    apply = false
  elseif seq > last_seq + 1 then
    gap = 1
  end
  if apply then
    last_epoch, last_seq = epoch, seq
    applied = applied + 1
    local bits = ALL
    if tier >= 0 then bits = bit.lshift(1, tier) end
    if kind == 's' then
      for j = first, i - 1 do add_bits(ARGV[j], bits) end
    elseif kind == 'r' then
      for j = first, i - 1 do
        remove_bits(ARGV[j], idx, replica, bits)
        redis.call('HDEL', P .. ':s:' .. ARGV[j], idx)
        redis.call('ZREM', P .. ':sr:' .. replica, ARGV[j])
      end
    else
      for _, h in ipairs(redis.call('SMEMBERS', index)) do remove_bits(h, idx, replica, bits) end
      if tier <= 0 then drop_speculative(replica, idx) end
    end
  else
    duplicates = duplicates + 1
  end
end
if last_epoch ~= nil then
  redis.call('HSET', seq_key, replica, string.format('%d:%d', last_epoch, last_seq))
end
return {applied, duplicates, gap, reset}
"""
)

LOOKUP = """
-- ARGV: P, now_ms, hashes (16 hex digits each, concatenated), candidate replicas joined by
-- newlines ('' = all). Few, long arguments and one string back keep the client's share small.
-- Returns lines "replica gpu cpu disk speculative" (leading blocks per tier).
local P = ARGV[1]
local now = tonumber(ARGV[2])
local packed = ARGV[3]
local n = #packed / 16
local pool = nil
if #ARGV[4] > 0 then
  local names = {}
  for name in string.gmatch(ARGV[4], '[^\\n]+') do names[#names + 1] = name end
  pool = {}
  for _, v in ipairs(redis.call('HMGET', P .. ':ridx', unpack(names))) do
    if v then pool[tonumber(v)] = true end
  end
  if next(pool) == nil then return '' end
end
local counts = {}
local alive = nil   -- replica index -> tier code of the current run (1 gpu, 2 cpu, 3 disk, 4 spec)
local run = 0
local previous = nil
local function flush()
  if run == 0 then return end
  for idx, t in pairs(alive) do
    local row = counts[idx]
    if row == nil then
      row = {0, 0, 0, 0}
      counts[idx] = row
    end
    if t == 4 then
      row[1] = row[1] + run
      row[4] = row[4] + run
    else
      row[t] = row[t] + run
    end
  end
  run = 0
end
for i = 1, n do
  local h = string.sub(packed, i * 16 - 15, i * 16)
  local s = redis.call('GET', P .. ':b:' .. h) or ''
  local spec = redis.call('HGETALL', P .. ':s:' .. h)
  if #spec == 0 and s == previous then
    run = run + 1
  else
    local live = {}
    for k = 1, #spec, 2 do
      if tonumber(spec[k + 1]) > now then live[tonumber(spec[k])] = true end
    end
    local scan = alive or pool
    if scan == nil then
      scan = {}
      for j = 1, #s do
        if string.byte(s, j) ~= 0 then scan[j - 1] = true end
      end
      for idx, _ in pairs(live) do scan[idx] = true end
    end
    local nxt, any = {}, false
    for idx, _ in pairs(scan) do
      local b = string.byte(s, idx + 1) or 0
      local t = nil
      if b % 2 == 1 then t = 1 elseif b % 4 >= 2 then t = 2 elseif b >= 4 then t = 3
      elseif live[idx] then t = 4 end
      if t then
        nxt[idx] = t
        any = true
      end
    end
    if not any then break end
    flush()
    alive, run = nxt, 1
    if #spec == 0 then previous = s else previous = nil end
  end
end
flush()
local indices = {}
for idx, _ in pairs(counts) do indices[#indices + 1] = idx end
if #indices == 0 then return '' end
local names = redis.call('HMGET', P .. ':rid', unpack(indices))
local out = {}
for j, idx in ipairs(indices) do
  if names[j] then
    local row = counts[idx]
    out[#out + 1] = string.format('%s %d %d %d %d', names[j], row[1], row[2], row[3], row[4])
  end
end
return table.concat(out, '\\n')
"""

ADD_SPECULATIVE = (
    _HELPERS
    + """
-- ARGV: P, replica, expiry_ms, ttl_ms, now_ms, hex hashes...
local replica = ARGV[2]
local expiry, ttl, now = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if redis.call('EXISTS', P .. ':dead:' .. replica) == 1 then return 0 end
local idx = assign_index(replica)
local index = P .. ':sr:' .. replica
for _, h in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now)) do
  redis.call('HDEL', P .. ':s:' .. h, idx)
end
redis.call('ZREMRANGEBYSCORE', index, '-inf', now)
for i = 6, #ARGV do
  local k = P .. ':s:' .. ARGV[i]
  redis.call('HSET', k, idx, ARGV[3])
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
  redis.call('ZADD', index, expiry, ARGV[i])
end
if redis.call('PTTL', index) < ttl then redis.call('PEXPIRE', index, ttl) end
return 1
"""
)

CLAIM = """
-- ARGV: P, hex, replica, ttl_ms. Returns the holder after the attempt.
local P = ARGV[1]
local k = P .. ':if:' .. ARGV[2]
if redis.call('SET', k, ARGV[3], 'NX', 'PX', ARGV[4]) then
  local index = P .. ':ifr:' .. ARGV[3]
  redis.call('SADD', index, ARGV[2])
  if redis.call('PTTL', index) < tonumber(ARGV[4]) then redis.call('PEXPIRE', index, ARGV[4]) end
  return ARGV[3]
end
return redis.call('GET', k)
"""

RELEASE = """
-- ARGV: P, hex, replica. Deletes the claim only if the replica holds it.
local P = ARGV[1]
local k = P .. ':if:' .. ARGV[2]
if redis.call('GET', k) ~= ARGV[3] then return 0 end
redis.call('DEL', k)
redis.call('SREM', P .. ':ifr:' .. ARGV[3], ARGV[2])
redis.call('PUBLISH', P .. ':released', ARGV[2])
return 1
"""

DROP_REPLICA = (
    _HELPERS
    + """
-- ARGV: P, replica, memory_ms (how long speculative writes for it are refused).
drop_replica(ARGV[2], ARGV[3])
return 1
"""
)

HEARTBEAT = """
-- ARGV: P, replica, epoch, seq, now_ms. 1 (and the replica counts as seen at now_ms) iff its
-- last applied event is (epoch, seq); 0 if another or none (the replica must resync).
local P = ARGV[1]
local state = redis.call('HGET', P .. ':seq', ARGV[2])
if not state then return 0 end
local sep = string.find(state, ':', 1, true)
local epoch, seq = tonumber(string.sub(state, 1, sep - 1)), tonumber(string.sub(state, sep + 1))
if epoch ~= tonumber(ARGV[3]) or seq ~= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', P .. ':alive', ARGV[5], ARGV[2])
return 1
"""

REAP = (
    _HELPERS
    + """
-- ARGV: P, cutoff_ms, memory_ms. Drops every replica last seen before cutoff_ms (as
-- DROP_REPLICA); returns their ids. Atomic, so concurrent reapers drop each one once.
local dead = redis.call('ZRANGEBYSCORE', P .. ':alive', '-inf', '(' .. ARGV[2])
for _, who in ipairs(dead) do drop_replica(who, ARGV[3]) end
return dead
"""
)

TOUCH = """
-- ARGV: P, hex, weight, now_s, half_life_s, ttl_ms. Same rule as hotness.touched.
local k = ARGV[1] .. ':hot:' .. ARGV[2]
local weight, now, half = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local cur = redis.call('HMGET', k, 'v', 't')
local v, t = 0, now
if cur[1] then
  local updated = tonumber(cur[2])
  v = tonumber(cur[1]) * 2 ^ (-math.max(0, now - updated) / half)
  t = math.max(now, updated)
end
redis.call('HSET', k, 'v', string.format('%.17g', v + weight), 't', string.format('%.17g', t))
redis.call('PEXPIRE', k, ARGV[6])
return 1
"""
