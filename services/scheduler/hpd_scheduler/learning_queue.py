"""What outcomes teach, learned in batches off the outcome's path.

An outcome's samples (``policy.learning.samples_from``) used to be fitted, exported and
pushed to the store inside ``ReportOutcome``: a fit per sample (about a millisecond of
Python when it reran), a gauge update and a Redis round trip per outcome. At a few hundred
outcomes a second that was a fifth of an embedded gateway's CPU (py-spy over
``bench/gateway_capacity.py``). Here the samples wait at most ``BATCH_S`` and go in
together: each worker's fit is redone at most once per batch (``SpeedLearner.add_batch``),
its gauges exported once, and the batch pushed to the store in one pipeline. The planner
sees a worker's new figures a batch later, which is nothing beside the seconds of traffic a
fit rests on. Stopping flushes what waits, so a sample is lost only with the process (or
when the store is away: the fit here still has it, the other replicas do not).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from hpd_common.errors import Unavailable
from hpd_common.logging import get_logger
from hpd_scheduler import metrics
from hpd_scheduler.learn_store import LearnStore
from hpd_scheduler.policy.learner import SpeedLearner
from hpd_scheduler.policy.learning import Sample, prefill_key

__all__ = ["BATCH_S", "LearningQueue"]

log = get_logger("scheduler.learning")

BATCH_S = 0.05
"""Longest a sample waits to be learned: short beside a fit's seconds of traffic, long
enough that a busy front door fits each worker a few times a second, not per outcome."""


class LearningQueue:
    """Samples waiting to be learned, and the loop that learns them (module docstring)."""

    def __init__(
        self, learner: SpeedLearner, store: LearnStore, on_learned: Callable[[], None]
    ) -> None:
        self.learner = learner
        self.store = store
        self.on_learned = on_learned
        self._waiting: list[tuple[str, Sample]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, samples: Sequence[tuple[str, Sample]]) -> None:
        if samples:
            self._waiting.extend(samples)
            self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-learning")

    async def stop(self) -> None:
        """Stop the loop and learn what still waits."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(BATCH_S)
            try:
                await self.flush()
            except Exception:  # a bad batch is logged and dropped; learning goes on
                log.exception("learn_batch_failed")

    async def flush(self) -> None:
        """Learn every waiting sample now: fit, export, share."""
        self._wake.clear()
        batch, self._waiting = self._waiting, []
        if not batch:
            return
        learner = self.learner
        learner.add_batch(batch)
        # a queued sample moves its worker's prefill fit
        fitted = {key if key.startswith("d:") else prefill_key(key[2:]) for key, _ in batch}
        metrics.export_learned({k: f for k in fitted if (f := learner.fits.get(k)) is not None})
        self.on_learned()
        try:
            await self.store.push(batch)
        except Unavailable as exc:  # fitted here; only the other replicas miss them
            log.debug("learn_samples_not_shared", samples=len(batch), error=str(exc))
