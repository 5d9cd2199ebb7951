"""KV transfer sessions: the state machine, the session value, validation. Pure.

Nothing here touches Redis, gRPC or the clock: times come in as arguments (Unix ms).

The state machine is one table, `TRANSITIONS`, from (state, operation) to the next state;
a pair missing from it is an illegal transition. The Redis store does not restate it: its
Lua scripts embed `lua_transition_table()`, generated from the same dict, so the rules the
broker enforces atomically in Redis and the rules the unit tests check are one source.

`apply` is the reference semantics of one operation on one session (the Lua script does
the same on the stored hash; the integration tests run both side by side):

1. An open session whose due time, ``min(deadline, lease expiry)``, is already past is
   expired first, whatever the operation (status EXPIRED_FIRST): time decides expiry, not
   the sweeper's timing.
2. A pair not in the table changes nothing (ILLEGAL -> FAILED_PRECONDITION at the edge).
3. A terminal self-loop (complete on COMPLETE, abort on ABORTED, fail on FAILED) is an
   idempotent retry and changes nothing, not even the version (UNCHANGED).
4. Bytes never go backwards: a report below the stored bytes is refused (BACKWARDS), one
   above the expected size too (OVERFLOW); a report equal to the stored bytes is a retry
   that only renews the lease.
5. reserve and progress renew the lease: lease expiry = now + lease_ttl_ms.
   complete sets bytes_done = expected_bytes. fail, abort and expire record the reason.
   Every applied change bumps the version by one and records who made it.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hpd_common.errors import InvalidArgument
from hpd_common.ids import check_id
from hpd_common.kvformat import ConversionStep, Negotiation, Verdict

MAX_EXPECTED_BYTES = 1 << 50
"""1 PiB: far above any KV cache (a 1M-token context of a 70B model in fp32 is ~0.6 TiB)."""

MAX_REASON_LEN = 256


class SessionState(enum.StrEnum):
    NEGOTIATED = "NEGOTIATED"
    RESERVED = "RESERVED"
    TRANSFERRING = "TRANSFERRING"
    COMPLETE = "COMPLETE"
    FAILED = "FAILED"
    EXPIRED = "EXPIRED"
    ABORTED = "ABORTED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset(
    {SessionState.COMPLETE, SessionState.FAILED, SessionState.EXPIRED, SessionState.ABORTED}
)
OPEN = frozenset(SessionState) - TERMINAL


class Op(enum.StrEnum):
    """What can be done to an open session (opening is not an operation on a session)."""

    RESERVE = "reserve"  # the destination reserved KV memory (a worker)
    PROGRESS = "progress"  # bytes moved (a worker)
    COMPLETE = "complete"  # every byte arrived (a worker)
    FINISH = "finish"  # every byte arrived, with no progress reported before (one call)
    FAIL = "fail"  # a worker reports failure, or the broker sees a worker's lease expire
    ABORT = "abort"  # a worker or the scheduler abandons the transfer
    EXPIRE = "expire"  # the broker: deadline or session lease passed


N, R, T = SessionState.NEGOTIATED, SessionState.RESERVED, SessionState.TRANSFERRING
C, F, E, A = (
    SessionState.COMPLETE,
    SessionState.FAILED,
    SessionState.EXPIRED,
    SessionState.ABORTED,
)

TRANSITIONS: Mapping[tuple[SessionState, Op], SessionState] = {
    (N, Op.RESERVE): R,
    (N, Op.PROGRESS): T,
    (N, Op.FAIL): F,
    (N, Op.ABORT): A,
    (N, Op.EXPIRE): E,
    (R, Op.RESERVE): R,  # a retried reservation renews the lease
    (R, Op.PROGRESS): T,
    (R, Op.FAIL): F,
    (R, Op.ABORT): A,
    (R, Op.EXPIRE): E,
    (T, Op.PROGRESS): T,
    (T, Op.COMPLETE): C,
    (N, Op.FINISH): C,
    (R, Op.FINISH): C,
    (T, Op.FINISH): C,
    (T, Op.FAIL): F,
    (T, Op.ABORT): A,
    (T, Op.EXPIRE): E,
    (C, Op.COMPLETE): C,  # idempotent retry: no change
    (C, Op.FINISH): C,  # idempotent retry: no change
    (F, Op.FAIL): F,  # idempotent retry: no change
    (A, Op.ABORT): A,  # idempotent retry: no change
}
"""Every legal (state, operation) pair. Not listed, notably: complete before any byte was
reported (NEGOTIATED, RESERVED) unless the caller says every byte arrived (FINISH), reserve
once bytes move, and anything leaving a terminal state (terminal states are final; EXPIRED
has no retry at all)."""

SCHEDULER_OPS = frozenset({Op.ABORT})
"""Operations the scheduler (token holder) may perform besides opening; the rest need one
of the session's two workers."""
GATEWAY_OPS = frozenset({Op.PROGRESS, Op.COMPLETE, Op.FINISH, Op.FAIL, Op.ABORT})
"""What the gateway may do to a session it runs (it may not open one or reserve memory)."""

REASON_DEADLINE = "deadline_exceeded"
REASON_SESSION_LEASE = "session_lease_expired"
REASON_ABORTED = "aborted"

BROKER = "broker"
SCHEDULER = "scheduler"


def worker_lost_reason(worker_id: str, registry_reason: str) -> str:
    """`worker_<why>: <id>`: why the registry dropped the worker (lease_expired,
    deregistered) or `gone` when the broker only sees that it is no longer live."""
    why = registry_reason if registry_reason in ("lease_expired", "deregistered") else "gone"
    return f"worker_{why}: {worker_id}"


