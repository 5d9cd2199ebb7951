"""The explanation writer yields to serving, yet loses nothing a record points to."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from hpd_scheduler.explanations import ExplanationWriter


class Store:
    def __init__(self) -> None:
        self.written: list[str] = []

    async def write_explanations(self, items: Sequence[tuple[str, str]]) -> int:
        self.written.extend(rid for rid, _ in items)
        return len(items)


class Record:
    def __init__(self, rid: str, encoded: list[str]) -> None:
        self.rid = rid
        self.encoded = encoded

    def encode(self, max_options: int = 16) -> str:
        self.encoded.append(self.rid)
        return "{}"


class FakeDecision:
    def __init__(self, rid: str, encoded: list[str]) -> None:
        self.record = Record(rid, encoded)


def writer(busy: list[bool], backlog: int = 100) -> tuple[ExplanationWriter, Store, list[str]]:
    store = Store()
    w = ExplanationWriter(store, backlog=backlog, batch=4, busy=lambda _loop: busy[0])  # type: ignore[arg-type]
    return w, store, []


def add(w: ExplanationWriter, encoded: list[str], *rids: str) -> None:
    for rid in rids:
        w.add(rid, FakeDecision(rid, encoded))  # type: ignore[arg-type]


async def test_nothing_is_encoded_while_the_loop_has_work_and_all_once_it_is_idle() -> None:
    busy = [True]
    w, store, encoded = writer(busy)
    add(w, encoded, "a", "b", "c")
    task = asyncio.ensure_future(w.run())
    await asyncio.sleep(0.02)
    assert encoded == [] and store.written == []
    busy[0] = False
    await asyncio.sleep(0.01)
    assert encoded == ["a", "b", "c"]
    await asyncio.sleep(0.05)  # a part batch is written within the write interval
    assert store.written == ["a", "b", "c"]
    w.stop()
    await asyncio.wait_for(task, 1)


async def test_past_the_backlog_the_oldest_are_encoded_even_on_a_busy_loop() -> None:
    busy = [True]
    w, _, encoded = writer(busy, backlog=3)
    add(w, encoded, "a", "b", "c", "d", "e")
    task = asyncio.ensure_future(w.run())
    await asyncio.sleep(0.02)
    assert encoded == ["a", "b"] and len(w._waiting) == 3  # down to the bound, oldest first
    assert len(w) == 5  # nothing dropped: two encoded, three waiting
    w.stop()
    task.cancel()


async def test_explanations_are_written_together() -> None:
    w, store, encoded = writer([False])
    writes: list[int] = []
    real = store.write_explanations

    async def counted(items: Any) -> int:
        writes.append(len(items))
        return await real(items)

    store.write_explanations = counted  # type: ignore[method-assign]
    task = asyncio.ensure_future(w.run())
    for i in range(6):  # one at a time, as requests at concurrency 1 come
        add(w, encoded, f"r{i}")
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.1)
    assert store.written == [f"r{i}" for i in range(6)]
    assert len(writes) <= 3, writes  # batches of 4 or per write interval, not one each
    w.stop()
    await asyncio.wait_for(task, 1)


async def test_a_read_writes_the_waiting_explanation_first() -> None:
    w, store, encoded = writer([True])
    add(w, encoded, "a", "b")
    await w.write_now("b")
    assert store.written == ["b"] and len(w) == 1
    await w.write_now("zzz")  # not waiting: nothing to do
    assert store.written == ["b"]


async def test_shutdown_writes_everything_that_waits() -> None:
    w, store, encoded = writer([True])
    add(w, encoded, *[f"r{i}" for i in range(10)])
    await w.flush()
    assert store.written == [f"r{i}" for i in range(10)] and len(w) == 0


async def test_a_replanned_id_keeps_its_newest_decision() -> None:
    w, store, encoded = writer([False])
    first: list[str] = []
    w.add("a", FakeDecision("a", first))  # type: ignore[arg-type]
    add(w, encoded, "a")
    await w.flush()
    assert first == [] and encoded == ["a"] and store.written == ["a"]


def test_an_idle_asyncio_loop_reads_as_idle() -> None:
    from hpd_scheduler.explanations import loop_has_ready_work

    loop = asyncio.new_event_loop()
    try:
        assert not loop_has_ready_work(loop)
        loop.call_soon(lambda: None)
        assert loop_has_ready_work(loop)
    finally:
        loop.close()
