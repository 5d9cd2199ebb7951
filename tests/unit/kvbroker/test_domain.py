"""The session state machine: every (state, operation) pair, and random sequences of them."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpd_common.errors import InvalidArgument
from hpd_common.kvformat import ConversionStep, Negotiation, Verdict
from hpd_kvbroker.domain import (
    MAX_EXPECTED_BYTES,
    TERMINAL,
    TRANSITIONS,
    Op,
    Session,
    SessionState,
    Status,
    apply,
    check_expected_bytes,
    check_reason,
    lua_terminal_set,
    lua_transition_table,
    negotiation_from_dict,
    negotiation_to_dict,
    worker_lost_reason,
)

S = SessionState
NOW = 1_700_000_000_000
GIB = 1 << 30


def session(state: SessionState = S.NEGOTIATED, done: int = 0, **kw: object) -> Session:
    base = Session(
        session_id="s1",
        request_id="r1",
        source_worker_id="p1",
        destination_worker_id="d1",
        state=state,
        expected_bytes=GIB,
        bytes_done=done,
        created_ms=NOW,
        updated_ms=NOW,
        deadline_ms=NOW + 10_000,
        lease_expires_ms=NOW + 5_000,
        lease_ttl_ms=5_000,
        negotiation=Negotiation(Verdict.COMPATIBLE),
        version=3,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


# (state, op) -> next state, or None when illegal. Written out by hand: the spec, not a copy
# of TRANSITIONS.
EXPECTED: dict[tuple[SessionState, Op], SessionState | None] = {
    (S.NEGOTIATED, Op.RESERVE): S.RESERVED,
    (S.NEGOTIATED, Op.PROGRESS): S.TRANSFERRING,
    (S.NEGOTIATED, Op.COMPLETE): None,
    (S.NEGOTIATED, Op.FINISH): S.COMPLETE,
    (S.NEGOTIATED, Op.FAIL): S.FAILED,
    (S.NEGOTIATED, Op.ABORT): S.ABORTED,
    (S.NEGOTIATED, Op.EXPIRE): S.EXPIRED,
    (S.RESERVED, Op.RESERVE): S.RESERVED,
    (S.RESERVED, Op.PROGRESS): S.TRANSFERRING,
    (S.RESERVED, Op.COMPLETE): None,
    (S.RESERVED, Op.FINISH): S.COMPLETE,
    (S.RESERVED, Op.FAIL): S.FAILED,
    (S.RESERVED, Op.ABORT): S.ABORTED,
    (S.RESERVED, Op.EXPIRE): S.EXPIRED,
    (S.TRANSFERRING, Op.RESERVE): None,
    (S.TRANSFERRING, Op.PROGRESS): S.TRANSFERRING,
    (S.TRANSFERRING, Op.COMPLETE): S.COMPLETE,
    (S.TRANSFERRING, Op.FINISH): S.COMPLETE,
    (S.TRANSFERRING, Op.FAIL): S.FAILED,
    (S.TRANSFERRING, Op.ABORT): S.ABORTED,
    (S.TRANSFERRING, Op.EXPIRE): S.EXPIRED,
    (S.COMPLETE, Op.RESERVE): None,
    (S.COMPLETE, Op.PROGRESS): None,
    (S.COMPLETE, Op.COMPLETE): S.COMPLETE,
    (S.COMPLETE, Op.FINISH): S.COMPLETE,
    (S.COMPLETE, Op.FAIL): None,
    (S.COMPLETE, Op.ABORT): None,
    (S.COMPLETE, Op.EXPIRE): None,
    (S.FAILED, Op.RESERVE): None,
    (S.FAILED, Op.PROGRESS): None,
    (S.FAILED, Op.COMPLETE): None,
    (S.FAILED, Op.FINISH): None,
    (S.FAILED, Op.FAIL): S.FAILED,
    (S.FAILED, Op.ABORT): None,
    (S.FAILED, Op.EXPIRE): None,
    (S.EXPIRED, Op.RESERVE): None,
    (S.EXPIRED, Op.PROGRESS): None,
    (S.EXPIRED, Op.COMPLETE): None,
    (S.EXPIRED, Op.FINISH): None,
    (S.EXPIRED, Op.FAIL): None,
    (S.EXPIRED, Op.ABORT): None,
    (S.EXPIRED, Op.EXPIRE): None,
    (S.ABORTED, Op.RESERVE): None,
    (S.ABORTED, Op.PROGRESS): None,
    (S.ABORTED, Op.COMPLETE): None,
    (S.ABORTED, Op.FINISH): None,
    (S.ABORTED, Op.FAIL): None,
    (S.ABORTED, Op.ABORT): S.ABORTED,
    (S.ABORTED, Op.EXPIRE): None,
}
PAIRS = [
    pytest.param(s, op, EXPECTED[(s, op)], id=f"{s.value.lower()}-{op.value}")
    for s in SessionState
    for op in Op
]


def test_expected_covers_every_pair_and_matches_the_table() -> None:
    assert len(EXPECTED) == len(SessionState) * len(Op)
    assert {k: v for k, v in EXPECTED.items() if v is not None} == dict(TRANSITIONS)


@pytest.mark.parametrize(("state", "op", "expected"), PAIRS)
def test_every_state_operation_pair(
    state: SessionState, op: Op, expected: SessionState | None
) -> None:
    before = session(state, done=100 if state is not S.NEGOTIATED else 0)
    out = apply(before, op, NOW + 1, "p1", bytes_done=200, reason="why")
    if expected is None:
        assert out.status is Status.ILLEGAL
        assert out.session == before
    elif expected is state and state.terminal:
        assert out.status is Status.UNCHANGED
        assert out.session == before
    else:
        assert out.status is Status.APPLIED
        assert out.session.state is expected
        assert out.session.version == before.version + 1
        assert out.session.updated_ms == NOW + 1
        assert out.session.updated_by == "p1"


@pytest.mark.parametrize(
    ("op", "field", "value"),
    [
        pytest.param(Op.PROGRESS, "bytes_done", 200, id="progress-sets-bytes"),
        pytest.param(Op.PROGRESS, "lease_expires_ms", NOW + 1 + 5_000, id="progress-renews-lease"),
        pytest.param(Op.RESERVE, "lease_expires_ms", NOW + 1 + 5_000, id="reserve-renews-lease"),
        pytest.param(Op.FAIL, "reason", "why", id="fail-records-reason"),
        pytest.param(Op.ABORT, "reason", "why", id="abort-records-reason"),
        pytest.param(Op.EXPIRE, "reason", "why", id="expire-records-given-reason"),
    ],
)
def test_operation_effects(op: Op, field: str, value: object) -> None:
    out = apply(session(S.NEGOTIATED), op, NOW + 1, "p1", bytes_done=200, reason="why")
    assert getattr(out.session, field) == value


def test_complete_sets_bytes_to_expected() -> None:
    out = apply(session(S.TRANSFERRING, done=10), Op.COMPLETE, NOW + 1, "d1")
    assert (out.status, out.session.bytes_done) == (Status.APPLIED, GIB)


@pytest.mark.parametrize("state", [S.NEGOTIATED, S.RESERVED, S.TRANSFERRING])
def test_finish_completes_an_open_session_with_every_byte(state: SessionState) -> None:
    out = apply(session(state), Op.FINISH, NOW + 1, "gw")
    assert (out.status, out.session.state, out.session.bytes_done) == (
        Status.APPLIED,
        S.COMPLETE,
        GIB,
    )


@pytest.mark.parametrize(
    ("done", "report", "status"),
    [
        pytest.param(100, 99, Status.BACKWARDS, id="below-stored"),
        pytest.param(100, 100, Status.APPLIED, id="equal-is-a-retry"),
        pytest.param(100, GIB, Status.APPLIED, id="up-to-expected"),
        pytest.param(100, GIB + 1, Status.OVERFLOW, id="beyond-expected"),
    ],
)
def test_bytes_never_go_backwards(done: int, report: int, status: Status) -> None:
    before = session(S.TRANSFERRING, done=done)
    out = apply(before, Op.PROGRESS, NOW + 1, "p1", bytes_done=report)
    assert out.status is status
    if status is not Status.APPLIED:
        assert out.session == before


@pytest.mark.parametrize(
    ("now", "reason"),
    [
        pytest.param(NOW + 5_001, "session_lease_expired", id="lease-passed"),
        pytest.param(NOW + 10_001, "deadline_exceeded", id="deadline-passed"),
    ],
)
def test_an_overdue_session_expires_before_any_operation(now: int, reason: str) -> None:
    out = apply(session(S.TRANSFERRING, done=5), Op.COMPLETE, now, "d1")
    assert out.status is Status.EXPIRED_FIRST
    assert (out.session.state, out.session.reason, out.session.updated_by) == (
        S.EXPIRED,
        reason,
        "broker",
    )


def test_at_the_due_time_the_session_is_still_open() -> None:
    out = apply(session(S.TRANSFERRING), Op.COMPLETE, NOW + 5_000, "d1")
    assert out.session.state is S.COMPLETE


def test_lua_table_is_generated_from_the_python_table() -> None:
    lua = lua_transition_table()
    entries = re.findall(r"\['(\w+)'\]='(\w+)'", lua)
    rows = re.findall(r"\['(\w+)'\]=\{([^}]*)\}", lua)
    parsed = {
        (SessionState(state), Op(op)): SessionState(nxt)
        for state, body in rows
        for op, nxt in re.findall(r"\['(\w+)'\]='(\w+)'", body)
    }
    assert parsed == dict(TRANSITIONS)
    assert len(entries) == len(TRANSITIONS)
    assert set(re.findall(r"\['(\w+)'\]=true", lua_terminal_set())) == {s.value for s in TERMINAL}


@pytest.mark.parametrize(
    ("registry_reason", "expected"),
    [
        pytest.param("lease_expired", "worker_lease_expired: w1", id="lease"),
        pytest.param("deregistered", "worker_deregistered: w1", id="deregistered"),
        pytest.param("", "worker_gone: w1", id="unknown"),
        pytest.param("weird", "worker_gone: w1", id="unexpected"),
    ],
)
def test_worker_lost_reason(registry_reason: str, expected: str) -> None:
    assert worker_lost_reason("w1", registry_reason) == expected


@pytest.mark.parametrize(
    ("reason", "required", "ok"),
    [
        pytest.param("", False, True, id="empty-optional"),
        pytest.param("", True, False, id="empty-required"),
        pytest.param("  ", True, False, id="blank-required"),
        pytest.param("x" * 256, True, True, id="at-limit"),
        pytest.param("x" * 257, False, False, id="too-long"),
        pytest.param("a\nb", False, False, id="control-char"),
    ],
)
def test_check_reason(reason: str, required: bool, ok: bool) -> None:
    if ok:
        check_reason("reason", reason, required)
    else:
        with pytest.raises(InvalidArgument):
            check_reason("reason", reason, required)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        pytest.param(0, False, id="zero"),
        pytest.param(1, True, id="one"),
        pytest.param(MAX_EXPECTED_BYTES, True, id="max"),
        pytest.param(MAX_EXPECTED_BYTES + 1, False, id="above-max"),
    ],
)
def test_check_expected_bytes(value: int, ok: bool) -> None:
    if ok:
        check_expected_bytes("expected_bytes", value)
    else:
        with pytest.raises(InvalidArgument, match="expected_bytes"):
            check_expected_bytes("expected_bytes", value)


def test_negotiation_round_trips_through_its_stored_form() -> None:
    n = Negotiation(
        Verdict.CONVERTIBLE,
        reasons=("block_size_mismatch", "kv_dtype_mismatch"),
        steps=(
            ConversionStep("block_regroup", "merge", 1.0),
            ConversionStep("dtype_cast", "cast", 2.0, lossy=True),
        ),
        details=("merge", "cast"),
    )
    assert negotiation_from_dict(negotiation_to_dict(n)) == n


# -- random sequences ----------------------------------------------------------------------

steps = st.lists(
    st.tuples(
        st.sampled_from(list(Op)),
        st.integers(0, GIB + 10),  # bytes reported
        st.integers(0, 3_000),  # ms that pass before the step
    ),
    max_size=30,
)


@given(steps=steps)
def test_random_sequences_keep_the_invariants(steps: list[tuple[Op, int, int]]) -> None:
    s = session(S.NEGOTIATED, version=1)
    now = NOW
    for op, report, wait in steps:
        now += wait
        out = apply(s, op, now, "p1", bytes_done=report, reason="r")
        nxt = out.session
        assert nxt.bytes_done >= s.bytes_done
        assert nxt.bytes_done <= nxt.expected_bytes
        if s.state.terminal:
            assert nxt == s
        if nxt != s:
            assert nxt.version == s.version + 1
            assert (s.state, op) in TRANSITIONS or out.status is Status.EXPIRED_FIRST
        s = nxt


def test_session_ids_are_time_then_48_random_bits_and_never_repeat() -> None:
    from hpd_kvbroker.service import _urandom_ids

    new_id = _urandom_ids()
    now = 1_795_976_913_222
    ids = [new_id(now) for _ in range(3_000)]  # several refills of the 4 KiB buffer
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(f"{now:012x}[0-9a-f]{{12}}", i) for i in ids)
