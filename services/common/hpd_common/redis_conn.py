"""The Redis client every service uses: bounded timeouts, retries, a health probe.

Timeouts are short on purpose: when Redis is away an RPC must answer UNAVAILABLE
well before a client's deadline, never hang (the store turns redis-py's
ConnectionError / TimeoutError into `errors.Unavailable`, or `hpd_common.rpc`
does at the edge).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    DataError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from hpd_common import metrics
from hpd_common.aio import cancel_and_wait
from hpd_common.logging import get_logger

log = get_logger("redis")

STORE_DOWN: tuple[type[Exception], ...] = (
    RedisConnectionError,  # unreachable, refused, still loading its data, or no credentials
    RedisTimeoutError,
    OSError,
    ReadOnlyError,  # a replica (after a failover): writes refused until pointed at a primary
    OutOfMemoryError,  # maxmemory reached: writes refused until memory is freed
    MasterDownError,  # a replica that lost its primary
)
"""What a store turns into `errors.Unavailable`: Redis cannot serve this now, and a retry
later may succeed. Anything else from Redis is a bug (a script error, a wrong type)."""


class _CPackedCommands:
    """Packs commands with hiredis's C packer instead of redis-py's asyncio pure-Python one.

    redis-py's asyncio connection encodes each argument in Python (about 2 us apiece
    here); a Lua call with a dozen arguments, or a registry heartbeat batch with seven per
    report, spends more on that than Redis spends running the script. The bytes on the
    wire are the same (a test compares the two packers); what cannot be packed raises
    redis-py's `DataError`, as before.
    """

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str):
            args = tuple(args[0].encode().split()) + args[1:]
        elif b" " in args[0]:
            args = tuple(args[0].split()) + args[1:]
        try:
            return [hiredis.pack_command(args)]
        except TypeError as exc:
            raise DataError(str(exc)) from exc


_REFUSALS = (
    ("-OOM ", OutOfMemoryError),
    ("-READONLY ", ReadOnlyError),
    ("-MASTERDOWN ", MasterDownError),
)


class _ScriptRefusals:
    """Raises a script's refused write as the refusal it is.

    A script without flags starts even when Redis is out of memory (or a read-only replica);
    its first write then fails, and Redis wraps that reply in a script error ("Error running
    script ...: -OOM command not allowed ..."), which redis-py raises as a plain
    ResponseError: a bug, to every caller. Whether the refusal comes before the script or
    from inside it depends on Redis's state at that moment, so the two must read the same.
    """

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except ResponseError as exc:
            if type(exc) is ResponseError:
                message = str(exc)
                for marker, kind in _REFUSALS:
                    if marker in message:
                        raise kind(message) from None
            raise


_PACKED: dict[type, type] = {}


def with_c_packer(client: aioredis.Redis) -> aioredis.Redis:
    """`client`, its pool now making connections that pack commands in C (and raise a
    script's refused write as that refusal: `_ScriptRefusals`)."""
    pool = client.connection_pool
    base = pool.connection_class
    if not issubclass(base, _CPackedCommands):
        cls = _PACKED.get(base)
        if cls is None:
            bases = (_CPackedCommands, _ScriptRefusals, base)
            cls = _PACKED[base] = type(f"CPacked{base.__name__}", bases, {})
        pool.connection_class = cls
    return client


def connect(url: str, *, timeout_s: float = 1.0, max_connections: int = 64) -> aioredis.Redis:
    """An asyncio client; commands retry once on a dropped connection."""
    return with_c_packer(
        aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            max_connections=max_connections,
            decode_responses=False,
            health_check_interval=5,
        )
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
