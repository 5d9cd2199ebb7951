"""The KV broker's Redis scripts (Lua): opening a session, every state transition (the
transition table is generated from the domain's, `domain.lua_transition_table`), sweeps and
a lost worker's sessions, each in one script with its feed entry. The store (`store.py`)
renders and calls them; key names are in `keys.py`."""

from __future__ import annotations

from hpd_kvbroker.domain import lua_terminal_set, lua_transition_table
from hpd_registry.scripts import LEASE_RULE

SESSION_FIELDS = (
    "sid", "rid", "src", "dst", "st", "exb", "done", "crt", "upd", "dl", "lexp", "ttl", "why",
    "ver", "by", "neg",
)  # fmt: skip
"""A session hash's fields (beside ``fp``, the open request's fingerprint, which only the
open script reads). The scripts return a session as these fields' values in this order
(`decode_values`), and write them, by name, into its feed entry."""

# KEYS: 1 ids, 2 due, 3 done, 4 busy, 5 feed.  ARGV: 1 now_ms, then per script.
# A store's constants (key prefixes, feed length, retention) are written into its copy of
# the scripts (`_render`), so a call sends only what varies.
PRELUDE = (
    """
local now = tonumber(ARGV[1])
local SP, RP, OP, RW = '@SP@', '@RP@', '@OP@', '@RW@'
local retain = @RETAIN@
local TERMINAL = """
    + lua_terminal_set()
    + """
local FIELDS = """
    + "{"
    + ", ".join(f"'{name}'" for name in SESSION_FIELDS)
    + "}"
    + """
-- A session as the scripts return it: its FIELDS' values in order ('' where unset).
local function values(s)
  local out = {}
  for i, name in ipairs(FIELDS) do out[i] = s[name] or '' end
  return out
end
-- The session `s` as field/value pairs in FIELDS order (unset fields left out).
local function pairs_of(s)
  local out = {}
  for _, name in ipairs(FIELDS) do
    if s[name] then
      out[#out + 1] = name
      out[#out + 1] = s[name]
    end
  end
  return out
end
-- Appends the session `s` (as it now is) to the feed; returns its values.
local function emit(s)
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', @FEEDMAX@, '*', unpack(pairs_of(s)))
  return values(s)
end
-- A session's every field in one call (nil if there is none); values as stored.
local function read_session(key)
  local f = redis.call('HMGET', key, unpack(FIELDS))
  if not f["""
    + str(SESSION_FIELDS.index("st") + 1)
    + """] then return nil end
  local s = {}
  for i, name in ipairs(FIELDS) do
    if f[i] then s[name] = f[i] end
  end
  return s
end
local function due(s)
  return math.min(tonumber(s.dl), tonumber(s.lexp))
end
local function settle(key, sid, s)
  if TERMINAL[s.st] then
    redis.call('ZREM', KEYS[2], sid)
    redis.call('SREM', OP .. s.src, sid)
    redis.call('SREM', OP .. s.dst, sid)
    redis.call('ZADD', KEYS[3], now + retain, sid)
    redis.call('PEXPIRE', key, retain + 60000)
    redis.call('PEXPIRE', RP .. s.rid, retain + 60000)
  else
    redis.call('ZADD', KEYS[2], due(s), sid)
  end
end
-- Moves the loaded session `s` to state `st`; `extra` holds further field/value pairs of
-- the same change (bytes done, the renewed lease expiry).
local function change(key, sid, s, st, by, why, extra)
  s.ver = (tonumber(s.ver) or 0) + 1
  s.st, s.upd, s.by = st, now, by
  local args = {'HSET', key, 'st', st, 'upd', now, 'by', by, 'ver', s.ver}
  if why then
    args[#args + 1] = 'why'
    args[#args + 1] = why
    s.why = why
  end
  if extra then
    for i = 1, #extra, 2 do
      args[#args + 1] = extra[i]
      args[#args + 1] = extra[i + 1]
      s[extra[i]] = extra[i + 1]
    end
  end
  redis.call(unpack(args))
  settle(key, sid, s)
  return emit(s)
end
local function expiry_reason(s)
  if tonumber(s.dl) < now then return 'deadline_exceeded' end
  return 'session_lease_expired'
end
"""
    + LEASE_RULE
    + """
-- a worker's lease by the registry's rule, its post-outage grace included, so a KV session
-- and its parties' credentials outlive a Redis outage exactly as the registration does
-- (the grace hash is read only for a lease past its expiry)
local function lease_ok(exp)
  if exp >= now then return true end
  local g = redis.call('HMGET', '@RG@', 'from', 'until', 'alive', 'gap')
  return lease_live(exp, tonumber(g[1] or '0') or 0, tonumber(g[2] or '0') or 0,
                    tonumber(g[3] or '0') or 0, tonumber(g[4] or '0') or 0)
end
local function live(wid)
  local exp = redis.call('HGET', RW .. wid, '@F_EXP@')
  return exp and lease_ok(tonumber(exp))
end
local function authorized(actor, cred, src, dst)
  if actor == '' then return 'ok' end
  if actor ~= src and actor ~= dst then return 'not_party' end
  local w = redis.call('HMGET', RW .. actor, '@F_CRED@', '@F_EXP@')
  if not w[1] or w[1] ~= cred or not lease_ok(tonumber(w[2] or '0')) then return 'denied' end
  return 'ok'
end
"""
)

