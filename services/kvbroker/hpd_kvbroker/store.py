"""The broker's Redis store: every session change is one Lua script, atomic with its checks.

Each mutating script checks the caller (its registry credential and lease, read from the
registry's worker hash in the same script), applies `domain.TRANSITIONS` (embedded as a
Lua table generated from the Python dict), keeps the indexes, bumps the version and
appends the change to the feed in one step. So an illegal transition changes nothing, two
replicas can never both apply a change to one version, and the sweeper, which picks and
expires overdue sessions inside one script, expires each exactly once however many
replicas run it. Key layout: `hpd_kvbroker.keys`.

Script results are `{status, <the session's SESSION_FIELDS values, in order>}`; statuses mirror
`domain.Status` plus the authorisation outcomes `denied`, `not_party`, `missing`, and the open
script's own (`SessionStore.open`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from hpd_common.errors import Unavailable
from hpd_common.kvformat import Negotiation
from hpd_common.redis_conn import STORE_DOWN
from hpd_kvbroker.domain import (
    Session,
    SessionState,
    lua_terminal_set,
    lua_transition_table,
    negotiation_from_dict,
)
from hpd_kvbroker.keys import KvKeys
from hpd_registry.keys import RegistryKeys

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
_PRELUDE = (
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
-- a worker's lease as the registry judges it, its post-outage grace included (the
-- registry's keys.py: a lease that ran out while no registry could write to Redis stays
-- live until its worker's next heartbeat), so a KV session and its parties' credentials
-- outlive a Redis outage exactly as the registration does
local function lease_ok(exp)
  if exp >= now then return true end
  local g = redis.call('HMGET', '@RG@', 'from', 'until', 'alive', 'gap')
  local from, untl = tonumber(g[1] or '0') or 0, tonumber(g[2] or '0') or 0
  local alive, gap = tonumber(g[3] or '0') or 0, tonumber(g[4] or '0') or 0
  if now < untl and exp >= from then return true end
  return alive > 0 and gap > 0 and now - alive > gap and exp >= alive
end
local function live(wid)
  local exp = redis.call('HGET', RW .. wid, 'exp')
  return exp and lease_ok(tonumber(exp))
end
local function authorized(actor, cred, src, dst)
  if actor == '' then return 'ok' end
  if actor ~= src and actor ~= dst then return 'not_party' end
  local w = redis.call('HMGET', RW .. actor, 'cred', 'exp')
  if not w[1] or w[1] ~= cred or not lease_ok(tonumber(w[2] or '0')) then return 'denied' end
  return 'ok'
end
"""
)

