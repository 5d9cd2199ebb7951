"""The scheduler's Redis scripts (Lua): a reservation, its record head and its idempotency
key in one script (one at a time or a batch of them), releases, outcomes, purges and the
directive de-duplication. The store (`store.py`) calls them; key names are in `keys.py`."""

from __future__ import annotations

# KEYS: 1 totals, 2 reservations, 3 expiry. Releases one reservation by request id.
RELEASE_FN = """
local function bump(field, by)
  local v = redis.call('HINCRBY', KEYS[1], field, by)
  if v <= 0 then redis.call('HDEL', KEYS[1], field) end
  return v
end
local function release(rid)
  local v = redis.call('HGET', KEYS[2], rid)
  redis.call('ZREM', KEYS[3], rid)
  if not v then return 0 end
  redis.call('HDEL', KEYS[2], rid)
  local dw, kv, pw, tk = string.match(v, '^(.*)|(%d+)|(.*)|(%d+)$')
  if not dw then return 0 end
  bump('k:' .. dw, -tonumber(kv))
  bump('n:' .. dw, -1)
  if tonumber(tk) > 0 then bump('t:' .. pw, -tonumber(tk)) end
  return 1
end
local function purge(now, limit)
  local lapsed = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, limit)
  for _, rid in ipairs(lapsed) do release(rid) end
  return #lapsed
end
"""

# One reservation and record head (the body of both reserve scripts). KEYS[1..3] are the
# totals, reservations and expiry keys; `rkey` the request's record key; `a` this entry's
# arguments: 1 now_ms, 2 request id, 3 reservation ttl ms, 4 record ttl ms, 5 record head
# JSON, 6 decision, 7 decode worker ('' = reserve nothing), 8 kv bytes, 9 kv capacity,
# 10 slot capacity (-1 = unbounded), 11 prefill worker, 12 prefill tokens.
# Returns {0, head} (replay), {1, kv, slots, tokens} (reserved), {2, kv, slots, tokens} (full).
RESERVE_ONE_FN = """
local function reserve_one(rkey, index, a)
  local now = tonumber(a[1])
  local rid = a[2]
  local prev = redis.call('HGET', rkey, 'p')
  if prev and redis.call('HGET', rkey, 'd') ~= 'reject' then
    return {0, prev}
  end
  local dw = a[7]
  local k, n, t = 0, 0, 0
  if dw ~= '' then
    k = tonumber(redis.call('HGET', KEYS[1], 'k:' .. dw) or '0')
    n = tonumber(redis.call('HGET', KEYS[1], 'n:' .. dw) or '0')
    local pw = a[11]
    t = tonumber(redis.call('HGET', KEYS[1], 't:' .. pw) or '0')
    local slots = tonumber(a[10])
    if k + tonumber(a[8]) > tonumber(a[9]) or (slots >= 0 and n + 1 > slots) then
      return {2, k, n, t}
    end
    k = redis.call('HINCRBY', KEYS[1], 'k:' .. dw, a[8])
    n = redis.call('HINCRBY', KEYS[1], 'n:' .. dw, 1)
    if tonumber(a[12]) > 0 then
      t = redis.call('HINCRBY', KEYS[1], 't:' .. pw, a[12])
    end
    redis.call('HSET', KEYS[2], rid, dw .. '|' .. a[8] .. '|' .. pw .. '|' .. a[12])
    redis.call('ZADD', KEYS[3], now + tonumber(a[3]), rid)
  end
  redis.call('HDEL', rkey, 'x', 'o')
  redis.call('HSET', rkey, 'p', a[5], 'd', a[6])
  redis.call('PEXPIRE', rkey, a[4])
  redis.call('ZADD', index, now, rid)
  return {1, k, n, t}
end
-- the oldest records leave the index and the store together, so records are bounded by
-- the cap whatever the request rate; never one younger than a reservation's TTL (it is
-- the idempotency key of a plan that may still be retried). Same hash tag, same slot.
local function trim_index(index, base, now, ttl, cap)
  local over = redis.call('ZCARD', index) - cap
  if over <= 0 then return end
  local old = redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl, 'LIMIT', 0, over)
  for _, id in ipairs(old) do
    redis.call('DEL', base .. id)
    redis.call('ZREM', index, id)
  end
end
"""

