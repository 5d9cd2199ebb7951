"""The Redis client every service uses: bounded timeouts, retries, a health probe,
Sentinel failover and acknowledged replication.

Timeouts are short on purpose: when Redis is away an RPC must answer UNAVAILABLE
well before a client's deadline, never hang (the store turns redis-py's
ConnectionError / TimeoutError into `errors.Unavailable`, or `hpd_common.rpc`
does at the edge).

URLs (`redis_url` of every service, `hpd up --redis-url`):

- ``redis://[[user]:password@]host:port/db`` (``rediss://`` for TLS): one server;
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``
  (``rediss+sentinel://``): the primary of Sentinel service ``service``, found by asking
  the listed sentinels (redis-py's Sentinel client). A connection that breaks or finds a
  demoted primary asks the sentinels again, so a failover costs the calls in flight an
  UNAVAILABLE (retryable) and nothing else. The password is the data nodes'; sentinels are
  asked without one.

Either takes ``?wait_replicas=N&wait_timeout_ms=T`` (default N=0: not used; T=250, and
under 80% of the client's 1 s socket timeout). Then every script call (every state change
of every service is one script) is followed, on the same connection and in the same round
trip, by ``WAIT N T``: the call returns only once N replicas hold the write, so a write
that was acknowledged survives the primary's death and a failover to a replica.

When fewer than N acknowledge in T ms and fewer than N are connected at all (a primary
that lost its replica, or a new primary whose old one has not rejoined), the write is
acknowledged unreplicated (asynchronous replication, as Redis itself runs), and so is
every write after it, without a ``WAIT``, until a replica is back (the replica count is
read once a second): each is counted in ``hpd_redis_unreplicated_writes_total``, and
logged at most every 5 s. When N are connected but lag, the call fails UNAVAILABLE
although the write exists on the primary: a retry finds it (plans and sessions replay by
request id, heartbeats and outcomes repeat harmlessly; a registration retried without the
credential it never received meets ALREADY_EXISTS until that lease lapses).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit, urlunsplit

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
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
from hpd_common.errors import InvalidArgument, ResourceExhausted
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
                        pool = getattr(self, "connection_pool", None)
                        if kind is ReadOnlyError and getattr(pool, "is_master", False):
                            # a Sentinel-managed connection still on a demoted primary:
                            # drop it, so the next call asks the sentinels (as redis-py
                            # does for a plain READONLY reply)
                            await self.disconnect()  # type: ignore[attr-defined]
                            raise RedisConnectionError("the primary was demoted") from None
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


class NotReplicated(RedisConnectionError):  # type: ignore[misc]
    """Fewer replicas than asked for held a write within the wait bound while enough were
    connected: the caller's RPC answers UNAVAILABLE (in `STORE_DOWN` as a ConnectionError)."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed `redis_url`: what `connect` dials and how writes are acknowledged."""

    url: str  # the single-server URL without our query parameters ("" for Sentinel)
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    wait_replicas: int = 0
    wait_timeout_ms: int = 250


_OURS = ("wait_replicas", "wait_timeout_ms")


