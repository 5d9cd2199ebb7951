"""Route-record explanations, written when the scheduler has nothing better to do.

A decision's explanation (every candidate's factors and scores, the options weighed) is
encoded from the `Decision` the planner returned and attached to the route record. The
encoding costs about as much CPU as the decision itself (`bench/policy_decision.py`'s
``explanation_p50_us_256``: 78 us against a 74 us plan in one run, compiled policy core),
and a scheduler serves on one event loop: an
explanation encoded while requests wait delays their answers by that much. So the writer
yields to serving:

* it encodes one explanation at a time, and only while the event loop has nothing else
  ready to run (no request to parse, plan or answer); otherwise it waits a millisecond and
  looks again. A busy loop still leaves gaps (every request awaits its Redis round trip),
  and the explanations fill them;
* explanations wait in memory meanwhile, up to ``backlog``; past it the oldest are encoded
  even on a busy loop (the backlog bounds memory, and no explanation is dropped for being
  late). Only a Redis that refuses the write loses explanations (logged, as before);
* encoded explanations are written together, one script call per ``batch`` or per
  ``write_interval_s`` (20 ms), whichever comes first: at concurrency 1 a write per
  request was an extra Redis call per request;
* a read of a record whose explanation is still waiting (`GetRouteRecord`) encodes and
  writes that one first, so no record is ever read without the explanation it has;
* on shutdown every waiting explanation is written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hpd_common.errors import Unavailable
from hpd_common.logging import get_logger
from hpd_scheduler.policy import Decision
from hpd_scheduler.store import SchedulerStore

log = get_logger("scheduler.explanations")

MAX_OPTIONS = 8
"""Options per side kept in an explanation (the chosen ones and the best alternatives)."""


def loop_has_ready_work(loop: asyncio.AbstractEventLoop) -> bool:
    """True while callbacks wait to run on ``loop`` (asyncio's ready queue; an event loop
    without one, e.g. a third-party loop, is taken as idle)."""
    ready = getattr(loop, "_ready", None)
    return bool(ready)


class ExplanationWriter:
    """Waiting explanations (request id -> decision, oldest first) and their writer."""

    def __init__(
        self,
        store: SchedulerStore,
        backlog: int = 4_096,
        batch: int = 64,
        busy: Callable[[asyncio.AbstractEventLoop], bool] = loop_has_ready_work,
        write_interval_s: float = 0.02,
    ) -> None:
        self.store = store
        self.backlog = backlog
        self.batch = batch
        self.write_interval_s = write_interval_s
        self._busy = busy
        self._waiting: dict[str, Decision] = {}
        self._encoded: dict[str, str] = {}  # encoded, not yet written
        self._wake = asyncio.Event()
        self._stopping = False
        self.written = 0

    def __len__(self) -> int:
        return len(self._waiting) + len(self._encoded)

    def add(self, request_id: str, decision: Decision) -> None:
        self._waiting.pop(request_id, None)  # a re-plan of the id: the newer one counts
        self._waiting[request_id] = decision
        self._wake.set()

    def _encode(self, request_id: str, decision: Decision) -> str | None:
        try:
            return decision.record.encode(max_options=MAX_OPTIONS)
        except (ValueError, TypeError):
            log.warning("explanation_not_serialisable", request_id=request_id)
            return None

    async def write_now(self, request_id: str) -> None:
        """Encode and write this request's explanation if it is still waiting (with
        whatever else is encoded)."""
        decision = self._waiting.pop(request_id, None)
        if decision is not None:
            doc = self._encode(request_id, decision)
            if doc is not None:
                self._encoded[request_id] = doc
        if request_id in self._encoded:
            await self._write()

    async def flush(self, idle_only: bool = False) -> None:
        """Encode what waits, writing every full batch. ``idle_only``: yield to any ready
        work first (a millisecond at a time) unless the backlog is over its bound, and
        leave a part batch for the next write; else write everything."""
        loop = asyncio.get_running_loop()
        while self._waiting:
            if idle_only and len(self._waiting) <= self.backlog and self._busy(loop):
                await asyncio.sleep(0.001)
                continue
            rid = next(iter(self._waiting))
            doc = self._encode(rid, self._waiting.pop(rid))
            if doc is not None:
                self._encoded[rid] = doc
            if len(self._encoded) >= self.batch:
                await self._write()
            elif idle_only:
                await asyncio.sleep(0)  # a request that just arrived goes first
        if not idle_only:
            await self._write()

    async def _write(self) -> None:
        items, self._encoded = list(self._encoded.items()), {}
        if items:
            await self.store.write_explanations(items)
            self.written += len(items)

    async def run(self) -> None:
        """The writer: woken by `add`, writes in idle time until stopped."""
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # the answer of the request that woke us goes out first
            try:
                await self.flush(idle_only=True)
                if self._encoded:  # a part batch: what comes meanwhile joins its write
                    await asyncio.sleep(self.write_interval_s)
                    await self.flush(idle_only=True)
                    await self._write()
            except Unavailable as exc:
                log.warning("explanations_dropped", error=str(exc))
            except Exception:  # drop this batch, keep writing later ones
                log.exception("explanations_error")

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
