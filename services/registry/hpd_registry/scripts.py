"""The registry's Redis scripts (Lua): each change to a worker and its change-feed entry
in one script, so replicas can share one Redis and a crash loses nothing acknowledged.
The store (`store.py`) loads and calls them; key names are in `keys.py`."""

from __future__ import annotations

LEASE_RULE = """
-- A worker's lease as the registry judges it (`exp`, its expiry in ms), given the grace
-- hash's fields (keys.py, `grace`): leases are judged by time in which a registry could
-- write to Redis. After an outage (Redis or every registry away: no sweep for `gap` ms
-- since `alive`, the last one) a lease that ran out since that sweep is still live: at
-- once, and, once the first sweep after the outage has written `from` and `until`, until
-- one lease after the outage ended. Shared as is by every script that judges a lease.
local function lease_live(exp, g_from, g_until, alive, gap)
  if exp >= now then return true end
  if now < g_until and exp >= g_from then return true end
  return alive > 0 and gap > 0 and now - alive > gap and exp >= alive
end
"""
"""The registry's lease rule as a Lua function, for its own scripts and for the KV broker's
(which checks a session's parties in the same script as the transition); a script that
embeds it defines ``now`` before it."""

# KEYS: 1 ids, 2 lease, 3 hb, 4 lat, 5 rev, 6 feed.
# ARGV: 1 now_ms, 2 feed max length, 3 worker key prefix, 4 directive key prefix, then per script.
PRELUDE = (
    """
local now = tonumber(ARGV[1])
"""
    + LEASE_RULE
    + """
-- the grace hash (KEYS[7], kept by the sweeper: LEASE_RULE)
local grace = redis.call('HMGET', KEYS[7], 'from', 'until', 'alive', 'gap')
local grace_from = tonumber(grace[1] or '0') or 0
local grace_until = tonumber(grace[2] or '0') or 0
local alive = tonumber(grace[3] or '0') or 0
local gap = tonumber(grace[4] or '0') or 0
local function emit_put(key, id)
  local rev = redis.call('INCR', KEYS[5])
  redis.call('HSET', key, 'rev', rev)
  local h = redis.call('HGETALL', key)
  local args = {'XADD', KEYS[6], 'MAXLEN', '~', ARGV[2], rev .. '-0', 't', 'put', 'id', id}
  for i = 1, #h, 2 do
    if h[i] ~= 'cred' then
      args[#args + 1] = h[i]
      args[#args + 1] = h[i + 1]
    end
  end
  redis.call(unpack(args))
  return rev
end
local function emit_del(id, why)
  local rev = redis.call('INCR', KEYS[5])
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[2], rev .. '-0', 't', 'del', 'id', id, 'why', why)
  return rev
end
local function forget(id)
  redis.call('DEL', ARGV[3] .. id, ARGV[4] .. id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZREM', KEYS[4], id)
end
local function live(key)
  if redis.call('EXISTS', key) == 0 then return false end
  local exp = tonumber(redis.call('HGET', key, 'exp') or '0')
  return lease_live(exp, grace_from, grace_until, alive, gap)
end
"""
)

# ARGV 5 id, 6 presented credential hash ('' = none), 7 new credential hash, 8 spec, 9 ttl.
REGISTER = (
    PRELUDE
    + """
local id = ARGV[5]
local key = ARGV[3] .. id
local ttl = tonumber(ARGV[9])
if redis.call('EXISTS', key) == 1 then
  if live(key) then
    if ARGV[6] == '' or redis.call('HGET', key, 'cred') ~= ARGV[6] then
      return {'exists', 0}
    end
    redis.call('HSET', key, 'hb', now, 'exp', now + ttl, 'ttl', ttl)
    redis.call('ZADD', KEYS[2], now + ttl, id)
    redis.call('ZADD', KEYS[3], now + 2 * math.floor(ttl / 3), id)
    if redis.call('HGET', key, 'spec') ~= ARGV[8] or redis.call('HGET', key, 'sus') == '1' then
      redis.call('HSET', key, 'spec', ARGV[8], 'sus', '0')
      return {'changed', emit_put(key, id)}
    end
    return {'same', tonumber(redis.call('HGET', key, 'rev'))}
  end
  -- expired, not yet swept: watchers hear of the expiry before the new registration, so
  -- what held the old one (a KV session, a reservation) is released as by the sweeper
  forget(id)
  emit_del(id, 'lease_expired')
end
redis.call('HSET', key, 'spec', ARGV[8], 'cred', ARGV[7], 'reg', now, 'hb', now,
  'exp', now + ttl, 'ttl', ttl, 'sus', '0', 'unh', '0', 'why', '',
  'drn', '0', 'cor', '0', 'adm', '')
redis.call('ZADD', KEYS[1], 0, id)
redis.call('ZADD', KEYS[2], now + ttl, id)
redis.call('ZADD', KEYS[3], now + 2 * math.floor(ttl / 3), id)
return {'created', emit_put(key, id)}
"""
)