def parse_url(url: str) -> RedisTarget:
    """`url` as a `RedisTarget`; InvalidArgument naming ``redis_url`` when it is not one
    (see the module docstring for the forms)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query, keep_blank_values=True)
    wait: dict[str, int] = {}
    for name in _OURS:
        if name in query:
            try:
                wait[name] = int(query.pop(name)[-1])
            except ValueError:
                raise InvalidArgument("redis_url", f"{name} must be an integer") from None
            if wait[name] < 0:
                raise InvalidArgument("redis_url", f"{name} must be >= 0")
    replicas, wait_ms = wait.get("wait_replicas", 0), wait.get("wait_timeout_ms", 250)
    rest = urlencode(query, doseq=True)
    if parts.scheme in ("redis", "rediss", "unix"):
        plain = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment))
        return RedisTarget(url=plain, wait_replicas=replicas, wait_timeout_ms=wait_ms)
    if parts.scheme not in ("redis+sentinel", "rediss+sentinel"):
        raise InvalidArgument(
            "redis_url", f"scheme {parts.scheme!r}: use redis://, rediss:// or redis+sentinel://"
        )
    creds, _, hosts = parts.netloc.rpartition("@")
    user, _, password = creds.partition(":")
    sentinels: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument("redis_url", f"sentinel {item!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise InvalidArgument("redis_url", "a Sentinel URL ends in /<service>[/<db>]")
    if rest:
        raise InvalidArgument("redis_url", f"unknown Sentinel URL parameter(s): {rest}")
    return RedisTarget(
        url="",
        sentinels=tuple(sentinels),
        service=unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) or None,
        ssl=parts.scheme.startswith("rediss"),
        wait_replicas=replicas,
        wait_timeout_ms=wait_ms,
    )


@dataclass(slots=True)
class RedisState:
    """What the services of one process know of one Redis (one per Redis URL, shared by
    `hpd up`'s registry, scheduler and broker): its memory and whether writes currently go
    without ``WAIT``. Health probes refresh it about once a second, whichever gets there
    first (one ``INFO`` per second per process, not per service).

    ``degraded_until`` is 0 while enough replicas are connected, else when to read the
    replica count again: after a failover only the first write waits out a ``WAIT`` that
    cannot succeed."""

    used_memory: int = 0  # bytes, at the last read (INFO memory)
    maxmemory: int = 0  # 0: Redis has no limit
    degraded_until: float = 0.0
    read_at: float = -1e9

    def memory_ratio(self) -> float:
        """used_memory / maxmemory at the last read (0.0 when Redis has no limit)."""
        return self.used_memory / self.maxmemory if self.maxmemory > 0 else 0.0


_STATES: dict[str, RedisState] = {}


class HpdRedis(aioredis.Redis):  # type: ignore[misc]
    """redis-py's asyncio client whose script calls wait for replicas (``wait_replicas``)."""

    wait_replicas: int = 0
    wait_timeout_ms: int = 250
    state: RedisState  # shared by this process's clients of the same Redis URL

    def evalsha(self, sha: Any, numkeys: int, *keys_and_args: Any) -> Any:
        if self.wait_replicas <= 0:
            return super().evalsha(sha, numkeys, *keys_and_args)
        if self.state.degraded_until:
            return self._evalsha_degraded(sha, numkeys, keys_and_args)
        return self._evalsha_acked(sha, numkeys, keys_and_args)

    async def _connected_replicas(self) -> int:
        return int((await self.info("replication")).get("connected_slaves", 0))

    async def _evalsha_acked(self, sha: Any, numkeys: int, keys_and_args: tuple[Any, ...]) -> Any:
        async with self.pipeline(transaction=False) as pipe:
            pipe.execute_command("EVALSHA", sha, numkeys, *keys_and_args)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            result, acked = await pipe.execute()
        if int(acked) >= self.wait_replicas:
            return result
        connected = await self._connected_replicas()
        if connected >= self.wait_replicas:
            raise NotReplicated(
                f"{acked} of {self.wait_replicas} replica(s) held the write within "
                f"{self.wait_timeout_ms} ms"
            )
        self.state.degraded_until = time.monotonic() + 1.0
        self._count_unreplicated(connected)
        return result

    async def _evalsha_degraded(
        self, sha: Any, numkeys: int, keys_and_args: tuple[Any, ...]
    ) -> Any:
        """Too few replicas connected: no WAIT (it could only time out); once a second the
        replica count is read again (one INFO, not a WAIT's timeout) and WAIT resumes."""
        state = self.state
        now = time.monotonic()
        if now >= state.degraded_until:
            state.degraded_until = now + 1.0  # first, so concurrent calls do not all ask
            connected = await self._connected_replicas()
            if connected >= self.wait_replicas:
                state.degraded_until = 0.0
                log.info("redis_replicas_back", connected_replicas=connected)
                return await self._evalsha_acked(sha, numkeys, keys_and_args)
        result = await super().evalsha(sha, numkeys, *keys_and_args)
        self._count_unreplicated(-1)
        return result

    def _count_unreplicated(self, connected: int) -> None:
        """Counts one write acknowledged unreplicated; logs at most one line per 5 s for
        the whole process, however many clients."""
        global _unreplicated_since_log, _unreplicated_logged_at
        metrics.REDIS_UNREPLICATED.inc()
        _unreplicated_since_log += 1
        now = time.monotonic()
        if now - _unreplicated_logged_at >= 5.0:
            log.warning(
                "redis_write_unreplicated",
                connected_replicas=connected if connected >= 0 else "unknown",
                wait_replicas=self.wait_replicas,
                writes=_unreplicated_since_log,
            )
            _unreplicated_since_log, _unreplicated_logged_at = 0, now


_unreplicated_since_log = 0
_unreplicated_logged_at = -1e9


def connect(url: str, *, timeout_s: float = 1.0, max_connections: int = 64) -> HpdRedis:
    """An asyncio client for ``url`` (a server or a Sentinel service, see the module
    docstring); commands retry once on a dropped connection."""
    target = parse_url(url)
    if target.wait_replicas and target.wait_timeout_ms >= timeout_s * 1000 * 0.8:
        raise InvalidArgument(
            "redis_url",
            f"wait_timeout_ms must stay under the client's {timeout_s * 1000 * 0.8:.0f} ms "
            "(80% of its socket timeout): a WAIT that outlasts it reads as Redis down",
        )
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "max_connections": max_connections,
        "decode_responses": False,
        "health_check_interval": 5,
    }
    client: HpdRedis
    if target.sentinels:
        sentinel = Sentinel(
            list(target.sentinels),
            sentinel_kwargs={"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s},
        )
        client = sentinel.master_for(
            target.service,
            redis_class=HpdRedis,
            db=target.db,
            username=target.username,
            password=target.password,
            ssl=target.ssl,
            **options,
        )
    else:
        client = HpdRedis.from_url(target.url, **options)
    client.wait_replicas = target.wait_replicas
    client.wait_timeout_ms = target.wait_timeout_ms
    client.state = _STATES.setdefault(url, RedisState())
    with_c_packer(client)
    return client


def refuse_when_full(client: Any, limit_ratio: float, what: str) -> None:
    """ResourceExhausted (RESOURCE_EXHAUSTED, retry in a second) when Redis's memory is at
    or past ``limit_ratio`` of its ``maxmemory`` at the last probe: new ``what`` are refused
    while Redis itself still takes every write, so heartbeats, outcomes and session progress
    (which free or merely update state) go on and the store drains by its TTLs. Redis
    without a limit, or ``limit_ratio`` 0, refuses nothing."""
    ratio = client.state.memory_ratio() if isinstance(client, HpdRedis) else 0.0
    if limit_ratio > 0 and ratio >= limit_ratio:
        raise ResourceExhausted(
            f"state store memory at {ratio:.0%} of maxmemory (limit {limit_ratio:.0%}): new "
            f"{what} refused until it drains; raise Redis's maxmemory or shorten record TTLs",
            retry_after_ms=1000,
        )


class RedisHealthProbe:
    """Pings Redis every `interval_s`; calls `on_change(up)` when reachability flips.
    About once a second it also refreshes the client's `RedisState` (Redis's memory and,
    with ``wait_replicas``, its connected replica count) unless another probe of this
    process just did, and sets the gauge `hpd_redis_memory_used_ratio` from it."""

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
                await self._read_state()
            up = True
        except (RedisError, OSError, TimeoutError):
            up = False
        if up != self.up:
            self.up = up
            metrics.REDIS_UP.labels(service=self._service).set(1 if up else 0)
            log.info("redis_reachability_changed", service=self._service, up=up)
            await self._on_change(up)
        return up

    async def _read_state(self) -> None:
        client = self._client
        if not isinstance(client, HpdRedis):
            return
        state = client.state
        now = time.monotonic()
        if now - state.read_at >= 1.0:
            state.read_at = now
            info = await client.info("memory")
            state.used_memory = int(info.get("used_memory", 0))
            state.maxmemory = int(info.get("maxmemory", 0))
            if client.wait_replicas > 0:
                # notice a primary without replicas before a write waits out a WAIT for it
                short = await client._connected_replicas() < client.wait_replicas
                if short and not state.degraded_until:
                    state.degraded_until = time.monotonic() + 1.0
                elif not short and state.degraded_until:
                    state.degraded_until = 0.0
        metrics.REDIS_MEMORY_RATIO.labels(service=self._service).set(state.memory_ratio())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"redis-probe-{self._service}")

    async def _run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self._interval_s)

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait([self._task], timeout_s=2)
