"""Group commit: the reservations of `Schedule` calls in flight together, in one script call.

Every `Schedule` ends in one Redis script call (reservation, record head, idempotency key;
`hpd_scheduler.store`). Under concurrency each call paid its own round trip and its own
client-side script call (about 280 us of Python in the scheduler per call, measured). A
`GroupCommit` gathers the calls waiting to be written into batches and sends each batch as
one `reserve_batch` call. Redis runs the entries one after another inside the script, each
exactly as the single-call script would (`reserve_one` is the same Lua function), so the
provisional accounting, idempotency, the never-more-than-K check across replicas and the
TTLs are unchanged: only the round trip and the per-call overhead are shared.

When a batch is sent: at once when nothing is in flight (an idle scheduler adds no
latency: a lone call is a batch of one), otherwise when the batch in flight answers (the
calls that arrived meanwhile form the next batch), when the batch reaches ``max_batch``
(then a second batch may be in flight), or after ``wait_us`` with nothing answering. At
most ``max_in_flight`` batches are in flight. A batch that fails (Redis unreachable, a
WAIT not met) fails every call in it with the same error, as each call would have failed
alone. A call cancelled before its batch is sent is left out of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from hpd_scheduler import metrics
from hpd_scheduler.store import ReserveEntry, ReserveResult, SchedulerStore


@dataclass(frozen=True, slots=True)
class GroupCommitSettings:
    """``max_batch`` 1 turns group commit off (every call its own script call).

    How the defaults were chosen (`bench/schedule_rpc.py --quick --sizes 256
    --group-commit 64,W`, three runs each of W = 0, 200 and 1,000 on a 2-core machine,
    medians of Schedule throughput at concurrency 16 over the echo + EVALSHA baseline's,
    unary / stream): 0.53 / 0.62, 0.62 / 0.73, 0.62 / 0.75. A second batch in flight
    before the first answers helps; waiting longer than 200 us did not help further and
    adds that much to a call's latency, so 200. ``max_batch`` 64 bounds one script's run
    inside Redis (about 25 us an entry, so under 2 ms, during which Redis serves no other
    client); at concurrency 16 batches never reach it. Two batches in flight at most.
    """

    max_batch: int = 64
    wait_us: int = 200
    max_in_flight: int = 2

    def validate(self) -> None:
        if not 1 <= self.max_batch <= 1024:
            raise ValueError("group_commit_max_batch must be within 1..1024")
        if not 0 <= self.wait_us <= 100_000:
            raise ValueError("group_commit_wait_us must be within 0..100000")
        if not 1 <= self.max_in_flight <= 64:
            raise ValueError("group_commit_max_in_flight must be within 1..64")


_Waiter = tuple[ReserveEntry, "asyncio.Future[ReserveResult]"]


class GroupCommit:
    """Batches `SchedulerStore.reserve` calls (module docstring)."""

    def __init__(
        self,
        store: SchedulerStore,
        settings: GroupCommitSettings,
        index_cap: int,
        purge_limit: int = 64,
    ) -> None:
        settings.validate()
        self.store = store
        self.settings = settings
        self.index_cap = index_cap
        self.purge_limit = purge_limit
        self._pending: list[_Waiter] = []
        self._in_flight = 0
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.settings.max_batch > 1

    async def reserve(self, entry: ReserveEntry) -> ReserveResult:
        """What `SchedulerStore.reserve` answers for this entry."""
        if not self.enabled:
            return await self.store.reserve(entry, self.index_cap, self.purge_limit)
        fut: asyncio.Future[ReserveResult] = asyncio.get_running_loop().create_future()
        self._pending.append((entry, fut))
        self._consider()
        return await fut

    def _consider(self) -> None:
        """Send a batch now if the rules allow it; else make sure a timer will."""
        s = self.settings
        while self._pending and self._in_flight < s.max_in_flight:
            if self._in_flight and len(self._pending) < s.max_batch:
                break  # the batch in flight answering (or the timer) sends these
            self._send()
        if self._pending and self._timer is None and s.wait_us > 0:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(s.wait_us / 1e6, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._in_flight >= self.settings.max_in_flight:
            return  # a batch answering calls _consider (and re-arms the timer)
        if self._pending:
            self._send()
        self._consider()

    def _send(self) -> None:
        batch = self._pending[: self.settings.max_batch]
        del self._pending[: self.settings.max_batch]
        batch = [(e, f) for e, f in batch if not f.done()]  # cancelled callers left out
        if not batch:
            return
        if self._timer is not None and not self._pending:
            self._timer.cancel()
            self._timer = None
        self._in_flight += 1
        task = asyncio.ensure_future(self._write(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, batch: Sequence[_Waiter]) -> None:
        metrics.GROUP_COMMIT_BATCH.observe(len(batch))
        try:
            results = await self.store.reserve_batch(
                [e for e, _ in batch], self.index_cap, self.purge_limit
            )
        except Exception as exc:  # every caller in the batch gets the batch's error
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
        except BaseException:  # cancelled (shutdown): so are its callers
            for _, fut in batch:
                fut.cancel()
            raise
        else:
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)
        finally:
            self._in_flight -= 1
            self._consider()

    async def close(self) -> None:
        """Lets the batches in flight finish (their callers are answered)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            self._send()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
