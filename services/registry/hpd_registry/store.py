"""The registry's Redis store: Lua scripts make every change and its feed entry atomic.

Each mutating script bumps the revision counter and appends to the change feed in
the same step as the write, so watchers can never see a change without its event,
or an event without its change, and several registry replicas can share one Redis
(expiry is decided inside a script, so each lease expires exactly once).
Key layout: `hpd_registry.keys`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from hpd_common.errors import Unavailable
from hpd_common.logging import get_logger
from hpd_common.redis_conn import STORE_DOWN
from hpd_registry.domain import Directive, LoadReport, WorkerRecord, WorkerSpec, WorkerState
from hpd_registry.keys import RegistryKeys

log = get_logger("registry.store")

# KEYS: 1 ids, 2 lease, 3 hb, 4 lat, 5 rev, 6 feed.
# ARGV: 1 now_ms, 2 feed max length, 3 worker key prefix, 4 directive key prefix, then per script.
_PRELUDE = """
local now = tonumber(ARGV[1])
-- Leases are judged by time in which a registry could write here (KEYS[7], kept by the
-- sweeper): 'alive' is its last sweep, 'gap' how long without one means an outage (Redis
-- or every registry away). After one, a lease that ran out since the last sweep before it
-- is still live: at once (no sweep yet: now - alive > gap) and, once the first sweep after
-- the outage has written 'from' and 'until', until one lease after the outage ended.
local grace = redis.call('HMGET', KEYS[7], 'from', 'until', 'alive', 'gap')
local grace_from = tonumber(grace[1] or '0') or 0
local grace_until = tonumber(grace[2] or '0') or 0
local alive = tonumber(grace[3] or '0') or 0
local gap = tonumber(grace[4] or '0') or 0
local function lapsed_ok(exp)
  if now < grace_until and exp >= grace_from then return true end
  return alive > 0 and gap > 0 and now - alive > gap and exp >= alive
end
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
  return exp >= now or lapsed_ok(exp)
