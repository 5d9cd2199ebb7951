"""Outcomes are learned in batches off the report's path (``hpd_scheduler.learning_queue``):
a batch waits at most ``BATCH_S``, each worker's fit is redone once for it, the batch is
shared with the other replicas in one pipeline, and stopping learns what still waits."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import redis.asyncio as aioredis

from hpd_scheduler.keys import SchedulerKeys
from hpd_scheduler.learn_store import LearnStore
from hpd_scheduler.learning_queue import BATCH_S, LearningQueue
from hpd_scheduler.policy.learner import SpeedLearner
from hpd_scheduler.policy.learning import MIN_SAMPLES, Sample, prefill_key


def _samples(n: int, seed: int = 3) -> list[tuple[str, Sample]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x = rng.uniform(0.1, 3.0)
        out.append((prefill_key("w0"), Sample(x, 0.0, (40 * x + 80) * rng.gauss(1, 0.03), 7)))
    return out


async def test_a_batch_is_learned_shared_and_announced_once(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    learner = SpeedLearner()
    store = LearnStore(redis_client, SchedulerKeys(key_prefix))
    announced: list[int] = []
    queue = LearningQueue(learner, store, lambda: announced.append(1))
    queue.start()
    try:
        queue.add(_samples(MIN_SAMPLES + 4))
        assert learner.prefill("w0") is None  # not on the caller's path
        for _ in range(100):
            if learner.prefill("w0") is not None:
                break
            await asyncio.sleep(BATCH_S / 5)
        got = learner.prefill("w0")
        assert got is not None and got.samples == MIN_SAMPLES + 4
        assert announced == [1]  # one batch, one rebuild of the fleet view
        # shared: another replica reads every sample of the batch
        other = await LearnStore(redis_client, SchedulerKeys(key_prefix)).read_if_changed()
        assert other is not None and len(other[prefill_key("w0")]) == MIN_SAMPLES + 4
    finally:
        await queue.stop()


async def test_stopping_learns_what_still_waits(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    learner = SpeedLearner()
    queue = LearningQueue(
        learner, LearnStore(redis_client, SchedulerKeys(key_prefix)), lambda: None
    )
    queue.start()
    queue.add(_samples(MIN_SAMPLES + 2, seed=4))
    await queue.stop()  # before the batch's wait is over
    got = learner.prefill("w0")
    assert got is not None and got.samples == MIN_SAMPLES + 2


async def test_a_batch_that_fails_is_logged_and_learning_goes_on(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    """A batch whose learning raises (a bug, a sample the fit cannot take) must not end the
    loop: the next batch is learned."""

    class Flaky(SpeedLearner):
        fail = True

        def add_batch(self, batch: Any) -> None:
            if self.fail:
                self.fail = False
                raise ValueError("a bad batch")
            super().add_batch(batch)

    learner = Flaky()
    store = LearnStore(redis_client, SchedulerKeys(key_prefix))
    queue = LearningQueue(learner, store, lambda: None)
    queue.start()
    try:
        queue.add(_samples(2))
        for _ in range(100):
            if not learner.fail and not queue._waiting:
                break
            await asyncio.sleep(BATCH_S / 5)
        queue.add(_samples(MIN_SAMPLES + 2, seed=6))
        for _ in range(100):
            if learner.prefill("w0") is not None:
                break
            await asyncio.sleep(BATCH_S / 5)
        assert learner.prefill("w0") is not None
    finally:
        await queue.stop()