# ARGV 5 n, then n x (id, credential hash or '' when the stream already proved it, ttl (0 =
# the lease the worker registered with), load ('' for none; see `encode_load`), load
# reported-at, health '' | 'ok' | 'bad', reason).
# Returns n x (status, lease expiry, pending directives, unhealthy, draining, cordoned, reason,
# lease ttl).
HEARTBEATS = (
    PRELUDE
    + """
local n = tonumber(ARGV[5])
local out = {}
for i = 0, n - 1 do
  local b = 6 + i * 7
  local id = ARGV[b]
  local key = ARGV[3] .. id
  if not live(key) then
    table.insert(out, 'gone'); table.insert(out, 0); table.insert(out, 0)
    table.insert(out, '0'); table.insert(out, '0'); table.insert(out, '0'); table.insert(out, '')
    table.insert(out, 0)
  elseif ARGV[b + 1] ~= '' and redis.call('HGET', key, 'cred') ~= ARGV[b + 1] then
    table.insert(out, 'denied'); table.insert(out, 0); table.insert(out, 0)
    table.insert(out, '0'); table.insert(out, '0'); table.insert(out, '0'); table.insert(out, '')
    table.insert(out, 0)
  else
    local ttl = tonumber(ARGV[b + 2])
    if ttl == 0 then ttl = tonumber(redis.call('HGET', key, 'ttl')) end
    local exp = now + ttl
    redis.call('HSET', key, 'hb', now, 'exp', exp, 'ttl', ttl)
    redis.call('ZADD', KEYS[2], exp, id)
    redis.call('ZADD', KEYS[3], now + 2 * math.floor(ttl / 3), id)
    local full = false
    if redis.call('HGET', key, 'sus') == '1' then
      redis.call('HSET', key, 'sus', '0')
      full = true
    end
    local health = ARGV[b + 5]
    if health == 'bad' then
      if redis.call('HGET', key, 'unh') ~= '1' or redis.call('HGET', key, 'why') ~= ARGV[b + 6] then
        redis.call('HSET', key, 'unh', '1', 'why', ARGV[b + 6])
        full = true
      end
    elseif health == 'ok' and redis.call('HGET', key, 'unh') == '1' then
      redis.call('HSET', key, 'unh', '0', 'why', '')
      full = true
    end
    local load = ARGV[b + 3]
    if load ~= '' then
      redis.call('HSET', key, 'load', load, 'lat', ARGV[b + 4])
      redis.call('ZADD', KEYS[4], tonumber(ARGV[b + 4]), id)
    end
    if full then
      emit_put(key, id)
    elseif load ~= '' then
      local rev = redis.call('INCR', KEYS[5])
      redis.call('HSET', key, 'rev', rev)
      redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[2], rev .. '-0', 't', 'load', 'id', id,
        'load', load, 'lat', ARGV[b + 4], 'hb', now)
    end
    local f = redis.call('HMGET', key, 'unh', 'drn', 'cor', 'why')
    table.insert(out, 'ok'); table.insert(out, exp)
    table.insert(out, redis.call('LLEN', ARGV[4] .. id))
    table.insert(out, f[1]); table.insert(out, f[2])
    table.insert(out, f[3]); table.insert(out, f[4])
    table.insert(out, ttl)
  end
end
return out
"""
)

# ARGV 5 id, 6 credential hash ('*': an operator's, no credential checked).
DEREGISTER = (
    PRELUDE
    + """
local id = ARGV[5]
local key = ARGV[3] .. id
if not live(key) then return {'gone', 0} end
if ARGV[6] ~= '*' and redis.call('HGET', key, 'cred') ~= ARGV[6] then
  return {'denied', 0}
end
forget(id)
return {'ok', emit_del(id, 'deregistered')}
"""
)