end
"""

# ARGV 5 id, 6 presented credential hash ('' = none), 7 new credential hash, 8 spec, 9 ttl.
_REGISTER = (
    _PRELUDE
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
_HEARTBEATS = (
    _PRELUDE
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
_DEREGISTER = (
    _PRELUDE
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
_KV_EVENTS = (
    _PRELUDE
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
_ADMIN = (
    _PRELUDE
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
_SWEEP = (
    _PRELUDE
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
_SNAPSHOT = """
local out = {redis.call('GET', KEYS[5]) or '0'}
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGETALL', ARGV[1] .. id)
end
return out
"""


def credential_hash(credential: str) -> str:
    """Credentials are stored only as their SHA-256."""
    return hashlib.sha256(credential.encode()).hexdigest() if credential else ""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class HeartbeatItem:
    worker_id: str
    credential_hash: str
    ttl_ms: int
    load: LoadReport | None
    health: str  # '' (no change), 'ok' or 'bad'
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    status: str  # ok, gone, denied
    lease_expires_at_ms: int
    pending_directives: int
    unhealthy: bool
    draining: bool
    cordoned: bool
    reason: str
    lease_ttl_ms: int


@dataclass(frozen=True, slots=True)
class FeedEntry:
    """One change-feed entry, decoded."""

    revision: int
    kind: str  # put, load, del; skip: unreadable (damaged, or of a newer kind), move past it
    worker_id: str
    record: WorkerRecord | None = None  # put
    load: LoadReport | None = None  # load
    last_heartbeat_ms: int = 0  # load
    reason: str = ""  # del


def _s(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


_LOAD_TAG = b"\x00\x02"
"""Starts a load report stored in binary (version 2); no JSON text starts with NUL."""
_LOAD_BIN = struct.Struct(
    "<" + "".join("d" if t == "float" else "q" for t in LoadReport.__annotations__.values())
)
"""Every LoadReport field in declaration order: float as float64, int as int64."""
_LOAD_FIELDS = tuple(LoadReport.__annotations__)
_LOAD_TAG_V1 = b"\x00\x01"
_LOAD_BIN_V1 = struct.Struct("<" + "d" * 4 + "q" * 4 + "d" * 4 + "q")
"""Version 1: the first 13 fields (before ``prefix_cache_hit_rate``), still read back."""


def encode_load(load: LoadReport) -> bytes:
    """A load report as stored: the tag, then every field packed little-endian.

    Sorted JSON cost about 6 us to write and 8 us to read back here, and every heartbeat
    pays both (the store, then the change feed watchers are fed from); this is a fraction
    of that. A report that does not pack (a number out of int64 range, say: the service
    validates before storing) is stored as JSON, which `decode_load` also reads.
    """
    try:
        return _LOAD_TAG + _LOAD_BIN.pack(*(getattr(load, name) for name in _LOAD_FIELDS))
    except struct.error:
        return canonical_json(load.to_dict()).encode()


def decode_load(raw: bytes | str) -> LoadReport:
    """A stored load report: the binary form (either version), or JSON (as earlier
    versions wrote it)."""
    if isinstance(raw, bytes) and raw[:2] == _LOAD_TAG:
        return LoadReport(*_LOAD_BIN.unpack(raw[2:]))
    if isinstance(raw, bytes) and raw[:2] == _LOAD_TAG_V1:
        return LoadReport(*_LOAD_BIN_V1.unpack(raw[2:]))
    return LoadReport.from_dict(json.loads(raw))


def decode_record(fields: Mapping[Any, Any]) -> WorkerRecord:
    """A worker record from its hash fields (as stored, or as carried by a put event)."""
    f: dict[str, str] = {}
    raw_load: bytes | str | None = None
    for k, v in fields.items():
        name = _s(k)
        if name == "load":
            raw_load = v  # binary: decoded by decode_load, not as text
        else:
            f[name] = _s(v)
    state = WorkerState(
        registered_at_ms=int(f.get("reg") or 0),
        last_heartbeat_ms=int(f.get("hb") or 0),
        lease_expires_at_ms=int(f.get("exp") or 0),
        lease_ttl_ms=int(f.get("ttl") or 0),
        suspect=f.get("sus") == "1",
        unhealthy=f.get("unh") == "1",
        unhealthy_reason=f.get("why", ""),
        draining=f.get("drn") == "1",
        cordoned=f.get("cor") == "1",
        admin_reason=f.get("adm", ""),
    )
    load = decode_load(raw_load) if raw_load else None
    return WorkerRecord(
        spec=WorkerSpec.from_dict(json.loads(f["spec"])),
        state=state,
        load=load,
        revision=int(f.get("rev") or 0),
    )


def decode_feed_entry(entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> FeedEntry:
    """One feed row. A row that does not decode (a damaged entry, or a kind a newer version
    writes) comes back as kind ``skip``: readers move past its revision. Failing the read
    instead would stall every watcher on that row until the feed's cap trims it."""
    rev = int(_s(entry_id).split("-", 1)[0])
    f = {_s(k): v for k, v in fields.items()}
    kind = _s(f.get("t"))
    worker_id = _s(f.get("id"))
    try:
        if kind == "put":
            return FeedEntry(rev, kind, worker_id, record=decode_record(f))
        if kind == "load":
            return FeedEntry(
                rev,
                kind,
                worker_id,
                load=decode_load(f.get("load") or b""),
                last_heartbeat_ms=int(_s(f.get("hb")) or 0),
            )
        if kind == "del":
            return FeedEntry(rev, kind, worker_id, reason=_s(f.get("why")))
        raise ValueError(f"unknown kind {kind!r}")
    except Exception as exc:  # any decoding failure: the row is unreadable
        log.warning("feed_entry_unreadable", revision=rev, worker_id=worker_id, error=repr(exc))
        return FeedEntry(rev, "skip", worker_id)


def _unavailable(exc: Exception) -> Unavailable:
    return Unavailable(f"state store unavailable: {exc}")


