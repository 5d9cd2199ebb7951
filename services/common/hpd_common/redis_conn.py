"""The Redis client every service uses: bounded timeouts, retries, a health probe.

Timeouts are short on purpose: when Redis is away an RPC must answer UNAVAILABLE
well before a client's deadline, never hang (the store turns redis-py's
ConnectionError / TimeoutError into `errors.Unavailable`, or `hpd_common.rpc`
does at the edge).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hpd_common import metrics
from hpd_common.aio import cancel_and_wait
from hpd_common.logging import get_logger

log = get_logger("redis")


def connect(url: str, *, timeout_s: float = 1.0, max_connections: int = 64) -> aioredis.Redis:
    """An asyncio client; commands retry once on a dropped connection."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        max_connections=max_connections,
        decode_responses=False,
        health_check_interval=5,
    )


class RedisHealthProbe:
    """Pings Redis every `interval_s`; calls `on_change(up)` when reachability flips."""

    def __init__(
        self,
        client: aioredis.Redis,
        service: str,
        on_change: Callable[[bool], Awaitable[None]],
        interval_s: float = 0.5,
    ) -> None:
        self._client = client
        self._service = service
        self._on_change = on_change
        self._interval_s = interval_s
        self.up: bool | None = None
        self._task: asyncio.Task[None] | None = None

    async def check_once(self) -> bool:
        try:
            async with asyncio.timeout(max(self._interval_s, 0.5)):
                await self._client.ping()
            up = True
        except (RedisError, OSError, TimeoutError):
            up = False
        if up != self.up:
            self.up = up
            metrics.REDIS_UP.labels(service=self._service).set(1 if up else 0)
            log.info("redis_reachability_changed", service=self._service, up=up)
            await self._on_change(up)
        return up

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"redis-probe-{self._service}")

    async def _run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self._interval_s)

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait([self._task], timeout_s=2)
