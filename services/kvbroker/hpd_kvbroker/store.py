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
    negotiation_from_dict,
)
from hpd_kvbroker.keys import KvKeys
from hpd_kvbroker.scripts import (
    BY_REQUEST,
    FAIL_WORKER,
    OPEN,
    SWEEP,
    TRANSITION,
)
from hpd_registry.keys import WORKER_CREDENTIAL_FIELD, WORKER_LEASE_FIELD, RegistryKeys

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
        self._open = client.register_script(self._render(OPEN))
        self._transition = client.register_script(self._render(TRANSITION))
        self._sweep = client.register_script(self._render(SWEEP))
        self._fail_worker = client.register_script(self._render(FAIL_WORKER))
        self._by_request = client.register_script(BY_REQUEST)

    def _render(self, script: str) -> str:
        """The script with this store's constants in place of the @NAME@ markers."""
        values = {
            "@SP@": self.keys.session_prefix,
            "@RP@": self.keys.request_prefix,
            "@OP@": self.keys.open_prefix,
            "@RW@": self.registry_keys.worker_prefix,
            "@RG@": self.registry_keys.grace,
            "@F_CRED@": WORKER_CREDENTIAL_FIELD,
            "@F_EXP@": WORKER_LEASE_FIELD,
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
