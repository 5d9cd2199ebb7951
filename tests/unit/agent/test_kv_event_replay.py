"""The KV event relay with an engine's replay socket (hpd_agent.kv_events.KvEventRelay):
a publisher shaped as vLLM's (a PUB socket, and a ROUTER that answers ``[b"", start]``
with every kept batch from ``start`` on and then sequence -1) on loopback ports; what the
relay reports is what the scheduler's index would hold."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from hpd_agent.kv_events import END_SEQ, REPORT_MAX_EVENTS, KvEvent, KvEventRelay
from hpd_common.kvchain import chain_hashes
from hpd_registry.api import MAX_KV_EVENTS

BLOCK = 16


class Engine:
    """A vLLM-like KV event publisher with a replay buffer of ``keep`` batches."""

    def __init__(self, keep: int = 10_000, pace_s: float = 0.0, stall_after: int = -1) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.keep = keep
        self.pace_s = pace_s  # a wait before each replayed batch (a slow engine)
        self.stall_after = stall_after  # replayed batches before it falls silent (-1: never)
        self.kept: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replays: list[int] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return str(self.pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str:
        return str(self.router.getsockopt_string(zmq.LAST_ENDPOINT))

    def serve(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, _, start_raw = await self.router.recv_multipart()
            start = int.from_bytes(start_raw, "big")
            self.replays.append(start)
            sent = 0
            for seq, payload in self.kept:
                if seq >= start:
                    if sent == self.stall_after:
                        break
                    if self.pace_s:
                        await asyncio.sleep(self.pace_s)
                    await self.router.send_multipart([ident, b"", b"kv", _seq(seq), payload])
                    sent += 1
            else:
                await self.router.send_multipart([ident, b"", b"kv", END_SEQ, b""])

    def batch(self, *events: Any, send: bool = True) -> int:
        """Publish one batch (kept for replay); ``send=False`` keeps it without sending,
        as a message lost on the way."""
        seq = self.seq
        self.seq += 1
        payload = msgpack.packb([1733000000.0, list(events), 0])
        self.kept = [*self.kept, (seq, payload)][-self.keep :]
        if send:
            self.pub.send_multipart([b"kv", _seq(seq), payload])
        return seq

    def restart(self) -> None:
        """The engine restarted: its sequence and kept batches start over."""
        self.seq = 0
        self.kept = []

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)


def _seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, BLOCK, None, "GPU"]


def removed(hashes: list[int]) -> list[Any]:
    return ["BlockRemoved", hashes, "GPU"]


class Index:
    """What the scheduler's index holds for the worker, from the relay's reports."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.reports: list[list[KvEvent]] = []

    async def report(self, block_tokens: int, events: list[KvEvent]) -> None:
        assert block_tokens == BLOCK
        self.reports.append(events)
        for kind, keys in events:
            if kind == "c":
                self.keys.clear()
            elif kind == "r":
                self.keys.difference_update(keys)
            else:
                self.keys.update(keys)

    @property
    def clears(self) -> int:
        return sum(1 for batch in self.reports for kind, _ in batch if kind == "c")


def prompt(n_blocks: int, base: int) -> list[int]:
    return list(range(base, base + n_blocks * BLOCK))


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    e.serve()
    yield e
    await e.close()


