"""Every service's periodic loop outlives a round that fails with an unexpected error.

Store outages arrive as `Unavailable` and each loop handles them; anything else (a bug, a
Redis reply nobody expected) used to end the task silently, and with it the sweeping,
mirroring or directive sending for the life of the process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis.asyncio as aioredis

from hpd_common.clock import SystemClock
from hpd_kvbroker.service import KvBrokerService
from hpd_kvbroker.settings import KvBrokerSettings
from hpd_registry.service import RegistryService
from hpd_registry.settings import RegistrySettings
from hpd_scheduler.service import SchedulerService
from hpd_scheduler.settings import SchedulerSettings


class Flaky:
    """An async callable whose first call raises a RuntimeError; it counts every call."""

    def __init__(self, result: Any = None) -> None:
        self.calls = 0
        self.result = result

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("an unexpected failure")
        return self.result


def kvbroker_sweeper(client: aioredis.Redis, flaky: Flaky) -> Coroutine[Any, Any, None]:
    svc = KvBrokerService(KvBrokerSettings(sweep_interval_ms=10), client, SystemClock())
    svc.sweep_once = flaky  # type: ignore[method-assign]
    return svc._sweeper()


def registry_sweeper(client: aioredis.Redis, flaky: Flaky) -> Coroutine[Any, Any, None]:
    svc = RegistryService(RegistrySettings(sweep_interval_ms=10), client, SystemClock())
    flaky.result = ([], [])
    svc.store.sweep = flaky  # type: ignore[method-assign]
    return svc._sweeper()


def _scheduler(client: aioredis.Redis, **settings: Any) -> SchedulerService:
    return SchedulerService(SchedulerSettings(**settings), client, SystemClock())


def scheduler_sync(client: aioredis.Redis, flaky: Flaky) -> Coroutine[Any, Any, None]:
    svc = _scheduler(client, reservation_sync_interval_ms=10)
    svc.sync_reservations = flaky  # type: ignore[method-assign]
    return svc._sync_loop()


def scheduler_directives(client: aioredis.Redis, flaky: Flaky) -> Coroutine[Any, Any, None]:
    svc = _scheduler(client, directive_interval_ms=10)
    svc.ready = lambda: True  # type: ignore[method-assign]
    flaky.result = 0
    svc.send_directives = flaky  # type: ignore[method-assign]
    return svc._directive_loop()


def scheduler_explanations(client: aioredis.Redis, flaky: Flaky) -> Coroutine[Any, Any, None]:
    svc = _scheduler(client)

    writer = svc.explanations

    async def flush(idle_only: bool = False) -> None:
        writer._wake.set()  # more to write: the loop comes round again
        await flaky()

    writer.flush = flush  # type: ignore[method-assign]
    writer._wake.set()
    return writer.run()


@pytest.mark.parametrize(
    "loop",
    [
        kvbroker_sweeper,
        registry_sweeper,
        scheduler_sync,
        scheduler_directives,
        scheduler_explanations,
    ],
)
async def test_a_failed_round_does_not_end_the_loop(
    loop: Callable[[aioredis.Redis, Flaky], Coroutine[Any, Any, None]],
) -> None:
    client = aioredis.Redis(port=1)  # never reached: every store call is replaced
    flaky = Flaky()
    task = asyncio.create_task(loop(client, flaky))
    try:
        deadline = asyncio.get_running_loop().time() + 5
        while flaky.calls < 3:
            assert not task.done(), f"the loop ended: {task.exception()!r}"
            assert asyncio.get_running_loop().time() < deadline, "the loop stalled"
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
