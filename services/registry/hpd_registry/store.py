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
from hpd_common.worker_model import LoadReport, WorkerSpec
from hpd_registry.domain import Directive, WorkerRecord, WorkerState
from hpd_registry.keys import RegistryKeys
from hpd_registry.scripts import (
    ACK_DIRECTIVES,
    ADMIN,
    DEREGISTER,
    HEARTBEATS,
    KV_EVENTS,
    REGISTER,
    SNAPSHOT,
    SWEEP,
)

log = get_logger("registry.store")

MAX_PENDING_DIRECTIVES = 256
"""Directives queued for one worker and not yet acked; past it the oldest are dropped (and
counted): a worker that never acks cannot grow Redis without bound."""


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


_LOAD_TAG = b"\x00\x03"
"""Starts a load report stored in binary (version 3); no JSON text starts with NUL."""
_LOAD_BIN = struct.Struct(
    "<" + "".join("d" if t == "float" else "q" for t in LoadReport.__annotations__.values())
)
"""Every LoadReport field in declaration order: float as float64, int as int64."""
_LOAD_FIELDS = tuple(LoadReport.__annotations__)
_LOAD_OLDER = {
    b"\x00\x01": struct.Struct("<" + "d" * 4 + "q" * 4 + "d" * 4 + "q"),
    b"\x00\x02": struct.Struct("<" + "d" * 4 + "q" * 4 + "d" * 4 + "q" + "d"),
}
"""Earlier versions, still read back: 1, the first 13 fields (before
``prefix_cache_hit_rate``); 2, the first 14 (before ``prefill_busy``)."""


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
    """A stored load report: the binary form (any version), or JSON (as earlier versions
    wrote it)."""
    if isinstance(raw, bytes):
        if raw[:2] == _LOAD_TAG:
            return LoadReport(*_LOAD_BIN.unpack(raw[2:]))
        older = _LOAD_OLDER.get(raw[:2])
        if older is not None:
            return LoadReport(*older.unpack(raw[2:]))
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
        self._register = client.register_script(REGISTER)
        self._heartbeats = client.register_script(HEARTBEATS)
        self._deregister = client.register_script(DEREGISTER)
        self._admin = client.register_script(ADMIN)
        self._sweep = client.register_script(SWEEP)
        self._snapshot = client.register_script(SNAPSHOT)
        self._kv_events = client.register_script(KV_EVENTS)
        self._ack_script = client.register_script(ACK_DIRECTIVES)

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

    async def push_directive(self, worker_id: str, directive: Directive) -> int:
        """Queue a directive until the worker acks it; returns how many of the oldest were
        dropped to keep the queue within ``MAX_PENDING_DIRECTIVES`` (a worker that never
        acks must not grow Redis without bound)."""
        key = self.keys.directives(worker_id)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.rpush(key, canonical_json(directive.to_dict()))
                pipe.ltrim(key, -MAX_PENDING_DIRECTIVES, -1)
                pipe.publish(self.keys.directive_channel, worker_id)
                length, *_ = await pipe.execute()
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return max(0, int(length) - MAX_PENDING_DIRECTIVES)

    async def peek_directives(self, worker_id: str, count: int = 100) -> list[Directive]:
        """The oldest ``count`` directives not yet acked, in order; they stay queued."""
        try:
            raw = await self.client.lrange(self.keys.directives(worker_id), 0, count - 1)
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
        return [Directive.from_dict(json.loads(x)) for x in (raw or [])]

    async def ack_directives(self, worker_id: str, ids: Sequence[str]) -> int:
        """Remove the directives with these ids from the worker's queue; how many went."""
        if not ids:
            return 0
        try:
            return int(await self._ack_script(keys=[self.keys.directives(worker_id)], args=ids))
        except STORE_DOWN as exc:
            raise _unavailable(exc) from exc