def lua_transition_table() -> str:
    """TRANSITIONS as a Lua table literal: `{['NEGOTIATED']={['reserve']='RESERVED', ...}}`."""
    rows: dict[str, dict[str, str]] = {}
    for (state, op), nxt in sorted(TRANSITIONS.items()):
        rows.setdefault(state.value, {})[op.value] = nxt.value
    inner = ", ".join(
        f"['{s}']={{" + ", ".join(f"['{op}']='{n}'" for op, n in ops.items()) + "}"
        for s, ops in rows.items()
    )
    return "{" + inner + "}"


def lua_terminal_set() -> str:
    """TERMINAL as a Lua set literal: `{['COMPLETE']=true, ...}`."""
    return "{" + ", ".join(f"['{s.value}']=true" for s in sorted(TERMINAL)) + "}"


@dataclass(frozen=True, slots=True)
class Session:
    """One KV transfer; times in Unix ms, sizes in bytes."""

    session_id: str
    request_id: str
    source_worker_id: str
    destination_worker_id: str
    state: SessionState
    expected_bytes: int
    bytes_done: int
    created_ms: int
    updated_ms: int
    deadline_ms: int
    lease_expires_ms: int
    lease_ttl_ms: int
    negotiation: Negotiation
    reason: str = ""
    version: int = 1
    updated_by: str = ""

    @property
    def due_ms(self) -> int:
        """When the session expires unless it ends first: min(deadline, lease expiry)."""
        return min(self.deadline_ms, self.lease_expires_ms)

    def overdue(self, now_ms: int) -> bool:
        return not self.state.terminal and self.due_ms < now_ms

    def parties(self) -> tuple[str, str]:
        return self.source_worker_id, self.destination_worker_id


class Status(enum.StrEnum):
    APPLIED = "applied"
    UNCHANGED = "unchanged"
    ILLEGAL = "illegal"
    BACKWARDS = "backwards"
    OVERFLOW = "overflow"
    EXPIRED_FIRST = "expired_first"


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Status
    session: Session


def expiry_reason(s: Session, now_ms: int) -> str:
    return REASON_DEADLINE if s.deadline_ms < now_ms else REASON_SESSION_LEASE


def apply(
    s: Session,
    op: Op,
    now_ms: int,
    actor: str,
    bytes_done: int | None = None,
    reason: str = "",
) -> Outcome:
    """The result of `op` on `s` at `now_ms` by `actor` (see the module docstring)."""
    if s.overdue(now_ms):
        return Outcome(Status.EXPIRED_FIRST, _expire(s, now_ms, BROKER))
    nxt = TRANSITIONS.get((s.state, op))
    if nxt is None:
        return Outcome(Status.ILLEGAL, s)
    if nxt is s.state and nxt.terminal:
        return Outcome(Status.UNCHANGED, s)
    changed = replace(s, state=nxt, updated_ms=now_ms, version=s.version + 1, updated_by=actor)
    if op in (Op.RESERVE, Op.PROGRESS):
        done = s.bytes_done
        if bytes_done is not None:
            if bytes_done < s.bytes_done:
                return Outcome(Status.BACKWARDS, s)
            if bytes_done > s.expected_bytes:
                return Outcome(Status.OVERFLOW, s)
            done = bytes_done
        changed = replace(changed, bytes_done=done, lease_expires_ms=now_ms + s.lease_ttl_ms)
    elif op in (Op.COMPLETE, Op.FINISH):
        changed = replace(changed, bytes_done=s.expected_bytes)
    elif op is Op.EXPIRE:
        changed = replace(changed, reason=reason or expiry_reason(s, now_ms))
    else:
        changed = replace(changed, reason=reason)
    return Outcome(Status.APPLIED, changed)


def _expire(s: Session, now_ms: int, actor: str) -> Session:
    return replace(
        s,
        state=SessionState.EXPIRED,
        reason=expiry_reason(s, now_ms),
        updated_ms=now_ms,
        version=s.version + 1,
        updated_by=actor,
    )


# -- validation at the edge --------------------------------------------------------------------


def check_reason(path: str, reason: str, required: bool = False) -> None:
    if required and not reason.strip():
        raise InvalidArgument(path, "is required")
    if len(reason) > MAX_REASON_LEN:
        raise InvalidArgument(path, f"longer than {MAX_REASON_LEN} characters")
    if any(ord(ch) < 32 for ch in reason):
        raise InvalidArgument(path, "contains control characters")


def check_expected_bytes(path: str, value: int) -> None:
    if not 1 <= value <= MAX_EXPECTED_BYTES:
        raise InvalidArgument(path, f"must be in 1..{MAX_EXPECTED_BYTES}")


def check_ids(**ids: str) -> None:
    """Each named id follows the one id rule (``hpd_common.ids``)."""
    for path, value in ids.items():
        check_id(path, value)


# -- the negotiation as stored (JSON) -----------------------------------------------------------


def negotiation_to_dict(n: Negotiation) -> dict[str, Any]:
    return {
        "verdict": n.verdict.value,
        "reasons": list(n.reasons),
        "details": list(n.details),
        "steps": [[s.kind, s.detail, s.cost_ms_per_gib, s.lossy] for s in n.steps],
    }


def negotiation_from_dict(d: Mapping[str, Any]) -> Negotiation:
    return Negotiation(
        verdict=Verdict(d["verdict"]),
        reasons=tuple(d.get("reasons", ())),
        details=tuple(d.get("details", ())),
        steps=tuple(
            ConversionStep(str(k), str(det), float(cost), bool(lossy))
            for k, det, cost, lossy in d.get("steps", ())
        ),
    )


@functools.lru_cache(maxsize=4096)
def negotiation_json(n: Negotiation) -> str:
    """The stored form of a negotiation (memoised: a fleet has few distinct ones)."""
    return json.dumps(negotiation_to_dict(n), sort_keys=True, separators=(",", ":"))