async def until(check: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def relay_of(
    engine: Engine, index: Index, replay: bool = True
) -> AsyncIterator[KvEventRelay]:
    relay = KvEventRelay(
        engine.endpoint,
        index.report,
        "kv",
        flush_s=0.01,
        replay_endpoint=engine.replay_endpoint if replay else "",
    )
    task = asyncio.get_running_loop().create_task(relay.run())
    try:
        yield relay
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def subscribed(engine: Engine, relay: KvEventRelay, index: Index) -> None:
    """Publish probes until the relay's subscription is up (a PUB drops what it sends
    before a subscriber is connected); each probe is a removal of nothing."""
    while True:
        engine.batch(removed([123456789]))
        await asyncio.sleep(0.02)
        if relay.decoder.last_seq is not None and relay.decoder.last_seq >= engine.seq - 1:
            return


async def test_a_relay_that_starts_late_reports_the_engines_whole_history(
    engine: Engine,
) -> None:
    """An agent started (or restarted) while its engine runs: what the engine stored and
    removed before is replayed, so the index holds exactly what the engine holds."""
    a, b = prompt(3, 100), prompt(2, 500)
    engine.batch(stored([1, 2, 3], None, a))
    engine.batch(stored([4, 5], None, b))
    engine.batch(removed([5]))
    index = Index()
    async with relay_of(engine, index) as relay:
        want = set(chain_hashes(a, BLOCK)) | {chain_hashes(b, BLOCK)[0]}
        await until(lambda: index.keys == want)
        assert engine.replays == [0]
        assert relay.replayed == 3
        # and then the live feed, without the replayed batches again
        c = prompt(1, 900)
        engine.batch(stored([6], None, c))
        await until(lambda: chain_hashes(c, BLOCK)[0] in index.keys)
        assert index.keys == want | set(chain_hashes(c, BLOCK))
        assert index.clears == 1  # the one a start always begins with


async def test_without_replay_a_late_relay_knows_only_what_comes_after(engine: Engine) -> None:
    a = prompt(3, 100)
    engine.batch(stored([1, 2, 3], None, a))
    index = Index()
    async with relay_of(engine, index, replay=False) as relay:
        await subscribed(engine, relay, index)
        b = prompt(1, 500)
        engine.batch(stored([4], None, b))
        await until(lambda: bool(index.reports))
        assert index.keys == set(chain_hashes(b, BLOCK))
        assert engine.replays == []


async def test_lost_messages_are_replayed_without_a_clear(engine: Engine) -> None:
    index = Index()
    a, b = prompt(2, 100), prompt(2, 300)
    async with relay_of(engine, index) as relay:
        await subscribed(engine, relay, index)
        engine.batch(stored([1, 2], None, a), send=False)  # lost on the way
        engine.batch(stored([3, 4], None, b))  # the gap shows here
        want = set(chain_hashes(a, BLOCK)) | set(chain_hashes(b, BLOCK))
        await until(lambda: index.keys == want)
        assert relay.decoder.gaps == 0
        assert index.clears == 1  # only the start's
        assert engine.replays[-1] == engine.seq - 2  # from the first lost batch


async def test_a_gap_the_buffer_no_longer_covers_clears(engine: Engine) -> None:
    """Lost batches the engine no longer keeps: the index is cleared (it may miss blocks
    the engine holds, never claim one it dropped), and goes on from what is kept."""
    engine.keep = 1
    index = Index()
    a, b, c = prompt(1, 100), prompt(1, 300), prompt(1, 500)
    async with relay_of(engine, index) as relay:
        await subscribed(engine, relay, index)
        engine.batch(stored([1], None, a))
        await until(lambda: chain_hashes(a, BLOCK)[0] in index.keys)
        engine.batch(removed([1]), send=False)  # lost, and pushed out of the buffer by
        engine.batch(stored([2], None, b), send=False)  # this one, also lost
        engine.batch(stored([3], None, c))
        await until(lambda: chain_hashes(c, BLOCK)[0] in index.keys)
        assert chain_hashes(a, BLOCK)[0] not in index.keys  # removed meanwhile: never kept
        assert relay.decoder.gaps == 1
        assert index.clears == 2


async def test_an_engine_that_restarts_is_replayed_from_its_start(engine: Engine) -> None:
    index = Index()
    a, b = prompt(2, 100), prompt(2, 300)
    async with relay_of(engine, index) as relay:
        await subscribed(engine, relay, index)
        for _ in range(3):
            engine.batch(removed([987654321]))
        engine.batch(stored([1, 2], None, a))
        await until(lambda: chain_hashes(a, BLOCK)[0] in index.keys)
        engine.restart()  # its cache is empty again, its sequence back at 0
        engine.batch(stored([7, 8], None, b))
        want = set(chain_hashes(b, BLOCK))
        await until(lambda: index.keys == want)
        assert engine.replays[-1] == 0


async def test_a_replay_endpoint_that_does_not_answer_is_the_same_as_none() -> None:
    e = Engine()  # not serving its ROUTER: requests go unanswered
    index = Index()
    a = prompt(1, 100)
    try:
        relay = KvEventRelay(
            e.endpoint, index.report, "kv", flush_s=0.01, replay_endpoint=e.replay_endpoint,
            replay_timeout_s=0.2,
        )  # fmt: skip
        task = asyncio.get_running_loop().create_task(relay.run())
        await subscribed(e, relay, index)
        e.batch(stored([1], None, a))
        await until(lambda: chain_hashes(a, BLOCK)[0] in index.keys)
        assert relay.replays == 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await e.close()


@pytest.mark.parametrize("stall_after", [-1, 5])
async def test_the_replay_wait_bounds_silence_not_the_whole_answer(stall_after: int) -> None:
    """An engine answering steadily but slowly (ten batches, each 0.15 s apart: longer in
    all than the 1 s wait) is replayed whole; one that falls silent halfway is the same
    as no replay (nothing half-replayed is reported)."""
    e = Engine(pace_s=0.15, stall_after=stall_after)
    e.serve()
    blocks = [prompt(1, 100 + i * BLOCK) for i in range(10)]
    for i, block in enumerate(blocks):
        e.batch(stored([i + 1], None, block), send=False)
    index = Index()
    try:
        relay = KvEventRelay(
            e.endpoint, index.report, "kv", flush_s=0.01, replay_endpoint=e.replay_endpoint,
            replay_timeout_s=1.0,
        )  # fmt: skip
        task = asyncio.get_running_loop().create_task(relay.run())
        await subscribed(e, relay, index)  # after the replay, answered or given up
        if stall_after < 0:
            want = {k for b in blocks for k in chain_hashes(b, BLOCK)}
            await until(lambda: index.keys == want)
            assert relay.replays == 1 and relay.replayed >= 10  # and the probes sent before
        else:
            live = prompt(1, 9_000)
            e.batch(stored([99], None, live))
            await until(lambda: bool(index.keys))
            assert index.keys == set(chain_hashes(live, BLOCK))  # none of the half replay
            assert relay.replays == 0 and relay.replayed == 0 and index.clears == 1
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await e.close()


async def test_after_a_lost_report_the_history_is_reported_again(engine: Engine) -> None:
    """A report that does not reach the registry: the next one starts with a clear and,
    with replay, carries the engine's kept history rather than only what came after."""
    index = Index()
    fail = [True]

    async def flaky(block_tokens: int, events: list[KvEvent]) -> None:
        if fail[0] and any(kind in ("s", "h") for kind, _ in events):
            fail[0] = False
            raise ConnectionError("registry away")
        await index.report(block_tokens, events)

    a, b = prompt(2, 100), prompt(1, 300)
    relay = KvEventRelay(
        engine.endpoint, flaky, "kv", flush_s=0.01, replay_endpoint=engine.replay_endpoint
    )
    task = asyncio.get_running_loop().create_task(relay.run())
    try:
        await subscribed(engine, relay, index)
        engine.batch(stored([1, 2], None, a))  # its report is lost
        await until(lambda: relay.failed == 1)
        engine.batch(stored([3], None, b))
        want = set(chain_hashes(a, BLOCK)) | set(chain_hashes(b, BLOCK))
        await until(lambda: index.keys == want)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_no_batch_is_lost_to_the_flush_timer(engine: Engine) -> None:
    """Batches arriving just as the relay's flush deadline passes all reach the index
    (without replay nothing would mend a loss: the relay sees each batch exactly once). A
    receive cancelled by the flush timer in the loop iteration its message arrived in lost
    that message, now and then on a busy machine."""
    index = Index()
    relay = KvEventRelay(engine.endpoint, index.report, "kv", flush_s=0.001)
    task = asyncio.get_running_loop().create_task(relay.run())
    try:
        await subscribed(engine, relay, index)
        first = engine.seq
        want: set[int] = set()
        for i in range(300):
            block = prompt(1, 10_000 + i * BLOCK)
            want |= set(chain_hashes(block, BLOCK))
            engine.batch(stored([i + 1], None, block))
            # a busy process: the loop is held while the batch arrives and the flush
            # deadline passes, so both wake the relay in the same loop iteration
            time.sleep(0.002)  # noqa: ASYNC251 (on purpose: the loop is held)
            await asyncio.sleep(0.001 if i % 2 else 0)
        with contextlib.suppress(AssertionError):
            await until(lambda: want <= index.keys, timeout_s=10)
        missing = len(want - index.keys)
        assert missing == 0, f"{missing} of {len(want)} batches lost (from seq {first})"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_the_report_limit_is_the_registrys() -> None:
    assert REPORT_MAX_EVENTS == MAX_KV_EVENTS


async def test_a_history_longer_than_one_report_takes_is_reported_in_parts(
    engine: Engine,
) -> None:
    """1,500 kept batches (more than the registry takes in one call): replayed whole, and
    reported in parts within the limit, the clear only in the first."""
    want: set[int] = set()
    for i in range(1500):
        block = prompt(1, 100_000 + i * BLOCK)
        want |= set(chain_hashes(block, BLOCK))
        engine.batch(stored([i + 1], None, block), send=False)
    index = Index()
    async with relay_of(engine, index) as relay:
        # a deadline for a busy machine, not a speed target: a CI run whose suite shared the
        # cores took over 20 s for the 1,500 batches once
        await until(lambda: index.keys == want, timeout_s=90)
        assert max(len(r) for r in index.reports) <= min(relay.max_batch, REPORT_MAX_EVENTS)
        assert len(index.reports) > 1 and index.clears == 1
        assert relay.failed == 0


async def test_an_engine_that_restarts_right_after_a_gap_was_filled_is_not_skipped(
    engine: Engine,
) -> None:
    """A gap filled from the replay leaves the relay skipping live batches up to the
    replay's last; an engine that restarts then sends sequences from 0 again, which are a
    restart (they go back below the last live one), not batches the replay gave."""
    index = Index()
    a, b, c = prompt(1, 100), prompt(1, 300), prompt(1, 500)
    async with relay_of(engine, index) as relay:
        await subscribed(engine, relay, index)
        engine.batch(stored([1], None, a), send=False)  # lost
        engine.batch(stored([2], None, b))  # the gap shows: replayed
        await until(lambda: chain_hashes(b, BLOCK)[0] in index.keys)
        engine.restart()
        engine.batch(stored([3], None, c))  # sequence 0 again
        want = set(chain_hashes(c, BLOCK))
        await until(lambda: index.keys == want)
        assert engine.replays[-1] == 0
