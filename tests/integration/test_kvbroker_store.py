"""The session store's Lua scripts against a real redis-server: the same state machine as
the pure model, random operation sequences from several clients, exactly-once expiry with
two replicas."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpd_common import redis_conn
from hpd_common.clock import FakeClock
from hpd_common.kvformat import ConversionStep, Negotiation, Verdict
from hpd_kvbroker.domain import (
    BROKER,
    SCHEDULER,
    TRANSITIONS,
    Op,
    Session,
    SessionState,
    Status,
    apply,
    expiry_reason,
    negotiation_json,
)
from hpd_kvbroker.keys import KvKeys
from hpd_kvbroker.scripts import SESSION_FIELDS
from hpd_kvbroker.service import KvBrokerService
from hpd_kvbroker.settings import KvBrokerSettings
from hpd_kvbroker.store import OpenArgs, SessionStore, decode_session
from hpd_registry.keys import RegistryKeys
from hpd_registry.store import credential_hash
from hpd_tools.embedded_redis import EmbeddedRedis

S = SessionState
T0 = 1_700_000_000_000
GIB = 1 << 30
CRED = {"p1": "cred-p1", "d1": "cred-d1", "x1": "cred-x1"}
_ids = itertools.count()


async def forge_workers(client: aioredis.Redis, prefix: str, exp_ms: int = T0 + 10**9) -> None:
    """Registry records as the registry writes them (credential hash and lease expiry)."""
    keys = RegistryKeys(prefix)
    for wid, cred in CRED.items():
        await client.hset(keys.worker(wid), mapping={"cred": credential_hash(cred), "exp": exp_ms})


def make_store(client: aioredis.Redis, prefix: str) -> SessionStore:
    return SessionStore(client, KvKeys(prefix), RegistryKeys(prefix), retention_ms=60_000)


@pytest.fixture
async def store(redis_client: aioredis.Redis, key_prefix: str) -> AsyncIterator[SessionStore]:
    await forge_workers(redis_client, key_prefix)
    yield make_store(redis_client, key_prefix)


async def open_session(
    store: SessionStore, now: int = T0, deadline_ms: int = 10_000, ttl_ms: int = 5_000
) -> Session:
    n = next(_ids)
    res = await store.open(
        OpenArgs(
            session_id=f"{now:012x}{n:012x}",
            request_id=f"req-{n}",
            source_worker_id="p1",
            destination_worker_id="d1",
            expected_bytes=GIB,
            deadline_ms=deadline_ms,
            lease_ttl_ms=ttl_ms,
            negotiation_json=negotiation_json(Negotiation(Verdict.COMPATIBLE)),
        ),
        "",
        "",
        now,
    )
    assert res.status == "created" and res.session is not None
    return res.session


async def step(
    store: SessionStore, s: Session, op: Op, actor: str, now: int, nbytes: int = 0
) -> str:
    cred = credential_hash(CRED[actor]) if actor in CRED else ""
    res = await store.transition(s.session_id, op.value, actor, cred, now, nbytes, "why")
    return res.status


async def drive(store: SessionStore, state: SessionState) -> tuple[Session, int]:
    """A fresh session brought into `state` through the store; (session, now)."""
    s = await open_session(store)
    now = T0 + 1
    path = {
        S.NEGOTIATED: [],
        S.RESERVED: [Op.RESERVE],
        S.TRANSFERRING: [Op.PROGRESS],
        S.COMPLETE: [Op.PROGRESS, Op.COMPLETE],
        S.FAILED: [Op.FAIL],
        S.ABORTED: [Op.ABORT],
        S.EXPIRED: [],
    }[state]
    for op in path:
        assert await step(store, s, op, "p1", now, 100) == "applied"
    if state is S.EXPIRED:
        now = T0 + 20_000
        result = await store.sweep(now)
        assert [x.session_id for x in result.changed] == [s.session_id]
    got = await store.get(s.session_id)
    assert got is not None and got.state is state
    return got, now + 1


@pytest.mark.parametrize(
    ("state", "op"),
    [
        pytest.param(s, op, id=f"{s.value.lower()}-{op.value}")
        for s, op in itertools.product(SessionState, Op)
    ],
)
async def test_every_pair_in_redis_matches_the_pure_model(
    store: SessionStore, state: SessionState, op: Op
) -> None:
    before, now = await drive(store, state)
    expected = apply(before, op, now, "p1", bytes_done=200, reason="why")
    status = await step(store, before, op, "p1", now, 200)
    after = await store.get(before.session_id)
    assert status == expected.status.value
    assert after == expected.session
    assert after.state is TRANSITIONS.get((state, op), state)


@pytest.mark.parametrize(
    ("actor", "status"),
    [
        pytest.param("x1", "not_party", id="registered-but-not-a-party"),
        pytest.param("wrong", "not_party", id="unknown-worker"),
    ],
)
async def test_only_the_two_workers_may_advance(
    store: SessionStore, actor: str, status: str
) -> None:
    s = await open_session(store)
    assert await step(store, s, Op.PROGRESS, actor, T0 + 1, 10) == status
    assert await store.get(s.session_id) == s


async def test_a_wrong_credential_or_an_expired_lease_is_denied(
    store: SessionStore, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    s = await open_session(store)
    res = await store.transition(s.session_id, "progress", "p1", credential_hash("nope"), T0 + 1)
    assert res.status == "denied"
    await forge_workers(redis_client, key_prefix, exp_ms=T0)
    assert await step(store, s, Op.PROGRESS, "p1", T0 + 1, 10) == "denied"
    assert await store.get(s.session_id) == s


@pytest.mark.parametrize(
    ("grace", "status"),
    [
        # the registry's post-outage grace covers the lapse: still the worker's session
        pytest.param({"from": T0 - 500, "until": T0 + 5_000}, "applied", id="grace-granted"),
        # no sweep since before the lapse, for longer than the outage gap: the same
        pytest.param({"alive": T0 - 200, "gap": 100}, "applied", id="outage-not-yet-swept"),
        # the lease ran out before the outage began: gone, as without any grace
        pytest.param({"from": T0 + 10, "until": T0 + 5_000}, "denied", id="lapsed-before"),
        pytest.param({}, "denied", id="no-outage"),
    ],
)
async def test_a_lease_that_ran_out_during_a_redis_outage_keeps_its_credential(
    store: SessionStore,
    redis_client: aioredis.Redis,
    key_prefix: str,
    grace: dict[str, int],
    status: str,
) -> None:
    s = await open_session(store)
    await forge_workers(redis_client, key_prefix, exp_ms=T0)  # lapsed at T0
    if grace:
        await redis_client.hset(RegistryKeys(key_prefix).grace, mapping=grace)
    assert await step(store, s, Op.PROGRESS, "p1", T0 + 1, 10) == status


@pytest.mark.parametrize("actor", ["", "p1", "d1"])
async def test_the_session_open_returns_is_the_one_it_stored(
    store: SessionStore, redis_client: aioredis.Redis, actor: str
) -> None:
    """Open does not send the new session back: the store builds it from its arguments."""
    step_ = ConversionStep("dtype_cast", "fp8 -> bf16", 1.5)
    nego = Negotiation(Verdict.CONVERTIBLE, ("dtype",), (step_,), ("KV dtype differs",))
    args = OpenArgs(f"s-open-{actor}", f"r-open-{actor}", "p1", "d1", GIB + 7, 9_000, 4_000,
                    negotiation_json(nego))  # fmt: skip
    cred = credential_hash(CRED[actor]) if actor else ""
    res = await store.open(args, actor, cred, T0 + 3)
    assert res.status == "created" and res.session is not None
    assert res.session == await store.get(args.session_id)
    assert res.session.updated_by == (actor or "scheduler")
    assert res.session.negotiation == nego
    (_, fields), *_ = await redis_client.xrevrange(store.keys.feed, count=1)
    assert decode_session(fields) == res.session  # the feed carries the same session


async def test_each_change_replies_stores_and_feeds_the_same_whole_session(
    store: SessionStore, redis_client: aioredis.Redis
) -> None:
    """Scripts send a changed session back as SESSION_FIELDS' values in order, and write it
    into the feed by name: the list must cover every field the open script stores."""
    s = await open_session(store)
    stored = await redis_client.hgetall(store.keys.session(s.session_id))
    assert {k.decode() for k in stored} == {*SESSION_FIELDS, "fp"}
    for op, actor, nbytes in ((Op.PROGRESS, "p1", 100), (Op.COMPLETE, "d1", 0)):
        cred = credential_hash(CRED[actor])
        res = await store.transition(s.session_id, op.value, actor, cred, T0 + 2, nbytes)
        assert res.status == "applied" and res.session is not None
        assert res.session == await store.get(s.session_id)
        (_, fields), *_ = await redis_client.xrevrange(store.keys.feed, count=1)
        assert {k.decode() for k in fields} == set(SESSION_FIELDS)
        assert decode_session(fields) == res.session
    done = await store.get(s.session_id)
    assert done is not None and done.state is S.COMPLETE and done.version == 3
    assert done.bytes_done == GIB and done.updated_by == "d1"
    refused = await store.transition(
        s.session_id, Op.PROGRESS.value, "p1", credential_hash(CRED["p1"]), T0 + 3, 5
    )
    assert (refused.status, refused.session) == ("illegal", done)


async def test_open_is_idempotent_per_request_id(store: SessionStore) -> None:
    s = await open_session(store)
    args = OpenArgs("other-id", s.request_id, "p1", "d1", GIB, 10_000, 5_000, "{}")
    again = await store.open(args, "", "", T0 + 5)
    assert (again.status, again.session) == ("same", s)
    conflict = await store.open(replace(args, expected_bytes=GIB + 1), "", "", T0 + 5)
    assert (conflict.status, conflict.detail) == ("conflict", s.session_id)
    gone = await store.open(replace(args, request_id="fresh", source_worker_id="zz"), "", "", T0)
    assert (gone.status, gone.detail) == ("gone", "zz")


async def test_a_retried_open_of_an_overdue_session_expires_it_first(store: SessionStore) -> None:
    """A retry must not hand back a session whose deadline has passed as if it were open,
    whether or not a sweep has got to it; and the lookup-only form opens nothing."""
    s = await open_session(store)
    args = OpenArgs("other-id", s.request_id, "p1", "d1", GIB, 10_000, 5_000, "{}")
    late = await store.open(args, "", "", T0 + 10_001)
    assert late.status == "same_expired" and late.session is not None
    assert (late.session.state, late.session.reason) == (S.EXPIRED, "deadline_exceeded")
    assert late.session.version == s.version + 1
    again = await store.open(args, "", "", T0 + 10_002)
    assert (again.status, again.session) == ("same", late.session)
    fresh = replace(args, request_id="never-opened")
    assert (await store.open(fresh, "", "", T0, existing_only=True)).status == "none"
    assert await store.get_by_request("never-opened") is None


async def test_terminal_sessions_are_purged_after_retention(
    store: SessionStore, redis_client: aioredis.Redis
) -> None:
    s = await open_session(store)
    assert await step(store, s, Op.ABORT, "d1", T0 + 1) == "applied"
    ttl = await redis_client.pttl(store.keys.session(s.session_id))
    assert 60_000 < ttl <= 120_000
    assert (await store.sweep(T0 + 30_000)).purged == 0
    assert (await store.sweep(T0 + 60_002)).purged == 1
    assert await store.get(s.session_id) is None
    assert await store.get_by_request(s.request_id) is None
    assert await store.page("", 10) == ([], None)


# -- random sequences from several clients ---------------------------------------------------

ACTORS = ["p1", "d1", "x1", "intruder", SCHEDULER]
actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("op"),
            st.sampled_from(list(Op)),
            st.sampled_from(ACTORS),
            st.integers(0, GIB + 5),
        ),
        st.tuples(st.just("wait"), st.integers(1, 4_000)),
        st.tuples(st.just("sweep")),
    ),
    max_size=25,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=actions)
async def test_random_operations_from_several_clients(
    store: SessionStore, actions: list[tuple[object, ...]]
) -> None:
    """The stored session always equals the pure model's; nothing illegal is ever stored,
    terminal states are final, bytes never go backwards."""
    model = await open_session(store)
    now = T0
    for action in actions:
        if action[0] == "wait":
            now += int(action[1])  # type: ignore[call-overload]
            continue
        if action[0] == "sweep":
            await store.sweep(now)
            if model.overdue(now):
                model = replace(
                    model,
                    state=S.EXPIRED,
                    reason=expiry_reason(model, now),
                    updated_ms=now,
                    version=model.version + 1,
                    updated_by=BROKER,
                )
        else:
            _, op, actor, nbytes = action
            assert isinstance(op, Op) and isinstance(actor, str) and isinstance(nbytes, int)
            store_actor = "" if actor == SCHEDULER else actor
            status = await step(store, model, op, store_actor, now, nbytes)
            if actor in ("x1", "intruder"):
                assert status == "not_party"
            else:
                out = apply(model, op, now, actor, bytes_done=nbytes, reason="why")
                assert status == out.status.value
                if out.status is not Status.ILLEGAL and model.state.terminal:
                    assert out.session == model
                model = out.session
        stored = await store.get(model.session_id)
        assert stored == model
        assert stored.bytes_done <= stored.expected_bytes


# -- exactly-once expiry with two replicas ---------------------------------------------------


async def test_two_replicas_expire_each_overdue_session_exactly_once(
    redis_server: EmbeddedRedis, key_prefix: str
) -> None:
    """Two broker services in this process, each with its own Redis client (connection
    pool), sweep concurrently in small batches until nothing is overdue."""
    clients = [redis_conn.connect(redis_server.url) for _ in range(2)]
    try:
        await forge_workers(clients[0], key_prefix)
        clock = FakeClock(T0)
        cfg = KvBrokerSettings(key_prefix=key_prefix, registry_key_prefix=key_prefix)
        replicas = [KvBrokerService(cfg, c, clock) for c in clients]
        sessions = [await open_session(replicas[0].store, deadline_ms=1_000) for _ in range(300)]
        clock.advance(2_000)

        async def sweeper(svc: KvBrokerService) -> list[str]:
            mine: list[str] = []
            while True:
                result = await svc.store.sweep(clock.now_ms(), limit=7)
                mine += [s.session_id for s in result.changed]
                if result.open_sessions == 0:
                    return mine
                await asyncio.sleep(0)

        results = await asyncio.gather(*(sweeper(svc) for svc in replicas for _ in range(3)))
        expired = Counter(sid for r in results for sid in r)
        assert set(expired) == {s.session_id for s in sessions}
        assert set(expired.values()) == {1}
        feed = await clients[0].xrange(KvKeys(key_prefix).feed, count=10_000)
        events = Counter(
            decode_session(f).session_id for _, f in feed if decode_session(f).state is S.EXPIRED
        )
        assert events == Counter({s.session_id: 1 for s in sessions})
    finally:
        for c in clients:
            await c.aclose()
