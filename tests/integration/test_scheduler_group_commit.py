"""Group commit against a real redis-server: a batch does exactly what its entries would do
one call at a time, and no interleaving of batched and unary calls passes a capacity."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpd_common import redis_conn
from hpd_scheduler.group_commit import GroupCommit, GroupCommitSettings
from hpd_scheduler.keys import SchedulerKeys
from hpd_scheduler.store import (
    ReservationAsk,
    ReserveEntry,
    ReserveResult,
    ReserveStatus,
    SchedulerStore,
)
from hpd_tools.embedded_redis import EmbeddedRedis

NOW = 1_000_000
TTL = 60_000
KV = 100
K = 3  # each worker has room for K reservations
WORKERS = ("w0", "w1")


@pytest.fixture
async def client(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    c = redis_conn.connect(redis_server.url)
    yield c
    await c.aclose()


def fresh_store(client: aioredis.Redis) -> SchedulerStore:
    return SchedulerStore(client, SchedulerKeys("gc" + uuid.uuid4().hex[:10]))


def entry(rid: str, worker: str | None, at: int = NOW, tokens: int = 0) -> ReserveEntry:
    """A plan on ``worker`` (None: a refusal, which reserves nothing)."""
    ask = None if worker is None else ReservationAsk(worker, KV, K * KV, -1, "p0", tokens)
    head = {"request_id": rid, "decision": "reject" if worker is None else "accept", "at": at}
    return ReserveEntry(rid, head, "reject" if worker is None else "accept", ask, at, TTL, TTL)


async def state(store: SchedulerStore) -> dict[str, Any]:
    """Everything the scripts write, with the key prefix taken out."""
    k, c = store.keys, store.client
    records = {}
    for rid in await c.zrange(k.index, 0, -1):
        rid = rid.decode()
        records[rid] = await c.hgetall(k.record(rid))
    return {
        "totals": await c.hgetall(k.totals),
        "reservations": await c.hgetall(k.reservations),
        "expiry": await c.zrange(k.expiry, 0, -1, withscores=True),
        "index": await c.zrange(k.index, 0, -1, withscores=True),
        "records": records,
    }


async def one_by_one(store: SchedulerStore, entries: list[ReserveEntry]) -> list[ReserveResult]:
    return [await store.reserve(e, index_cap=1_000) for e in entries]


async def test_a_batch_mixing_fresh_replayed_full_and_refused_entries(
    client: aioredis.Redis,
) -> None:
    store = fresh_store(client)
    await one_by_one(store, [entry("old", "w0")])
    batch = [
        entry("a", "w0"),  # fresh
        entry("old", "w0"),  # a replay of an earlier call
        entry("b", "w0"),  # fills w0 (old, a, b)
        entry("c", "w0"),  # full
        entry("a", "w1"),  # the same id twice in one batch: a replay
        entry("r", None),  # a refusal: recorded, nothing reserved
        entry("d", "w1"),
    ]
    out = await store.reserve_batch(batch, index_cap=1_000)
    assert [r.status for r in out] == [
        ReserveStatus.RESERVED,
        ReserveStatus.REPLAY,
        ReserveStatus.RESERVED,
        ReserveStatus.FULL,
        ReserveStatus.REPLAY,
        ReserveStatus.RESERVED,
        ReserveStatus.RESERVED,
    ]
    assert out[2].decode.kv_bytes == K * KV and out[2].decode.requests == K
    assert out[3].decode.requests == K  # the totals it found the worker at
    assert out[4].head is not None and out[4].head["decision"] == "accept"
    assert out[6].decode.requests == 1
    assert await store.reservation_count() == 4  # old, a, b, d
    assert sorted(x.decode() for x in await client.hkeys(store.keys.reservations)) == [
        "a", "b", "d", "old",
    ]  # fmt: skip
    assert (await store.get("r")) is not None  # the refusal has its record


async def test_a_batch_trims_the_index_like_single_calls(client: aioredis.Redis) -> None:
    store = fresh_store(client)
    old = [entry(f"o{i}", None, at=NOW - 2 * TTL + i) for i in range(5)]
    await store.reserve_batch(old, index_cap=1_000)
    await store.reserve_batch([entry("n0", None), entry("n1", None)], index_cap=4)
    index = [x.decode() for x in await client.zrange(store.keys.index, 0, -1)]
    assert index == ["o3", "o4", "n0", "n1"]
    assert await store.get("o0") is None and await store.get("o3") is not None


ops = st.lists(
    st.tuples(
        st.sampled_from(["r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7"]),
        st.sampled_from([*WORKERS, None]),
        st.integers(0, 3 * TTL),  # ms after NOW: reservations lapse and are purged between
        st.integers(0, 50),  # prefill tokens
    ),
    min_size=1,
    max_size=24,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops, cuts=st.lists(st.integers(1, 24), max_size=8))
async def test_any_batching_equals_one_call_at_a_time(
    client: aioredis.Redis, ops: list[tuple[str, str | None, int, int]], cuts: list[int]
) -> None:
    """Cut the same sequence into batches anywhere: every answer and everything stored is
    what the single-call script gives."""
    entries = [entry(rid, w, NOW + dt, tk) for rid, w, dt, tk in ops]
    single, batched = fresh_store(client), fresh_store(client)
    want = await one_by_one(single, entries)
    got: list[ReserveResult] = []
    rest = list(entries)
    for cut in [*cuts, len(entries)]:
        if not rest:
            break
        got += await batched.reserve_batch(rest[:cut], index_cap=1_000)
        rest = rest[cut:]
    assert got == want
    assert await state(batched) == await state(single)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    max_batch=st.integers(2, 8),
    wait_us=st.sampled_from([0, 50, 500]),
    n=st.integers(4, 30),
)
async def test_batched_and_unary_calls_never_pass_k(
    client: aioredis.Redis, seed: int, max_batch: int, wait_us: int, n: int
) -> None:
    """Two schedulers (one with group commit, one without) race on two small workers in a
    random interleaving: never more than K reservations on a worker, every granted
    reservation is stored, a retried id never reserves twice."""
    rng = random.Random(seed)
    prefix = "gc" + uuid.uuid4().hex[:10]
    store_a = SchedulerStore(client, SchedulerKeys(prefix))
    store_b = SchedulerStore(client, SchedulerKeys(prefix))
    batched = GroupCommit(store_a, GroupCommitSettings(max_batch, wait_us), index_cap=1_000)
    unary = GroupCommit(store_b, GroupCommitSettings(1, 0), index_cap=1_000)
    ids = [f"q{rng.randrange(n)}" for _ in range(n)]  # repeats: retries of one id

    async def call(i: int) -> tuple[str, ReserveResult]:
        await asyncio.sleep(rng.random() * 0.002)
        via = batched if rng.random() < 0.6 else unary
        rid = ids[i]
        return rid, await via.reserve(entry(rid, rng.choice(WORKERS)))

    results = await asyncio.gather(*(call(i) for i in range(n)))
    await batched.close()
    reserved = [rid for rid, r in results if r.status is ReserveStatus.RESERVED]
    assert len(reserved) == len(set(reserved))  # one id reserves at most once
    held = await client.hgetall(store_a.keys.reservations)
    assert sorted(x.decode() for x in held) == sorted(reserved)
    per_worker = {w: 0 for w in WORKERS}
    for v in held.values():
        per_worker[v.decode().split("|")[0]] += 1
    assert all(count <= K for count in per_worker.values()), per_worker
    totals = await store_a.totals()
    for w, count in per_worker.items():
        assert totals.get(w, None) is None or totals[w].requests == count
    for _, r in results:
        if r.status is ReserveStatus.FULL:
            assert r.decode.requests + 1 > K  # refused only when the worker was full
