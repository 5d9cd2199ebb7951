"""When `GroupCommit` sends a batch, and what its callers get (a store that records calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from hpd_common.errors import Unavailable
from hpd_scheduler.group_commit import GroupCommit, GroupCommitSettings
from hpd_scheduler.store import ReserveEntry, ReserveResult, ReserveStatus


class SlowStore:
    """Answers each batch after ``delay_s``; every entry RESERVED (or ``fail`` raised)."""

    def __init__(self, delay_s: float = 0.02, fail: Exception | None = None) -> None:
        self.delay_s = delay_s
        self.fail = fail
        self.batches: list[list[str]] = []
        self.singles: list[str] = []

    async def reserve_batch(
        self, entries: Sequence[ReserveEntry], index_cap: int, purge_limit: int = 64
    ) -> list[ReserveResult]:
        self.batches.append([e.request_id for e in entries])
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return [ReserveResult(ReserveStatus.RESERVED) for _ in entries]

    async def reserve(self, entry: ReserveEntry, *args: Any) -> ReserveResult:
        self.singles.append(entry.request_id)
        return ReserveResult(ReserveStatus.RESERVED)


def entry(rid: str) -> ReserveEntry:
    return ReserveEntry(rid, {}, "accept", None, 0, 1_000, 1_000)


def commit(store: SlowStore, **kw: Any) -> GroupCommit:
    return GroupCommit(store, GroupCommitSettings(**kw), index_cap=100)  # type: ignore[arg-type]


async def test_a_lone_call_goes_at_once_as_a_batch_of_one() -> None:
    store = SlowStore(delay_s=0)
    gc = commit(store, max_batch=8, wait_us=100_000)  # a long wait bound is never waited
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert (await gc.reserve(entry("a"))).status is ReserveStatus.RESERVED
    assert loop.time() - t0 < 0.05
    assert store.batches == [["a"]]


async def test_calls_arriving_while_a_batch_is_in_flight_form_the_next_batch() -> None:
    store = SlowStore(delay_s=0.02)
    gc = commit(store, max_batch=8, wait_us=0, max_in_flight=1)
    first = asyncio.ensure_future(gc.reserve(entry("a")))
    await asyncio.sleep(0.005)
    rest = [asyncio.ensure_future(gc.reserve(entry(f"b{i}"))) for i in range(5)]
    await asyncio.gather(first, *rest)
    assert store.batches == [["a"], ["b0", "b1", "b2", "b3", "b4"]]


async def test_a_full_batch_goes_without_waiting_for_the_one_in_flight() -> None:
    store = SlowStore(delay_s=0.05)
    gc = commit(store, max_batch=3, wait_us=0, max_in_flight=2)
    calls = [asyncio.ensure_future(gc.reserve(entry(f"c{i}"))) for i in range(7)]
    await asyncio.sleep(0.01)
    # c0 alone, then c1..c3 full while c0 is in flight; c4..c6 wait (two in flight)
    assert store.batches == [["c0"], ["c1", "c2", "c3"]]
    await asyncio.gather(*calls)
    assert store.batches[2:] == [["c4", "c5", "c6"]]


async def test_the_wait_bound_sends_a_second_batch_while_one_is_in_flight() -> None:
    store = SlowStore(delay_s=0.2)
    gc = commit(store, max_batch=64, wait_us=2_000, max_in_flight=2)
    first = asyncio.ensure_future(gc.reserve(entry("a")))
    await asyncio.sleep(0.001)
    second = asyncio.ensure_future(gc.reserve(entry("b")))
    await asyncio.sleep(0.05)  # well past the bound, long before the first answers
    assert store.batches == [["a"], ["b"]]
    await asyncio.gather(first, second)


async def test_a_failed_batch_fails_every_call_in_it() -> None:
    store = SlowStore(delay_s=0.01, fail=Unavailable("state store unavailable: gone"))
    gc = commit(store, max_batch=8, wait_us=0, max_in_flight=1)
    calls = [asyncio.ensure_future(gc.reserve(entry(f"f{i}"))) for i in range(4)]
    out = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(x, Unavailable) for x in out), out
    assert sum(len(b) for b in store.batches) == 4


async def test_a_caller_cancelled_before_its_batch_goes_is_left_out() -> None:
    store = SlowStore(delay_s=0.02)
    gc = commit(store, max_batch=8, wait_us=0, max_in_flight=1)
    first = asyncio.ensure_future(gc.reserve(entry("a")))
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(gc.reserve(entry("gone")))
    kept = asyncio.ensure_future(gc.reserve(entry("kept")))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(first, kept)
    assert store.batches == [["a"], ["kept"]]


async def test_max_batch_one_is_the_single_call_script() -> None:
    store = SlowStore()
    gc = commit(store, max_batch=1, wait_us=0)
    await asyncio.gather(gc.reserve(entry("a")), gc.reserve(entry("b")))
    assert store.singles == ["a", "b"] and store.batches == []


async def test_close_answers_every_waiting_call() -> None:
    store = SlowStore(delay_s=0.01)
    gc = commit(store, max_batch=2, wait_us=0, max_in_flight=1)
    calls = [asyncio.ensure_future(gc.reserve(entry(f"z{i}"))) for i in range(5)]
    await asyncio.sleep(0)
    await gc.close()
    assert all(c.done() and not c.cancelled() for c in calls)
    assert sorted(rid for b in store.batches for rid in b) == [f"z{i}" for i in range(5)]


@pytest.mark.parametrize(
    "kw",
    [{"max_batch": 0}, {"max_batch": 2000}, {"wait_us": -1}, {"max_in_flight": 0}],
    ids=lambda kw: next(iter(kw)),
)
def test_settings_out_of_range_are_refused(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        GroupCommitSettings(**kw).validate()
