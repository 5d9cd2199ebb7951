"""The scheduler's Redis store: reservations, route records, the record index.

Why Lua: `Schedule` must cost one Redis round trip. `RESERVE` does, atomically, what
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
from hpd_scheduler.scripts import (
    DIRECTIVE_CHANGED,
    EXPLAIN,
    OUTCOME,
    PURGE,
    RESERVE,
    RESERVE_BATCH,
)

UNREADABLE_EXPLANATION = {"error": "explanation unreadable"}
"""What a record's explanation reads as when what is stored no longer decodes."""


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
        self._reserve = client.register_script(RESERVE)
        self._reserve_batch = client.register_script(RESERVE_BATCH)
        self._outcome = client.register_script(OUTCOME)
        self._purge = client.register_script(PURGE)
        self._explain = client.register_script(EXPLAIN)
        self._directive = client.register_script(DIRECTIVE_CHANGED)

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
