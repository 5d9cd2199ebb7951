"""Registry use cases: async, owns the store, the clock and the background loops.

Background loops (one set per replica, all safe to run on several replicas):
- the heartbeat batcher: load reports from every stream and unary heartbeat are
  written in one Lua call per batch (a batch forms while the previous one is in
  flight, so there is no added delay under light load);
- the feed tailer: one blocking XREAD per replica fans the change feed out to every
  WatchWorkers stream, and sends bookmarks when the feed is idle;
- the sweeper: expires leases and flags SUSPECT workers (atomically, so exactly once);
- the directive listener: wakes a worker's stream when a directive is queued for it on
  any replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis

from hpd_common.aio import cancel_and_wait
from hpd_common.clock import Clock
from hpd_common.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from hpd_common.gpus import GPU_ALIASES, GPU_PROFILES
from hpd_common.logging import get_logger
from hpd_common.server import ServerSettings
from hpd_registry.domain import (
    Directive,
    DirectiveKind,
    Health,
    LoadReport,
    PoolSummary,
    WorkerFilter,
    WorkerRecord,
    WorkerSpec,
    check_id,
    flag_health,
    heartbeat_interval_of,
    stamp_load,
    summarize_pools,
    validate_directive,
    validate_load,
    validate_spec,
)
from hpd_registry.keys import RegistryKeys
from hpd_registry.store import (
    FeedEntry,
    HeartbeatItem,
    HeartbeatResult,
    RegistryStore,
    credential_hash,
)

log = get_logger("registry")


@dataclass(frozen=True, slots=True)
class RegistrySettings(ServerSettings):
    port: int = field(default=50051, metadata={"help": "gRPC port of the registry"})
    key_prefix: str = field(default="hpd", metadata={"help": "prefix of every Redis key"})
    lease_ttl_ms: int = field(default=10_000, metadata={"help": "default worker lease"})
    min_lease_ttl_ms: int = field(default=300, metadata={"help": "shortest lease a worker may ask"})
    max_lease_ttl_ms: int = field(
        default=300_000, metadata={"help": "longest lease a worker may ask"}
    )
    sweep_interval_ms: int = field(default=1_000, metadata={"help": "how often leases are checked"})
    load_stale_ms: int = field(
        default=30_000, metadata={"help": "a load report older than this makes a worker SUSPECT"}
    )
    feed_max_len: int = field(default=100_000, metadata={"help": "change-feed entries kept"})
    kv_feed_max_len: int = field(
        default=200_000,
        metadata={"help": "KV cache event batches kept for scheduler replicas to replay"},
    )
    bookmark_interval_ms: int = field(
        default=1_000, metadata={"help": "idle watch streams get a bookmark this often"}
    )
    watch_queue_max: int = field(
        default=20_000, metadata={"help": "events buffered per watcher before it must resync"}
    )


class WatchType:
    SNAPSHOT = "snapshot"
    SNAPSHOT_END = "snapshot_end"
    PUT = "put"
    LOAD = "load"
    DELETE = "delete"
    RESYNC = "resync"
    BOOKMARK = "bookmark"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str
    revision: int
    worker_id: str = ""
    record: WorkerRecord | None = None
    load: LoadReport | None = None
    last_heartbeat_ms: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HeartbeatInput:
    worker_id: str
    credential: str
    load: LoadReport | None
    health: str  # '', 'ok', 'bad'
    reason: str = ""


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    lease_expires_at_ms: int


@dataclass(frozen=True, slots=True)
class Registration:
    worker_id: str
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    credential: str
    revision: int
    changed: bool


@dataclass(frozen=True, slots=True)
class HeartbeatOutcome:
    lease: LeaseInfo
    directives: list[Directive]
    health: Health


_WAKE = object()
_END = object()
_OVERFLOW = object()


class _Subscriber:
    __slots__ = ("ended", "overflowed", "queue")

    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=maxsize)
        self.overflowed = False
        self.ended = False

    def end(self, error: Exception) -> None:
        """Ends the watch with `error` whatever is queued (nothing queued is sent)."""
        self.ended = True
        self._replace_all(error)

    def offer(self, item: Any) -> None:
        if self.overflowed or self.ended:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.overflowed = True
            self._replace_all(_OVERFLOW)

    def _replace_all(self, item: Any) -> None:
        """Drops everything queued; `item` is all that is left."""
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:
                self.queue.get_nowait()
        self.queue.put_nowait(item)


def _stopping() -> Unavailable:
    """What a stream of a stopping registry ends with (one per stream: raised once each)."""
    return Unavailable("registry stopping: reconnect (to another replica)")


def _entry_event(e: FeedEntry) -> WatchEvent:
    if e.kind == "put":
        return WatchEvent(WatchType.PUT, e.revision, e.worker_id, record=e.record)
    if e.kind == "load":
        return WatchEvent(
            WatchType.LOAD,
            e.revision,
            e.worker_id,
            load=e.load,
            last_heartbeat_ms=e.last_heartbeat_ms,
        )
    return WatchEvent(WatchType.DELETE, e.revision, e.worker_id, reason=e.reason)


class RegistryService:
    """The registry's use cases; the gRPC servicer is a thin layer over this."""

    def __init__(
        self, settings: RegistrySettings, client: aioredis.Redis, clock: Clock, max_batch: int = 512
    ) -> None:
        self.settings = settings
        self.client = client
        self.clock = clock
        self.store = RegistryStore(client, RegistryKeys(settings.key_prefix), settings.feed_max_len)
        self._max_batch = max_batch
        self._pending: list[tuple[HeartbeatItem, asyncio.Future[HeartbeatResult]]] = []
        self._wake_batcher = asyncio.Event()
        self._subscribers: set[_Subscriber] = set()
        self._subscriber_epoch = 0
        self._subscribed = asyncio.Event()  # wakes an idle feed tailer
        self._draining = False  # the server is stopping: streams end (`drain`)
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._grace: tuple[int, int] = (0, 0)  # post-outage lease grace (from, until), ms
        self._tasks: list[asyncio.Task[None]] = []
        self._tail_client: aioredis.Redis | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._tail_client = self.client.__class__(connection_pool=self._make_tail_pool())
        self._tasks = [
            asyncio.create_task(self._batcher(), name="registry-batcher"),
            asyncio.create_task(self._tail_feed(), name="registry-feed"),
            asyncio.create_task(self._sweeper(), name="registry-sweeper"),
            asyncio.create_task(self._directive_listener(), name="registry-directives"),
        ]

    def _make_tail_pool(self) -> aioredis.ConnectionPool:
        kwargs = dict(self.client.connection_pool.connection_kwargs)
        kwargs["socket_timeout"] = max(2.0, (kwargs.get("socket_timeout") or 1.0) * 2)
        return aioredis.ConnectionPool(
            connection_class=self.client.connection_pool.connection_class,
            max_connections=4,
            **kwargs,
        )

    def drain(self) -> None:
        """Ends every open heartbeat and watch stream with UNAVAILABLE (the server is
        stopping): their clients reconnect to another replica at once, and the shutdown
        grace is not spent waiting for streams that never end by themselves."""
        self._draining = True  # and streams that register from now on end at once
        for q in list(self._streams.values()):
            q.put_nowait(_stopping())
        for sub in list(self._subscribers):
            sub.end(_stopping())

    async def stop(self) -> None:
        # bounded: a task stuck on a dead connection must not block shutdown
        await cancel_and_wait(self._tasks, timeout_s=3)
        for q in list(self._streams.values()):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(_END)
        if self._tail_client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await self._tail_client.aclose()

    def _interval_for(self, ttl_ms: int) -> int:
        """Workers heartbeat every third of their lease (the SUSPECT rule counts two)."""
        return max(1, ttl_ms // 3)

    def _ttl(self, requested_ms: int) -> int:
        s = self.settings
        if requested_ms == 0:
            return s.lease_ttl_ms
        return max(s.min_lease_ttl_ms, min(s.max_lease_ttl_ms, requested_ms))

    # -- registration -----------------------------------------------------------------------

    async def register(self, spec: WorkerSpec, credential: str, ttl_ms: int) -> Registration:
        known = spec.gpu_type.upper() in GPU_PROFILES or spec.gpu_type.upper() in GPU_ALIASES
        validate_spec(spec, known_gpu=known or spec.gpu_type in GPU_PROFILES)
        if len(credential) > 256:
            raise InvalidArgument("credential", "longer than 256 characters")
        ttl = self._ttl(ttl_ms)
        new_credential = secrets.token_urlsafe(32)
        status, rev = await self.store.register(
            spec,
            credential_hash(credential),
            credential_hash(new_credential),
            ttl,
            self.clock.now_ms(),
        )
        if status == "exists":
            raise AlreadyExists(
                f"worker {spec.worker_id!r} is registered and live; present its credential "
                "to re-register, or wait for its lease to expire"
            )
        issued = new_credential if status == "created" else credential
        log.info(
            "worker_registered",
            worker_id=spec.worker_id,
            pool_id=spec.pool_id,
            outcome=status,
            revision=rev,
        )
        return Registration(
            spec.worker_id, ttl, self._interval_for(ttl), issued, rev, status != "same"
        )

    async def deregister(self, worker_id: str, credential: str, forced: bool = False) -> int:
        """Removes the worker; ``forced`` (an operator's call) needs no credential."""
        check_id("worker_id", worker_id)
        status, rev = await self.store.deregister(
            worker_id, "*" if forced else credential_hash(credential), self.clock.now_ms()
        )
        if status == "gone":
            raise NotFound("worker", worker_id)
        if status == "denied":
            raise PermissionDenied(f"credential does not match worker {worker_id!r}")
        log.info("worker_deregistered", worker_id=worker_id, revision=rev)
        return rev

    # -- heartbeats -------------------------------------------------------------------------

    def _check_heartbeat(self, hb: HeartbeatInput, path: str) -> HeartbeatInput:
        if hb.health == "bad" and not hb.reason:
            raise InvalidArgument(f"{path}health_reason", "required when reporting UNHEALTHY")
        if len(hb.reason) > 512:
            raise InvalidArgument(f"{path}health_reason", "longer than 512 characters")
        if hb.load is None:
            return hb
        now = self.clock.now_ms()
        validate_load(f"{path}load", hb.load, now)
        stamped = stamp_load(hb.load, now)
        return hb if stamped is hb.load else replace(hb, load=stamped)

    async def _submit(self, item: HeartbeatItem) -> HeartbeatResult:
        fut: asyncio.Future[HeartbeatResult] = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        self._wake_batcher.set()
        return await fut

    async def _batcher(self) -> None:
        while True:
            await self._wake_batcher.wait()
            self._wake_batcher.clear()
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                try:
                    results = await self.store.heartbeats(
                        [i for i, _ in batch], self.clock.now_ms()
                    )
                except Exception as exc:  # handed to every waiter, which translates it
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), res in zip(batch, results, strict=True):
                    if not fut.done():
                        fut.set_result(res)

    def _health_of(self, res: HeartbeatResult) -> Health:
        # a heartbeat that was just accepted clears SUSPECT
        return flag_health(
            unhealthy=res.unhealthy, suspect=False, draining=res.draining, cordoned=res.cordoned
        )

    def _raise_for(self, res: HeartbeatResult, worker_id: str) -> None:
        if res.status == "gone":
            raise NotFound("worker", worker_id)
        if res.status == "denied":
            raise PermissionDenied(f"credential does not match worker {worker_id!r}")

    async def heartbeat(self, hb: HeartbeatInput) -> HeartbeatOutcome:
        """Renews the lease for the TTL the worker registered with, and stores its load."""
        check_id("worker_id", hb.worker_id)
        if not hb.credential:
            raise InvalidArgument("credential", "is required")
        hb = self._check_heartbeat(hb, "")
        res = await self._submit(
            HeartbeatItem(
                hb.worker_id, credential_hash(hb.credential), 0, hb.load, hb.health, hb.reason
            )
        )
        self._raise_for(res, hb.worker_id)
        ttl = res.lease_ttl_ms
        directives = await self.store.pop_directives(hb.worker_id) if res.pending_directives else []
        return HeartbeatOutcome(
            LeaseInfo(ttl, self._interval_for(ttl), res.lease_expires_at_ms),
            directives,
            self._health_of(res),
        )

    async def heartbeat_stream(
        self, first: HeartbeatInput, rest: AsyncIterator[HeartbeatInput]
    ) -> AsyncIterator[LeaseInfo | Directive]:
        """Authenticates on the first message, then: acks and directives out, reports in."""
        outcome = await self.heartbeat(first)
        worker_id = first.worker_id
        yield outcome.lease
        for d in outcome.directives:
            yield d
        queue: asyncio.Queue[Any] = asyncio.Queue()
        previous = self._streams.get(worker_id)
        if previous is not None:
            previous.put_nowait(_END)
        self._streams[worker_id] = queue
        if self._draining:
            queue.put_nowait(_stopping())
        ttl = outcome.lease.lease_ttl_ms
        reader = asyncio.create_task(self._read_reports(worker_id, ttl, rest, queue))
        log.info("heartbeat_stream_opened", worker_id=worker_id)
        try:
            queue.put_nowait(_WAKE)  # anything queued before the stream existed
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if item is _WAKE:
                    directives = await self.store.pop_directives(worker_id)
                    for i, d in enumerate(directives):
                        try:
                            yield d
                        except BaseException:
                            await self.store.requeue_directives(worker_id, directives[i:])
                            raise
                else:
                    yield item
        finally:
            await cancel_and_wait([reader], timeout_s=2)
            if self._streams.get(worker_id) is queue:
                del self._streams[worker_id]
            log.info("heartbeat_stream_closed", worker_id=worker_id)

    async def _read_reports(
        self, worker_id: str, ttl: int, rest: AsyncIterator[HeartbeatInput], out: asyncio.Queue[Any]
    ) -> None:
        interval_s = self._interval_for(ttl) / 1000
        last_ack = self.clock.monotonic()
        try:
            async for hb in rest:
                if hb.worker_id and hb.worker_id != worker_id:
                    raise InvalidArgument("worker_id", "differs from the stream's first message")
                hb = self._check_heartbeat(hb, "")
                res = await self._submit(
                    HeartbeatItem(worker_id, "", 0, hb.load, hb.health, hb.reason)
                )
                self._raise_for(res, worker_id)
                if res.pending_directives:
                    out.put_nowait(_WAKE)
                now = self.clock.monotonic()
                if now - last_ack >= interval_s:
                    last_ack = now
                    ttl = res.lease_ttl_ms
                    interval_s = self._interval_for(ttl) / 1000
                    out.put_nowait(LeaseInfo(ttl, self._interval_for(ttl), res.lease_expires_at_ms))
            out.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            out.put_nowait(exc)

    # -- operator actions -------------------------------------------------------------------

    async def report_kv_events(
        self, worker_id: str, credential: str, block_tokens: int, events: list[list[Any]]
    ) -> int:
        """Appends one worker's batch of prefix-cache events to the KV event feed
        (``keys.py``); returns how many. NOT_FOUND, PERMISSION_DENIED as a heartbeat."""
        check_id("worker_id", worker_id)
        if not credential:
            raise InvalidArgument("credential", "is required")
        if len(credential) > 256:
            raise InvalidArgument("credential", "longer than 256 characters")
        payload = json.dumps(events, separators=(",", ":"))
        status = await self.store.append_kv_events(
            worker_id, credential_hash(credential), block_tokens, payload,
            self.clock.now_ms(), self.settings.kv_feed_max_len,
        )  # fmt: skip
        if status == "gone":
            raise NotFound("worker", worker_id)
        if status == "denied":
            raise PermissionDenied(f"credential does not match worker {worker_id!r}")
        return len(events)

    async def check_own(self, worker_id: str, credential: str) -> None:
        """PERMISSION_DENIED unless ``credential`` is the worker's (a worker acting on its
        own record); NOT_FOUND for an unknown worker."""
        check_id("worker_id", worker_id)
        if len(credential) > 256:
            raise InvalidArgument("credential", "longer than 256 characters")
        if await self.store.credential_matches(worker_id, credential_hash(credential)):
            return
        if await self.store.get(worker_id) is None:
            raise NotFound("worker", worker_id)
        raise PermissionDenied(f"credential does not match worker {worker_id!r}")

    async def admin(self, worker_id: str, op: str, reason: str) -> WorkerRecord:
        check_id("worker_id", worker_id)
        if len(reason) > 512:
            raise InvalidArgument("reason", "longer than 512 characters")
        status, rev = await self.store.admin(worker_id, op, reason, self.clock.now_ms())
        if status == "gone":
            raise NotFound("worker", worker_id)
        log.info(
            "worker_" + {"drain": "drained", "cordon": "cordoned"}.get(op, "uncordoned"),
            worker_id=worker_id,
            reason=reason,
            revision=rev,
        )
        if op == "drain" and status == "ok":
            await self.store.push_directive(
                worker_id,
                Directive(
                    kind=DirectiveKind.DRAIN,
                    directive_id=uuid.uuid4().hex,
                    reason=reason or "operator drain",
                    created_at_ms=self.clock.now_ms(),
                    issuer="operator",
                ),
            )
        return await self.get(worker_id)

    async def send_directive(self, worker_id: str, directive: Directive) -> tuple[str, bool]:
        check_id("worker_id", worker_id)
        validate_directive(directive)
        rec = await self.store.get(worker_id)
        if rec is None or self.lapsed(rec, self.clock.now_ms()):
            raise NotFound("worker", worker_id)
        d = replace(directive, directive_id=uuid.uuid4().hex, created_at_ms=self.clock.now_ms())
        await self.store.push_directive(worker_id, d)
        log.info(
            "directive_queued", worker_id=worker_id, kind=d.kind.value, directive_id=d.directive_id
        )
        return d.directive_id, worker_id in self._streams

    # -- reads ------------------------------------------------------------------------------

    async def get(self, worker_id: str) -> WorkerRecord:
        check_id("worker_id", worker_id)
        rec = await self.store.get(worker_id)
        if rec is None or self.lapsed(rec, self.clock.now_ms()):
            raise NotFound("worker", worker_id)
        return rec

    def health(self, rec: WorkerRecord) -> Health:
        now = self.clock.now_ms()
        if rec.state.lease_expires_at_ms < now and not self.lapsed(rec, now):
            return Health.SUSPECT  # ran out during an outage: renewable, not gone
        return rec.health(now, heartbeat_interval_of(rec.state))

    def lapsed(self, rec: WorkerRecord, now_ms: int) -> bool:
        """Whether the lease has run out, the post-outage grace counted (see the sweeper):
        a lease that ran out since the grace's start is live until its end."""
        exp = rec.state.lease_expires_at_ms
        if exp >= now_ms:
            return False
        g_from, g_until = self._grace
        return not (now_ms < g_until and exp >= g_from)

    async def list_workers(
        self, flt: WorkerFilter, page_size: int, page_token: str
    ) -> tuple[list[WorkerRecord], str, int]:
        """A page of matching workers in id order, the next page token ('' at the end)."""
        if page_size == 0:
            page_size = 100
        if not 1 <= page_size <= 1000:
            raise InvalidArgument("page_size", "must be in 1..1000")
        if page_token:
            check_id("page_token", page_token)
        revision = await self.store.revision()
        out: list[WorkerRecord] = []
        after = page_token
        now = self.clock.now_ms()
        while len(out) < page_size:
            ids = await self.store.page_ids(after, 256)
            if not ids:
                return out, "", revision
            for rec in await self.store.get_many(ids):
                if self.lapsed(rec, now):
                    continue
                if flt.matches(rec, self.health(rec)):
                    out.append(rec)
                    if len(out) == page_size:
                        break
            after = out[-1].spec.worker_id if len(out) == page_size else ids[-1]
        more = await self.store.page_ids(after, 1)
        return out, (after if more else ""), revision

    async def pools(self, model_id: str) -> tuple[list[PoolSummary], int]:
        rev, records = await self.store.snapshot()
        now = self.clock.now_ms()
        live = [
            r
            for r in records
            if not self.lapsed(r, now) and (not model_id or r.spec.model_id == model_id)
        ]
        return summarize_pools(live, now), rev

    # -- the change feed --------------------------------------------------------------------

    async def watch(
        self, from_revision: int, model_id: str = "", max_batch: int = 512
    ) -> AsyncIterator[list[WatchEvent]]:
        """Snapshot (or replay from a revision), then live changes, bookmarks when idle.

        Yields batches: whatever is ready, up to max_batch events, in revision order.
        """
        sub = _Subscriber(self.settings.watch_queue_max)
        self._subscribers.add(sub)
        self._subscriber_epoch += 1
        self._subscribed.set()
        if self._draining:
            sub.end(_stopping())
        known: set[str] = set()

        def wanted(ev: WatchEvent) -> bool:
            if not model_id or ev.type in (
                WatchType.BOOKMARK,
                WatchType.RESYNC,
                WatchType.SNAPSHOT_END,
            ):
                return True
            if ev.record is not None:
                if ev.record.spec.model_id == model_id:
                    known.add(ev.worker_id)
                    return True
                known.discard(ev.worker_id)
                return False
            if ev.type == WatchType.DELETE:
                if ev.worker_id in known:
                    known.discard(ev.worker_id)
                    return True
                return False
            return ev.worker_id in known

        try:
            last = from_revision
            if last:
                current = await self.store.revision()
                first = await self.store.first_feed_revision()
                oldest_kept = first - 1 if first is not None else current
                if last < oldest_kept or last > current:
                    yield [WatchEvent(WatchType.RESYNC, current, reason="revision_unavailable")]
                    last = 0
            while True:
                if last == 0:
                    rev, records = await self.store.snapshot()
                    now = self.clock.now_ms()
                    known.clear()
                    batch: list[WatchEvent] = []
                    for rec in records:
                        if self.lapsed(rec, now):
                            continue
                        if not model_id or rec.spec.model_id == model_id:
                            known.add(rec.spec.worker_id)
                            batch.append(
                                WatchEvent(
                                    WatchType.SNAPSHOT, rec.revision, rec.spec.worker_id, rec
                                )
                            )
                            if len(batch) == max_batch:
                                yield batch
                                batch = []
                    batch.append(WatchEvent(WatchType.SNAPSHOT_END, rev))
                    yield batch
                    last = rev
                while True:  # catch up from the feed
                    entries = await self.store.feed_after(last, max_batch)
                    batch = []
                    for e in entries:
                        last = e.revision
                        if e.kind == "skip":
                            continue
                        ev = _entry_event(e)
                        if wanted(ev):
                            batch.append(ev)
                    if batch:
                        yield batch
                    if len(entries) < max_batch:
                        break
                resync = False
                while not resync:
                    items = [await sub.queue.get()]
                    while len(items) < max_batch and not sub.queue.empty():
                        items.append(sub.queue.get_nowait())
                    batch = []
                    for item in items:
                        if isinstance(item, Unavailable):
                            raise item
                        if item is _OVERFLOW:
                            sub.overflowed = False
                            batch = [
                                WatchEvent(WatchType.RESYNC, last, reason="watcher_fell_behind")
                            ]
                            resync = True
                            break
                        ev = item
                        if ev.type == WatchType.RESYNC:
                            batch.append(ev)
                            resync = True
                            break
                        if ev.type == WatchType.BOOKMARK:
                            if not batch:  # a bookmark only says "alive" when nothing else does
                                batch.append(replace(ev, revision=max(ev.revision, last)))
                        elif ev.revision > last:
                            last = ev.revision
                            if wanted(ev):
                                batch.append(ev)
                    if resync:
                        last = 0
                    if batch:
                        yield batch
        finally:
            self._subscribers.discard(sub)

    def _fan_out(self, ev: WatchEvent) -> None:
        for sub in list(self._subscribers):
            sub.offer(ev)

    async def _tail_feed(self) -> None:
        """One blocking reader per replica feeds every watcher."""
        assert self._tail_client is not None
        last: int | None = None
        block_ms = max(50, min(self.settings.bookmark_interval_ms, 1000))
        while True:
            try:
                if last is None:
                    last = await self.store.revision()
                if not self._subscribers:  # nobody watches: follow the revision, decode nothing
                    self._subscribed.clear()
                    epoch = self._subscriber_epoch
                    current = await self.store.revision()
                    if not self._subscribers and epoch == self._subscriber_epoch:
                        # safe: any later subscriber catches up past `current` by itself,
                        # and wakes this loop, so its live changes are not held back
                        last = current
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(block_ms / 1000):
                                await self._subscribed.wait()
                        continue
                entries = await self.store.feed_block(self._tail_client, last, block_ms)
                if entries:
                    for e in entries:
                        if e.kind != "skip":
                            self._fan_out(_entry_event(e))
                    last = entries[-1].revision
                    continue
                current = await self.store.revision()
                if current < last:  # the store lost state: every watcher must start over
                    log.warning("feed_revision_went_back", was=last, now=current)
                    self._fan_out(WatchEvent(WatchType.RESYNC, current, reason="store_reset"))
                    last = current
                    continue
                self._fan_out(WatchEvent(WatchType.BOOKMARK, last))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: retry; watchers see no bookmarks meanwhile
                log.warning("feed_tail_failed", error=str(exc))
                await asyncio.sleep(0.5)

    async def _sweeper(self) -> None:
        """Expires leases, except those an outage kept from being renewed. A sweep writes
        when it ran; one that finds the last sweep older than ``outage_gap_ms`` (Redis, or
        every registry, was away) keeps the leases that ran out since then live for one
        default lease more (or the outage's length, if longer), and until it runs every
        heartbeat script already treats them as live (``store.sweep``, ``keys.py``). So an
        outage longer than a lease does not empty the fleet: each worker renews at its next
        heartbeat, keeping its registration, credential and KV sessions."""
        interval_s = self.settings.sweep_interval_ms / 1000
        gap_ms = max(3 * self.settings.sweep_interval_ms, 1_000)
        while True:
            await asyncio.sleep(interval_s)
            now = self.clock.now_ms()
            try:
                had = self._grace
                expired, suspects, self._grace = await self.store.sweep(
                    now,
                    now - self.settings.load_stale_ms,
                    grace_ms=self.settings.lease_ttl_ms,
                    outage_gap_ms=gap_ms,
                )
                if self._grace != had and self._grace[1] > now:
                    log.warning(
                        "outage_grace_granted", since_ms=self._grace[0],
                        until_ms=self._grace[1], outage_s=round((now - self._grace[0]) / 1000, 1),
                    )  # fmt: skip
            except Unavailable as exc:
                log.warning("sweep_failed", error=str(exc))
                continue
            except Exception:  # a bug or a Redis refusal must not end the sweeps for good
                log.exception("sweep_error")
                continue
            for wid in expired:
                log.info("worker_expired", worker_id=wid)
                q = self._streams.get(wid)
                if q is not None:
                    q.put_nowait(NotFound("worker", wid))
            for wid in suspects:
                log.info("worker_suspected", worker_id=wid)

    async def _directive_listener(self) -> None:
        channel = self.store.keys.directive_channel
        while True:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(channel)
                while True:  # subscribed once Redis confirms it: from then on nothing is missed
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None and msg.get("type") == "subscribe":
                        break
                # a directive published while this listener was not subscribed (start, or
                # after an error) was not heard: every open stream looks for its own now
                for stream in list(self._streams.values()):
                    stream.put_nowait(_WAKE)
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    data = msg.get("data")
                    wid = data.decode() if isinstance(data, bytes) else str(data)
                    q = self._streams.get(wid)
                    if q is not None:
                        q.put_nowait(_WAKE)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("directive_listener_failed", error=str(exc))
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1):
                        await pubsub.aclose()