class RegistryStore:
    """Registry state in Redis. Raises `Unavailable` when Redis cannot be reached."""

    def __init__(self, client: aioredis.Redis, keys: RegistryKeys, feed_max_len: int = 100_000):
        self.client = client
        self.keys = keys
        self.feed_max_len = feed_max_len
        self._register = client.register_script(_REGISTER)
        self._heartbeats = client.register_script(_HEARTBEATS)
        self._deregister = client.register_script(_DEREGISTER)
        self._admin = client.register_script(_ADMIN)
        self._sweep = client.register_script(_SWEEP)
        self._snapshot = client.register_script(_SNAPSHOT)
        self._kv_events = client.register_script(_KV_EVENTS)

    @property
    def _keys(self) -> list[str]:
        k = self.keys
        return [
            k.ids, k.lease, k.heartbeats, k.load_times, k.revision, k.feed, k.grace, k.kv_events,
        ]  # fmt: skip

    def _argv(self, now_ms: int, *rest: Any) -> list[Any]:
        return [
            now_ms,
            self.feed_max_len,
            self.keys.worker_prefix,
            self.keys.directive_prefix,
            *rest,
        ]

    async def _call(self, script: Any, now_ms: int, *rest: Any) -> Any:
        try:
            return await script(keys=self._keys, args=self._argv(now_ms, *rest))
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc

    async def register(
        self, spec: WorkerSpec, presented_hash: str, new_hash: str, ttl_ms: int, now_ms: int
    ) -> tuple[str, int]:
        """('created' | 'changed' | 'same' | 'exists', revision)."""
        spec_json = canonical_json(spec.to_dict())
        status, rev = await self._call(
            self._register, now_ms, spec.worker_id, presented_hash, new_hash, spec_json, ttl_ms
        )
        return _s(status), int(rev)

    async def heartbeats(
        self, items: Sequence[HeartbeatItem], now_ms: int
    ) -> list[HeartbeatResult]:
        """Renews many leases and stores many load reports in one round trip."""
        args: list[Any] = [len(items)]
        for it in items:
            load = encode_load(it.load) if it.load is not None else b""
            lat = it.load.reported_at_ms if it.load is not None else 0
            args += [
                it.worker_id,
                it.credential_hash,
                it.ttl_ms,
                load,
                lat,
                it.health,
                it.reason,
            ]
        raw = await self._call(self._heartbeats, now_ms, *args)
        out = []
        for i in range(len(items)):
            s, exp, dirs, unh, drn, cor, why, ttl = raw[i * 8 : i * 8 + 8]
            out.append(
                HeartbeatResult(
                    status=_s(s),
                    lease_expires_at_ms=int(exp),
                    pending_directives=int(dirs),
                    unhealthy=_s(unh) == "1",
                    draining=_s(drn) == "1",
                    cordoned=_s(cor) == "1",
                    reason=_s(why),
                    lease_ttl_ms=int(ttl),
                )
            )
        return out

    async def deregister(self, worker_id: str, cred_hash: str, now_ms: int) -> tuple[str, int]:
        status, rev = await self._call(self._deregister, now_ms, worker_id, cred_hash)
        return _s(status), int(rev)

    async def admin(self, worker_id: str, op: str, reason: str, now_ms: int) -> tuple[str, int]:
        status, rev = await self._call(self._admin, now_ms, worker_id, op, reason)
        return _s(status), int(rev)

    async def sweep(
        self,
        now_ms: int,
        stale_before_ms: int,
        limit: int = 500,
        grace_ms: int = 0,
        outage_gap_ms: int = 0,
    ) -> tuple[list[str], list[str], tuple[int, int]]:
        """Expires overdue leases and flags SUSPECT workers (two missed heartbeat intervals,
        or a load report older than stale_before_ms); returns (expired, suspected) ids and
        the post-outage grace (from, until) in force (0, 0 when none).

        Also the outage rule (``keys.py``): when no sweep ran for over ``outage_gap_ms``
        (Redis, or every registry, away), leases that ran out since the last sweep stay
        live for ``grace_ms`` more. ``outage_gap_ms`` 0 turns the rule off."""
        gap = outage_gap_ms if outage_gap_ms > 0 else 2**52
        expired, suspects, g_from, g_until, _ = await self._call(
            self._sweep, now_ms, grace_ms, stale_before_ms, limit, gap
        )
        grace = (int(g_from or 0), int(g_until or 0))
        return [_s(x) for x in expired], [_s(x) for x in suspects], grace

    async def snapshot(self) -> tuple[int, list[WorkerRecord]]:
        """The revision and every worker, atomically."""
        try:
            raw = await self._snapshot(keys=self._keys, args=[self.keys.worker_prefix])
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        rev = int(raw[0])
        records = []
        for i in range(1, len(raw), 2):
            flat = raw[i + 1]
            if not flat:
                continue
            fields = {flat[j]: flat[j + 1] for j in range(0, len(flat), 2)}
            records.append(decode_record(fields))
        return rev, records

    async def append_kv_events(
        self, worker_id: str, cred_hash: str, block_tokens: int, events_json: str,
        now_ms: int, max_len: int,
    ) -> str:  # fmt: skip
        """'ok', 'gone' (no live worker) or 'denied' (wrong credential)."""
        out = await self._call(
            self._kv_events, now_ms, worker_id, cred_hash, block_tokens, events_json, max_len
        )
        return _s(out)

    async def credential_matches(self, worker_id: str, cred_hash: str) -> bool:
        """Whether ``cred_hash`` is the worker's current credential (False when unknown)."""
        try:
            stored = await self.client.hget(self.keys.worker(worker_id), "cred")
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        if stored is None or not cred_hash:
            return False
        value = stored.decode() if isinstance(stored, bytes) else str(stored)
        return hmac.compare_digest(value, cred_hash)

    async def get(self, worker_id: str) -> WorkerRecord | None:
        try:
            fields = await self.client.hgetall(self.keys.worker(worker_id))
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return decode_record(fields) if fields else None

    async def page_ids(self, after: str, count: int) -> list[str]:
        """Worker ids in lexicographic order strictly after `after`."""
        start = b"(" + after.encode() if after else b"-"
        try:
            ids = await self.client.zrangebylex(self.keys.ids, start, b"+", start=0, num=count)
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return [_s(x) for x in ids]

    async def get_many(self, worker_ids: Sequence[str]) -> list[WorkerRecord]:
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for wid in worker_ids:
                    pipe.hgetall(self.keys.worker(wid))
                rows = await pipe.execute()
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return [decode_record(r) for r in rows if r]

    async def revision(self) -> int:
        try:
            raw = await self.client.get(self.keys.revision)
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return int(raw or 0)

    async def first_feed_revision(self) -> int | None:
        """Revision of the oldest entry the feed still holds (None if empty)."""
        try:
            rows = await self.client.xrange(self.keys.feed, "-", "+", count=1)
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return int(_s(rows[0][0]).split("-")[0]) if rows else None

    async def feed_after(self, revision: int, count: int = 1000) -> list[FeedEntry]:
        """Feed entries with revision > `revision`, oldest first."""
        try:
            rows = await self.client.xrange(self.keys.feed, f"{revision + 1}-0", "+", count=count)
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return [decode_feed_entry(eid, fields) for eid, fields in rows]

    async def feed_block(
        self, client: aioredis.Redis, revision: int, block_ms: int, count: int = 1000
    ) -> list[FeedEntry]:
        """Blocks up to block_ms for entries after `revision` (on a dedicated connection)."""
        try:
            res = await client.xread({self.keys.feed: f"{revision}-0"}, count=count, block=block_ms)
        except ResponseError:
            raise
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        if not res:
            return []
        _, rows = res[0]
        return [decode_feed_entry(eid, fields) for eid, fields in rows]

    async def push_directive(self, worker_id: str, directive: Directive) -> None:
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.rpush(self.keys.directives(worker_id), canonical_json(directive.to_dict()))
                pipe.publish(self.keys.directive_channel, worker_id)
                await pipe.execute()
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc

    async def pop_directives(self, worker_id: str, count: int = 100) -> list[Directive]:
        try:
            raw = await self.client.lpop(self.keys.directives(worker_id), count)
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return [Directive.from_dict(json.loads(x)) for x in (raw or [])]

    async def requeue_directives(self, worker_id: str, directives: Sequence[Directive]) -> None:
        """Puts undelivered directives back at the head, in order."""
        if not directives:
            return
        payload = [canonical_json(d.to_dict()) for d in reversed(directives)]
        try:
            await self.client.lpush(self.keys.directives(worker_id), *payload)
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
