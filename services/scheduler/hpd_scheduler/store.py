"""The scheduler's Redis store: reservations, route records, the record index.

Why Lua: `Schedule` must cost one Redis round trip. `_RESERVE` does, atomically, what
would otherwise be four or five commands racing with other replicas:

1. idempotency: a request id that already has a (non-reject) record returns that record;
2. purge up to `purge_limit` lapsed reservations (their totals go back);
3. the capacity check on the decode worker: ``reserved_kv + kv <= kv_capacity`` and
   ``reserved_slots + 1 <= slot_capacity``, where the capacities are what this replica
   knows of the worker (its reported free KV memory and free queue slots) and the
   reserved figures are the sum of every replica's live reservations;
4. the reservation (totals + a TTL'd per-request entry);
5. the route record head (the plan; it is also the idempotency key) and its index entry.

Because the check and the reservation are one script, two replicas can never together
hold more than the capacity they pass in: Redis runs scripts one at a time.
Key layout: `hpd_scheduler.keys`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from hpd_common.errors import Unavailable
from hpd_common.redis_conn import STORE_DOWN
from hpd_scheduler.keys import SchedulerKeys
from hpd_scheduler.policy.decision import decode_explanation

UNREADABLE_EXPLANATION = {"error": "explanation unreadable"}
"""What a record's explanation reads as when what is stored no longer decodes."""