# ARGV 5 id, 6 credential hash, 7 tokens per block, 8 events JSON, 9 KV feed max length.
KV_EVENTS = (
    PRELUDE
    + """
local key = ARGV[3] .. ARGV[5]
if not live(key) then return 'gone' end
if redis.call('HGET', key, 'cred') ~= ARGV[6] then return 'denied' end
redis.call('XADD', KEYS[8], 'MAXLEN', '~', ARGV[9], '*', 'w', ARGV[5], 'bt', ARGV[7],
  'ev', ARGV[8])
return 'ok'
"""
)

# ARGV 5 id, 6 op (drain | cordon | uncordon), 7 reason.
ADMIN = (
    PRELUDE
    + """
local id = ARGV[5]
local key = ARGV[3] .. id
if not live(key) then return {'gone', 0} end
local op = ARGV[6]
local f = redis.call('HMGET', key, 'drn', 'cor', 'adm')
local drn, cor, adm = f[1], f[2], f[3]
if op == 'drain' then drn = '1'; adm = ARGV[7]
elseif op == 'cordon' then cor = '1'; adm = ARGV[7]
else drn = '0'; cor = '0'; adm = '' end
if drn == f[1] and cor == f[2] and adm == f[3] then
  return {'same', tonumber(redis.call('HGET', key, 'rev'))}
end
redis.call('HSET', key, 'drn', drn, 'cor', cor, 'adm', adm)
return {'ok', emit_put(key, id)}
"""
)

# ARGV 5 unused (kept for argument order), 6 suspect if load reported before, 7 batch limit.
# KEYS[3] holds each worker's suspect-at time: last heartbeat + two heartbeat intervals.
SWEEP = (
    PRELUDE
    + """
-- ARGV 5: the default lease, 8: the outage gap (ms). The grace after an outage lasts one
-- default lease or the outage's own length, whichever is longer: a client reconnecting
-- with exponential backoff sleeps at most about as long as it has been cut off.
if alive > 0 and now - alive > tonumber(ARGV[8]) then
  grace_from = alive
  grace_until = math.max(grace_until, now + math.max(tonumber(ARGV[5]), now - alive))
  redis.call('HSET', KEYS[7], 'from', grace_from, 'until', grace_until)
end
redis.call('HSET', KEYS[7], 'alive', now, 'gap', ARGV[8])
local cut = now
if now < grace_until then cut = math.min(now, grace_from) end
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. cut, 'LIMIT', 0, ARGV[7])
for _, id in ipairs(expired) do
  forget(id)
  emit_del(id, 'lease_expired')
end
local suspects = {}
local seen = {}
local c1 = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. cut, 'LIMIT', 0, ARGV[7])
local c2 = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. ARGV[6], 'LIMIT', 0, ARGV[7])
for _, list in ipairs({c1, c2}) do
  for _, id in ipairs(list) do
    local key = ARGV[3] .. id
    if not seen[id] and live(key) and redis.call('HGET', key, 'sus') ~= '1' then
      seen[id] = true
      redis.call('HSET', key, 'sus', '1')
      emit_put(key, id)
      table.insert(suspects, id)
    end
  end
end
return {expired, suspects, grace_from, grace_until, alive}
"""
)

# Atomic snapshot: the revision and every worker hash as of that revision.
SNAPSHOT = """
local out = {redis.call('GET', KEYS[5]) or '0'}
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGETALL', ARGV[1] .. id)
end
return out
"""

# KEYS 1: a worker's directive queue (JSON per entry); ARGV: the directive ids it acked.
# Removes those entries; returns how many went. The queue is capped (MAX_PENDING_DIRECTIVES),
# so the scan is bounded.
ACK_DIRECTIVES = """
local acked = {}
for _, id in ipairs(ARGV) do acked[id] = true end
local removed = 0
for _, raw in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local ok, d = pcall(cjson.decode, raw)
  if ok and type(d) == 'table' and acked[d['directive_id']] then
    removed = removed + redis.call('LREM', KEYS[1], 1, raw)
  end
end
return removed
"""
