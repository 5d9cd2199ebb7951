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
from dataclasses import dataclass, replace
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
from hpd_common.ids import check_id
from hpd_common.logging import get_logger
from hpd_common.metrics import DIRECTIVES_DROPPED
from hpd_common.worker_model import Health, WorkerSpec
from hpd_registry.domain import (
    Directive,
    DirectiveKind,
    PoolSummary,
    WorkerFilter,
    WorkerRecord,
    heartbeat_interval_of,
    summarize_pools,
)
from hpd_registry.feed import ChangeFeed, Subscriber, stopping
from hpd_registry.heartbeats import END, WAKE, Heartbeats
from hpd_registry.keys import RegistryKeys
from hpd_registry.settings import RegistrySettings
from hpd_registry.store import HeartbeatItem, HeartbeatResult, RegistryStore, credential_hash
from hpd_registry.validation import validate_directive, validate_spec

log = get_logger("registry")


@dataclass(frozen=True, slots=True)
class Registration:
    worker_id: str
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    credential: str
    revision: int
    changed: bool


class RegistryService(ChangeFeed, Heartbeats):
    """The registry's use cases; the gRPC servicer is a thin layer over this.

    Split by responsibility: this module holds the set-up, the lifecycle, registration,
    operator actions, reads, the sweeper and the directive listener; watch streams and the
    feed reader are `feed.py`, heartbeats `heartbeats.py`, settings `settings.py`."""

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
        self._subscribers: set[Subscriber] = set()
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
            q.put_nowait(stopping())
        for sub in list(self._subscribers):
            sub.end(stopping())

    async def stop(self) -> None:
        # bounded: a task stuck on a dead connection must not block shutdown
        await cancel_and_wait(self._tasks, timeout_s=3)
        for q in list(self._streams.values()):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(END)
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
            await self._queue_directive(
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
        await self._queue_directive(worker_id, d)
        log.info(
            "directive_queued", worker_id=worker_id, kind=d.kind.value, directive_id=d.directive_id
        )
        return d.directive_id, worker_id in self._streams

    async def _queue_directive(self, worker_id: str, d: Directive) -> None:
        dropped = await self.store.push_directive(worker_id, d)
        if dropped:
            DIRECTIVES_DROPPED.inc(dropped)
            log.warning("directives_dropped", worker_id=worker_id, count=dropped,
                        why="the worker has not acked its queued directives")  # fmt: skip

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
                    stream.put_nowait(WAKE)
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    data = msg.get("data")
                    wid = data.decode() if isinstance(data, bytes) else str(data)
                    q = self._streams.get(wid)
                    if q is not None:
                        q.put_nowait(WAKE)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("directive_listener_failed", error=str(exc))
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1):
                        await pubsub.aclose()