# KEYS: 1 totals, 2 reservations, 3 expiry. Releases one reservation by request id.
_RELEASE_FN = """
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
_RESERVE_ONE_FN = """
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
_RESERVE = (
    _RELEASE_FN
    + _RESERVE_ONE_FN
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
# exactly as `_RESERVE` would do it alone (its purge at its own time included), in order
# (so a later entry sees what an earlier one reserved: two entries for one worker can never
# together pass its capacity, and a request id twice in one batch is a replay the second
# time).
# KEYS: 1 totals, 2 reservations, 3 expiry, 4 index, then one record key per entry.
# ARGV: 1 purge limit, 2 index cap, 3 fields per entry (12), then the entries' arguments
# (as `reserve_one` takes them). Returns one `reserve_one` answer per entry.
_RESERVE_BATCH = (
    _RELEASE_FN
    + _RESERVE_ONE_FN
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
_OUTCOME = (
    _RELEASE_FN
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
_PURGE = _RELEASE_FN + "return purge(tonumber(ARGV[1]), tonumber(ARGV[2]))\n"

# KEYS: record keys. ARGV: explanation JSONs, same order. Only records that still exist.
_EXPLAIN = """
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
_DIRECTIVE_CHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class ReserveStatus(enum.Enum):
    REPLAY = 0
    RESERVED = 1
    FULL = 2


@dataclass(frozen=True, slots=True)
class Totals:
    """Live reservations against one worker, summed over every replica."""

    kv_bytes: int = 0
    requests: int = 0
    prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ReserveResult:
    """REPLAY carries the stored head; RESERVED / FULL the decode worker's totals after
    (or, when full, at) the check, and the prefill worker's reserved tokens."""

    status: ReserveStatus
    head: dict[str, Any] | None = None
    decode: Totals = Totals()
    prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ReservationAsk:
    """What to reserve: ``kv_bytes`` and one queue slot on ``decode_worker_id`` (within
    ``kv_capacity`` / ``slot_capacity``, -1 = unbounded), ``prefill_tokens`` of pending
    prefill work on ``prefill_worker_id``."""

    decode_worker_id: str
    kv_bytes: int
    kv_capacity: int
    slot_capacity: int
    prefill_worker_id: str
    prefill_tokens: int


@dataclass(frozen=True, slots=True)
class ReserveEntry:
    """One `Schedule` call's reservation and record head, as `reserve` takes
    them; a batch of these is one script call (`SchedulerStore.reserve_batch`)."""

    request_id: str
    head: Mapping[str, Any]
    decision: str
    ask: ReservationAsk | None
    now_ms: int
    reservation_ttl_ms: int
    record_ttl_ms: int

    def args(self) -> list[Any]:
        a = self.ask or _NO_ASK
        return [
            self.now_ms, self.request_id, self.reservation_ttl_ms, self.record_ttl_ms,
            dumps(self.head), self.decision, a.decode_worker_id, a.kv_bytes, a.kv_capacity,
            a.slot_capacity, a.prefill_worker_id, a.prefill_tokens,
        ]  # fmt: skip


_NO_ASK = ReservationAsk("", 0, 0, -1, "", 0)
_ENTRY_WIDTH = 12  # ReserveEntry.args(); the batch script reads this many per entry


def _reserve_result(out: Sequence[Any]) -> ReserveResult:
    status = ReserveStatus(int(out[0]))
    if status is ReserveStatus.REPLAY:
        return ReserveResult(status, head=_json(out[1]))
    return ReserveResult(
        status, decode=Totals(int(out[1]), int(out[2])), prefill_tokens=int(out[3])
    )


@dataclass(frozen=True, slots=True)
class OutcomeResult:
    released: bool
    record_found: bool
    first_report: bool
    head: dict[str, Any] | None
    not_owner: bool = False  # the record names another caller: nothing was changed


@dataclass(frozen=True, slots=True)
class StoredRecord:
    head: dict[str, Any]
    explanation: dict[str, Any] | None
    outcome: dict[str, Any] | None


def _s(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _json(value: bytes | str | None) -> dict[str, Any] | None:
    if not value:
        return None
    out = json.loads(value)
    return out if isinstance(out, dict) else None


def dumps(obj: Any) -> str:
    """Compact JSON (records are read by tools and people, not only by us)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


class SchedulerStore:
    """Scheduler state in Redis. Raises `Unavailable` when Redis cannot be reached."""

    def __init__(self, client: aioredis.Redis, keys: SchedulerKeys) -> None:
        self.client = client
        self.keys = keys
        self._reserve = client.register_script(_RESERVE)
        self._reserve_batch = client.register_script(_RESERVE_BATCH)
        self._outcome = client.register_script(_OUTCOME)
        self._purge = client.register_script(_PURGE)
        self._explain = client.register_script(_EXPLAIN)
        self._directive = client.register_script(_DIRECTIVE_CHANGED)

    async def _run(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await script(keys=list(keys), args=list(args))
        except STORE_DOWN as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc

    async def reserve(
        self, entry: ReserveEntry, index_cap: int, purge_limit: int = 64
    ) -> ReserveResult:
        """The hot path's one round trip for one call (module docstring). ``entry.ask``
        None records a rejection and reserves nothing."""
        k = self.keys
        a = entry.args()
        out = await self._run(
            self._reserve,
            [k.totals, k.reservations, k.expiry, k.record(entry.request_id), k.index],
            [*a[:4], index_cap, *a[4:], purge_limit],
        )
        return _reserve_result(out)

    async def reserve_batch(
        self, entries: Sequence[ReserveEntry], index_cap: int, purge_limit: int = 64
    ) -> list[ReserveResult]:
        """Group commit: every entry reserved and recorded as `reserve` would
        do it alone, in order, in one script call (one round trip for the batch)."""
        if not entries:
            return []
        k = self.keys
        args: list[Any] = [purge_limit, index_cap, _ENTRY_WIDTH]
        for e in entries:
            args.extend(e.args())
        out = await self._run(
            self._reserve_batch,
            [
                k.totals,
                k.reservations,
                k.expiry,
                k.index,
                *(k.record(e.request_id) for e in entries),
            ],
            args,
        )
        return [_reserve_result(row) for row in out]

    async def report_outcome(
        self, request_id: str, outcome: Mapping[str, Any], owner: str = ""
    ) -> OutcomeResult:
        """Releases the request's reservation (if live) and attaches the outcome to its
        record unless one is already there. ``owner`` (non-empty): only when the record
        names that caller; else nothing changes and ``not_owner`` is set."""
        k = self.keys
        out = await self._run(
            self._outcome,
            [k.totals, k.reservations, k.expiry, k.record(request_id)],
            [request_id, dumps(outcome), owner],
        )
        if int(out[0]) < 0:
            return OutcomeResult(False, True, False, None, not_owner=True)
        return OutcomeResult(
            released=bool(int(out[0])),
            record_found=bool(int(out[1])),
            first_report=bool(int(out[2])),
            head=_json(out[3]),
        )

    async def purge(self, now_ms: int, limit: int = 1000) -> int:
        """Releases up to ``limit`` lapsed reservations; returns how many."""
        k = self.keys
        return int(
            await self._run(self._purge, [k.totals, k.reservations, k.expiry], [now_ms, limit])
        )

    async def totals(self) -> dict[str, Totals]:
        """Every worker's live reservation totals (one HGETALL)."""
        try:
            raw = await self.client.hgetall(self.keys.totals)
        except STORE_DOWN as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc
        acc: dict[str, list[int]] = {}
        for field, value in raw.items():
            name = _s(field)
            kind, _, worker = name.partition(":")
            slot = {"k": 0, "n": 1, "t": 2}.get(kind)
            if slot is None or not worker:
                continue
            acc.setdefault(worker, [0, 0, 0])[slot] = max(0, int(value))
        return {w: Totals(v[0], v[1], v[2]) for w, v in acc.items()}

    async def reservation_count(self) -> int:
        """Live reservation entries (lapsed but not yet purged ones included)."""
        try:
            return int(await self.client.hlen(self.keys.reservations))
        except STORE_DOWN as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc

    async def write_explanations(self, items: Sequence[tuple[str, str]]) -> int:
        """Attaches explanation JSONs to their records (one script call for the batch)."""
        if not items:
            return 0
        return int(
            await self._run(
                self._explain,
                [self.keys.record(rid) for rid, _ in items],
                [doc for _, doc in items],
            )
        )

    async def get(self, request_id: str) -> StoredRecord | None:
        try:
            raw = await self.client.hmget(self.keys.record(request_id), ["p", "x", "o"])
        except STORE_DOWN as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc
        head = _json(raw[0])
        if head is None:
            return None
        try:
            explanation = _json(raw[1])
            if explanation is not None:
                explanation = decode_explanation(explanation)
        except Exception:  # any damage: the record stays readable (its head is served)
            explanation = dict(UNREADABLE_EXPLANATION)
        return StoredRecord(head, explanation, _json(raw[2]))

    async def index_page(
        self, max_ms: int | None, min_ms: int, count: int
    ) -> list[tuple[str, int]]:
        """Up to ``count`` (request id, created ms) from the index, newest first, with
        ``min_ms <= created <= max_ms`` (None = no upper bound)."""
        top: int | str = "+inf" if max_ms is None else max_ms
        try:
            rows = await self.client.zrevrangebyscore(
                self.keys.index, top, min_ms, start=0, num=count, withscores=True
            )
        except STORE_DOWN as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc
        return [(_s(member), int(score)) for member, score in rows]

    async def heads(self, request_ids: Sequence[str]) -> list[StoredRecord | None]:
        """Record heads and outcomes (no explanations) for many ids, one pipeline."""
        if not request_ids:
            return []
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for rid in request_ids:
                    pipe.hmget(self.keys.record(rid), ["p", "o"])
                rows = await pipe.execute()
        except STORE_DOWN as exc:
            raise Unavailable(f"state store unavailable: {exc}") from exc
        out: list[StoredRecord | None] = []
        for row in rows:
            head = _json(row[0])
            out.append(None if head is None else StoredRecord(head, None, _json(row[1])))
        return out

    async def directive_changed(self, worker_id: str, kind: str, value: str, ttl_ms: int) -> bool:
        """True (and remembered for ``ttl_ms``) when ``value`` differs from the last
        directive of this kind sent to the worker by any replica."""
        return bool(
            int(
                await self._run(
                    self._directive, [self.keys.directive(worker_id, kind)], [value, ttl_ms]
                )
            )
        )