# ARGV 2 sid, 3 rid, 4 src, 5 dst, 6 actor ('' = scheduler), 7 credential hash,
# 8 expected bytes, 9 deadline ms, 10 lease ttl ms, 11 negotiation JSON, 12 fingerprint,
# 13 '1' = only look the request id up (answers 'none' rather than opening).
_OPEN = (
    _PRELUDE
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
_TRANSITION = (
    _PRELUDE
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
_SWEEP = (
    _PRELUDE
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
_FAIL_WORKER = (
    _PRELUDE
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

_BY_REQUEST = """
local sid = redis.call('GET', ARGV[1] .. ARGV[2])
if not sid then return {} end
return redis.call('HGETALL', ARGV[3] .. sid)
"""


_SAFE = re.compile(r"^[A-Za-z0-9._:{}\-]+$")
"""What a key prefix or number may contain to be written into a Lua string literal."""


def _s(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


_COMPATIBLE = '{"verdict":"compatible"}'
"""The negotiation of a session stored without one."""


@functools.lru_cache(maxsize=4096)
def _negotiation(text: str) -> Negotiation:
    """Stored negotiations repeat (a fleet has few format pairs): decode each text once."""
    return negotiation_from_dict(json.loads(text))


def decode_session(fields: Mapping[Any, Any]) -> Session:
    """A session from its hash fields (as stored, or as carried by a feed entry)."""
    return _decode(
        {
            (k.decode() if type(k) is bytes else str(k)): (
                v.decode() if type(v) is bytes else str(v)
            )
            for k, v in fields.items()
        }
    )


_STATES = {state.value.encode(): state for state in SessionState}


def decode_values(values: Sequence[Any]) -> Session:
    """A session from a script's reply: `SESSION_FIELDS`' values in order (bytes; a number
    the script computed comes as an integer).

    Every change's reply goes through here, so it reads the values by position (no
    intermediate dict) and parses numbers from the bytes directly."""
    sid, rid, src, dst, st, exb, done, crt, upd, dl, lexp, ttl, why, ver, by, neg = values
    return Session(
        session_id=sid.decode(),
        request_id=rid.decode(),
        source_worker_id=src.decode(),
        destination_worker_id=dst.decode(),
        state=_STATES[st],
        expected_bytes=int(exb or 0),
        bytes_done=int(done or 0),
        created_ms=int(crt or 0),
        updated_ms=int(upd or 0),
        deadline_ms=int(dl or 0),
        lease_expires_ms=int(lexp or 0),
        lease_ttl_ms=int(ttl or 0),
        negotiation=_negotiation(neg.decode() if neg else _COMPATIBLE),
        reason=why.decode(),
        version=int(ver or 0),
        updated_by=by.decode(),
    )


def decode_flat(flat: Sequence[Any]) -> Session:
    """A session from HGETALL's flat [field, value, ...] reply (bytes)."""
    it = iter(flat)
    return decode_session(dict(zip(it, it, strict=True)))


def _decode(f: dict[str, str]) -> Session:
    return Session(
        session_id=f["sid"],
        request_id=f.get("rid", ""),
        source_worker_id=f.get("src", ""),
        destination_worker_id=f.get("dst", ""),
        state=SessionState(f["st"]),
        expected_bytes=int(f.get("exb") or 0),
        bytes_done=int(f.get("done") or 0),
        created_ms=int(f.get("crt") or 0),
        updated_ms=int(f.get("upd") or 0),
        deadline_ms=int(f.get("dl") or 0),
        lease_expires_ms=int(f.get("lexp") or 0),
        lease_ttl_ms=int(f.get("ttl") or 0),
        negotiation=_negotiation(f.get("neg") or _COMPATIBLE),
        reason=f.get("why", ""),
        version=int(f.get("ver") or 0),
        updated_by=f.get("by", ""),
    )


@dataclass(frozen=True, slots=True)
class Result:
    """A script's status and the session as it is after the script (None if there is none)."""

    status: str
    session: Session | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class SweepResult:
    changed: list[Session] = field(default_factory=list)
    purged: int = 0
    open_sessions: int = 0


@dataclass(frozen=True, slots=True)
class OpenArgs:
    session_id: str
    request_id: str
    source_worker_id: str
    destination_worker_id: str
    expected_bytes: int
    deadline_ms: int
    lease_ttl_ms: int
    negotiation_json: str

    def created(self, by: str, now_ms: int) -> Session:
        """The session the open script stores for these arguments at `now_ms`."""
        return Session(
            session_id=self.session_id,
            request_id=self.request_id,
            source_worker_id=self.source_worker_id,
            destination_worker_id=self.destination_worker_id,
            state=SessionState.NEGOTIATED,
            expected_bytes=self.expected_bytes,
            bytes_done=0,
            created_ms=now_ms,
            updated_ms=now_ms,
            deadline_ms=now_ms + self.deadline_ms,
            lease_expires_ms=now_ms + self.lease_ttl_ms,
            lease_ttl_ms=self.lease_ttl_ms,
            negotiation=_negotiation(self.negotiation_json),
            reason="",
            version=1,
            updated_by=by,
        )

    @property
    def fingerprint(self) -> str:
        """What a retry must repeat to be the same request (deadline and lease may differ)."""
        return f"{self.source_worker_id}|{self.destination_worker_id}|{self.expected_bytes}"


def _unavailable(exc: Exception) -> Unavailable:
    return Unavailable(f"state store unavailable: {exc}")


class SessionStore:
    """Sessions in Redis. Raises `Unavailable` when Redis cannot be reached."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: KvKeys,
        registry_keys: RegistryKeys,
        retention_ms: int,
        feed_max_len: int = 100_000,
    ) -> None:
        self.client = client
        self.keys = keys
        self.registry_keys = registry_keys
        self.retention_ms = retention_ms
        self.feed_max_len = feed_max_len
        self._keys = (keys.ids, keys.due, keys.done, keys.busy, keys.feed)  # every script's KEYS
        self._open = client.register_script(self._render(_OPEN))
        self._transition = client.register_script(self._render(_TRANSITION))
        self._sweep = client.register_script(self._render(_SWEEP))
        self._fail_worker = client.register_script(self._render(_FAIL_WORKER))
        self._by_request = client.register_script(_BY_REQUEST)

    def _render(self, script: str) -> str:
        """The script with this store's constants in place of the @NAME@ markers."""
        values = {
            "@SP@": self.keys.session_prefix,
            "@RP@": self.keys.request_prefix,
            "@OP@": self.keys.open_prefix,
            "@RW@": self.registry_keys.worker_prefix,
            "@RG@": self.registry_keys.grace,
            "@RETAIN@": str(int(self.retention_ms)),
            "@FEEDMAX@": str(int(self.feed_max_len)),
        }
        for marker, value in values.items():
            if not _SAFE.match(value):
                raise ValueError(f"unsafe value {value!r} for a Lua script constant")
            script = script.replace(marker, value)
        return script

    async def _call(self, script: Any, now_ms: int, *rest: Any) -> Any:
        try:
            return await script(keys=self._keys, args=(now_ms, *rest))
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc

    @staticmethod
    def _result(raw: Sequence[Any]) -> Result:
        status = _s(raw[0])
        if len(raw) < 2:
            return Result(status)
        if isinstance(raw[1], list):
            return Result(status, decode_values(raw[1]) if raw[1] else None)
        return Result(status, detail=_s(raw[1]))

    async def open(
        self, a: OpenArgs, actor: str, cred_hash: str, now_ms: int, existing_only: bool = False
    ) -> Result:
        """created | same (the request id's session) | same_expired (it was overdue: now
        EXPIRED) | conflict | gone (detail: worker id) | denied | not_party; with
        `existing_only`, none instead of opening a session."""
        raw = await self._call(
            self._open,
            now_ms,
            a.session_id,
            a.request_id,
            a.source_worker_id,
            a.destination_worker_id,
            actor,
            cred_hash,
            a.expected_bytes,
            now_ms + a.deadline_ms,
            a.lease_ttl_ms,
            a.negotiation_json,
            a.fingerprint,
            "1" if existing_only else "",
        )
        if _s(raw[0]) == "created":  # the script stored exactly this: no need to send it back
            return Result("created", a.created(actor or "scheduler", now_ms))
        return self._result(raw)

    async def transition(
        self,
        session_id: str,
        op: str,
        actor: str,
        cred_hash: str,
        now_ms: int,
        bytes_done: int | None = None,
        reason: str = "",
    ) -> Result:
        """applied | unchanged | illegal | backwards | overflow | expired_first | missing |
        denied | not_party."""
        raw = await self._call(
            self._transition,
            now_ms,
            session_id,
            op,
            actor,
            cred_hash,
            "" if bytes_done is None else bytes_done,
            reason,
        )
        return self._result(raw)

    async def sweep(self, now_ms: int, limit: int = 1000) -> SweepResult:
        changed, purged, open_count = await self._call(self._sweep, now_ms, limit)
        return SweepResult([decode_values(x) for x in changed], int(purged), int(open_count))

    async def fail_worker(self, worker_id: str, reason: str, now_ms: int) -> list[Session]:
        raw = await self._call(self._fail_worker, now_ms, worker_id, reason)
        return [decode_values(x) for x in raw]

    async def get(self, session_id: str) -> Session | None:
        try:
            fields = await self.client.hgetall(self.keys.session(session_id))
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return decode_session(fields) if fields else None

    async def get_by_request(self, request_id: str) -> Session | None:
        try:
            flat = await self._by_request(
                keys=[self.keys.ids],
                args=[self.keys.request_prefix, request_id, self.keys.session_prefix],
            )
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return decode_flat(flat) if flat else None

    async def page(self, after: str, count: int) -> tuple[list[Session], str | None]:
        """The kept sessions among the next `count` ids strictly after `after`, in id order,
        and the last id looked at (None when there are no more ids). A session purged
        between the two reads is left out; the scan still moves past its id."""
        start = b"(" + after.encode() if after else b"-"
        try:
            ids = await self.client.zrangebylex(self.keys.ids, start, b"+", start=0, num=count)
            if not ids:
                return [], None
            async with self.client.pipeline(transaction=False) as pipe:
                for sid in ids:
                    pipe.hgetall(self.keys.session(_s(sid)))
                rows = await pipe.execute()
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return [decode_session(r) for r in rows if r], _s(ids[-1])

    async def has_more(self, after: str) -> bool:
        try:
            ids = await self.client.zrangebylex(
                self.keys.ids, b"(" + after.encode(), b"+", start=0, num=1
            )
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return bool(ids)

    async def feed_last_id(self) -> str:
        try:
            rows = await self.client.xrevrange(self.keys.feed, "+", "-", count=1)
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return _s(rows[0][0]) if rows else "0-0"

    async def feed_block(
        self, client: aioredis.Redis, after_id: str, block_ms: int, count: int = 1000
    ) -> list[tuple[str, str, Mapping[bytes, bytes]]]:
        """Feed entries after `after_id` as (entry id, session id, raw fields), blocking up to
        block_ms on a dedicated client. Decoding is left to the caller: most entries concern
        sessions nobody on this replica watches."""
        try:
            res = await client.xread({self.keys.feed: after_id}, count=count, block=block_ms)
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        if not res:
            return []
        _, rows = res[0]
        return [(_s(eid), _s(fields.get(b"sid")), fields) for eid, fields in rows]