# KEYS: 1 totals, 2 reservations, 3 expiry, 4 record, 5 index.
# ARGV: 1 now_ms, 2 request id, 3 reservation ttl ms, 4 record ttl ms, 5 index cap,
#       6 record head JSON, 7 decision, 8 decode worker ('' = reserve nothing),
#       9 kv bytes, 10 kv capacity, 11 slot capacity (-1 = unbounded), 12 prefill worker,
#       13 prefill tokens, 14 purge limit.
# Returns what `reserve_one` returns.
RESERVE = (
    RELEASE_FN
    + RESERVE_ONE_FN
    + """
local prev = redis.call('HGET', KEYS[4], 'p')
if not (prev and redis.call('HGET', KEYS[4], 'd') ~= 'reject') then
  purge(tonumber(ARGV[1]), tonumber(ARGV[14]))
end
local out = reserve_one(KEYS[4], KEYS[5], {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[6],
  ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13]})
if out[1] == 1 then
  local base = string.sub(KEYS[4], 1, #KEYS[4] - #ARGV[2])
  trim_index(KEYS[5], base, tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[5]))
end
return out
"""
)

# Group commit: many `Schedule` calls' reservations in one script call, each entry
# exactly as `RESERVE` would do it alone (its purge at its own time included), in order
# (so a later entry sees what an earlier one reserved: two entries for one worker can never
# together pass its capacity, and a request id twice in one batch is a replay the second
# time).
# KEYS: 1 totals, 2 reservations, 3 expiry, 4 index, then one record key per entry.
# ARGV: 1 purge limit, 2 index cap, 3 fields per entry (12), then the entries' arguments
# (as `reserve_one` takes them). Returns one `reserve_one` answer per entry.
RESERVE_BATCH = (
    RELEASE_FN
    + RESERVE_ONE_FN
    + """
local width = tonumber(ARGV[3])
local n = (#ARGV - 3) / width
local now = 0
local out = {}
local trim = nil
for i = 1, n do
  local a = {}
  for j = 1, width do a[j] = ARGV[3 + (i - 1) * width + j] end
  local rkey = KEYS[4 + i]
  local prev = redis.call('HGET', rkey, 'p')
  if not (prev and redis.call('HGET', rkey, 'd') ~= 'reject') then
    purge(tonumber(a[1]), tonumber(ARGV[1]))  -- at the entry's own time, as a lone call
  end
  out[i] = reserve_one(rkey, KEYS[4], a)
  if out[i][1] == 1 then trim = i end
  if tonumber(a[1]) > now then now = tonumber(a[1]) end
end
if trim then
  local a2 = ARGV[3 + (trim - 1) * width + 2]
  local rkey = KEYS[4 + trim]
  local ttl = tonumber(ARGV[3 + (trim - 1) * width + 3])
  trim_index(KEYS[4], string.sub(rkey, 1, #rkey - #a2), now, ttl, tonumber(ARGV[2]))
end
return out
"""
)

# KEYS: 1 totals, 2 reservations, 3 expiry, 4 record. ARGV: 1 request id, 2 outcome JSON,
# 3 the reporting caller ('' = anyone may). Returns {released 0/1, record exists 0/1, first
# outcome 0/1, head or ''}; {-1, ...} when the record names another caller (nothing done).
OUTCOME = (
    RELEASE_FN
    + """
local head = redis.call('HGET', KEYS[4], 'p')
if head and ARGV[3] ~= '' then
  local ok, doc = pcall(cjson.decode, head)
  if ok and type(doc) == 'table' and (doc['caller'] or '') ~= ARGV[3] then
    return {-1, 1, 0, ''}
  end
end
local released = release(ARGV[1])
if not head then return {released, 0, 0, ''} end
local first = redis.call('HSETNX', KEYS[4], 'o', ARGV[2])
return {released, 1, first, head}
"""
)

# KEYS: 1 totals, 2 reservations, 3 expiry. ARGV: 1 now_ms, 2 limit. Returns purged count.
PURGE = RELEASE_FN + "return purge(tonumber(ARGV[1]), tonumber(ARGV[2]))\n"

# KEYS: record keys. ARGV: explanation JSONs, same order. Only records that still exist.
EXPLAIN = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('HSET', key, 'x', ARGV[i])
    n = n + 1
  end
end
return n
"""

# KEYS: 1 directive key. ARGV: 1 value, 2 ttl ms. 1 when the value changed (send it).
DIRECTIVE_CHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