# ARGV 2 sid, 3 rid, 4 src, 5 dst, 6 actor ('' = scheduler), 7 credential hash,
# 8 expected bytes, 9 deadline ms, 10 lease ttl ms, 11 negotiation JSON, 12 fingerprint,
# 13 '1' = only look the request id up (answers 'none' rather than opening).
OPEN = (
    PRELUDE
    + """
local sid, rid, src, dst = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local a = authorized(ARGV[6], ARGV[7], src, dst)
if a ~= 'ok' then return {a} end
local rkey = RP .. rid
local old = redis.call('GET', rkey)
if old then
  local okey = SP .. old
  local prior = read_session(okey)
  if prior then
    if redis.call('HGET', okey, 'fp') ~= ARGV[12] then return {'conflict', old} end
    if not TERMINAL[prior.st] and due(prior) < now then
      return {'same_expired', change(okey, old, prior, 'EXPIRED', 'broker', expiry_reason(prior))}
    end
    return {'same', values(prior)}
  end
end
if ARGV[13] == '1' then return {'none'} end
if not live(src) then return {'gone', src} end
if not live(dst) then return {'gone', dst} end
local key = SP .. sid
local by = ARGV[6]
if by == '' then by = 'scheduler' end
local ttl = tonumber(ARGV[10])
local h = pairs_of({sid = sid, rid = rid, src = src, dst = dst, st = 'NEGOTIATED', exb = ARGV[8],
  done = 0, crt = now, upd = now, dl = ARGV[9], lexp = now + ttl, ttl = ttl, why = '', ver = 1,
  by = by, neg = ARGV[11]})
redis.call('HSET', key, 'fp', ARGV[12], unpack(h))
redis.call('XADD', KEYS[5], 'MAXLEN', '~', @FEEDMAX@, '*', unpack(h))
redis.call('SET', rkey, sid)
redis.call('ZADD', KEYS[1], 0, sid)
redis.call('SADD', OP .. src, sid)
redis.call('SADD', OP .. dst, sid)
redis.call('SADD', KEYS[4], src, dst)
redis.call('ZADD', KEYS[2], math.min(tonumber(ARGV[9]), now + ttl), sid)
return {'created'}
"""
)

# ARGV 2 sid, 3 op, 4 actor ('' = scheduler), 5 credential hash, 6 bytes ('' = none),
# 7 reason.
TRANSITION = (
    PRELUDE
    + "local T = "
    + lua_transition_table()
    + """
local sid, op, actor = ARGV[2], ARGV[3], ARGV[4]
local key = SP .. sid
local s = read_session(key)
if not s then return {'missing'} end
local a = authorized(actor, ARGV[5], s.src, s.dst)
if a ~= 'ok' then return {a} end
local st = s.st
local by = actor
if by == '' then by = 'scheduler' end
if not TERMINAL[st] and due(s) < now then
  return {'expired_first', change(key, sid, s, 'EXPIRED', 'broker', expiry_reason(s))}
end
local nxt = T[st] and T[st][op]
if not nxt then return {'illegal', values(s)} end
if nxt == st and TERMINAL[st] then return {'unchanged', values(s)} end
if op == 'reserve' or op == 'progress' then
  local done = tonumber(s.done)
  if ARGV[6] ~= '' then
    local b = tonumber(ARGV[6])
    if b < done then return {'backwards', values(s)} end
    if b > tonumber(s.exb) then return {'overflow', values(s)} end
    done = b
  end
  local extra = {'done', done, 'lexp', now + tonumber(s.ttl)}
  return {'applied', change(key, sid, s, nxt, by, nil, extra)}
elseif op == 'complete' or op == 'finish' then
  return {'applied', change(key, sid, s, nxt, by, nil, {'done', s.exb})}
end
local why = ARGV[7]
if op == 'expire' and why == '' then why = expiry_reason(s) end
return {'applied', change(key, sid, s, nxt, by, why)}
"""
)

# ARGV 2 batch limit. Expires overdue sessions, fails the open sessions of workers whose
# registry lease is gone, purges terminal sessions past retention.
SWEEP = (
    PRELUDE
    + """
local limit = tonumber(ARGV[2])
local changed = {}
local overdue = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. now, 'LIMIT', 0, limit)
for _, sid in ipairs(overdue) do
  local key = SP .. sid
  local s = read_session(key)
  if s and not TERMINAL[s.st] then
    if due(s) < now then
      changed[#changed + 1] = change(key, sid, s, 'EXPIRED', 'broker', expiry_reason(s))
    end
  else
    redis.call('ZREM', KEYS[2], sid)
  end
end
for _, wid in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  if redis.call('SCARD', OP .. wid) == 0 then
    redis.call('SREM', KEYS[4], wid)
  elseif not live(wid) then
    local why = 'worker_gone: ' .. wid
    if redis.call('EXISTS', RW .. wid) == 1 then why = 'worker_lease_expired: ' .. wid end
    for _, sid in ipairs(redis.call('SMEMBERS', OP .. wid)) do
      local key = SP .. sid
      local s = read_session(key)
      if s and not TERMINAL[s.st] then
        changed[#changed + 1] = change(key, sid, s, 'FAILED', 'broker', why)
      else
        redis.call('SREM', OP .. wid, sid)
      end
    end
    redis.call('SREM', KEYS[4], wid)
  end
end
local purged = 0
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. now, 'LIMIT', 0, limit)) do
  local key = SP .. sid
  local rid = redis.call('HGET', key, 'rid')
  if rid and redis.call('GET', RP .. rid) == sid then redis.call('DEL', RP .. rid) end
  redis.call('DEL', key)
  redis.call('ZREM', KEYS[1], sid)
  redis.call('ZREM', KEYS[3], sid)
  purged = purged + 1
end
return {changed, purged, redis.call('ZCARD', KEYS[2])}
"""
)

# ARGV 2 worker id, 3 reason. Fails every open session of one worker (it left the fleet).
FAIL_WORKER = (
    PRELUDE
    + """
local wid = ARGV[2]
local changed = {}
for _, sid in ipairs(redis.call('SMEMBERS', OP .. wid)) do
  local key = SP .. sid
  local s = read_session(key)
  if s and not TERMINAL[s.st] then
    changed[#changed + 1] = change(key, sid, s, 'FAILED', 'broker', ARGV[3])
  else
    redis.call('SREM', OP .. wid, sid)
  end
end
return changed
"""
)

BY_REQUEST = """
local sid = redis.call('GET', ARGV[1] .. ARGV[2])
if not sid then return {} end
return redis.call('HGETALL', ARGV[3] .. sid)
"""
