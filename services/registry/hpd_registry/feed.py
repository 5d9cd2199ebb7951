"""The change feed's read side: `WatchWorkers` streams (a snapshot or a replay from a
revision, then live changes, bookmarks when idle, a resync when a watcher falls behind or
the store lost state) and the one blocking feed reader per replica that fans entries out
to every watcher."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis

from hpd_common.clock import Clock
from hpd_common.errors import Unavailable
from hpd_common.logging import get_logger
from hpd_common.worker_model import LoadReport
from hpd_registry.domain import WorkerRecord
from hpd_registry.settings import RegistrySettings
from hpd_registry.store import FeedEntry, HeartbeatItem, HeartbeatResult, RegistryStore

log = get_logger("registry")


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


_OVERFLOW = object()


class Subscriber:
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


def stopping() -> Unavailable:
    """What a stream of a stopping registry ends with (one per stream: raised once each)."""
    return Unavailable("registry stopping: reconnect (to another replica)")


def entry_event(e: FeedEntry) -> WatchEvent:
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


class _WatchState:
    """One watch stream's position: the last revision sent, and (when the stream follows one
    model) the workers of that model it has announced, so a DELETE or LOAD of another
    model's worker is not sent."""

    __slots__ = ("known", "last", "model_id")

    def __init__(self, last: int, model_id: str) -> None:
        self.last = last
        self.model_id = model_id
        self.known: set[str] = set()

    def wanted(self, ev: WatchEvent) -> bool:
        if not self.model_id or ev.type in (
            WatchType.BOOKMARK,
            WatchType.RESYNC,
            WatchType.SNAPSHOT_END,
        ):
            return True
        if ev.record is not None:
            if ev.record.spec.model_id == self.model_id:
                self.known.add(ev.worker_id)
                return True
            self.known.discard(ev.worker_id)
            return False
        if ev.type == WatchType.DELETE:
            if ev.worker_id in self.known:
                self.known.discard(ev.worker_id)
                return True
            return False
        return ev.worker_id in self.known


class RegistryState:
    """What the parts of the registry service share: the attributes `RegistryService`
    sets up, declared once so each part's methods are checked against them."""

    settings: RegistrySettings
    client: aioredis.Redis
    clock: Clock
    store: RegistryStore
    _max_batch: int
    _pending: list[tuple[HeartbeatItem, asyncio.Future[HeartbeatResult]]]
    _wake_batcher: asyncio.Event
    _subscribers: set[Subscriber]
    _subscriber_epoch: int
    _subscribed: asyncio.Event
    _draining: bool
    _streams: dict[str, asyncio.Queue[Any]]
    _tail_client: aioredis.Redis | None

    def _interval_for(self, ttl_ms: int) -> int:
        raise NotImplementedError

    def lapsed(self, rec: WorkerRecord, now_ms: int) -> bool:
        raise NotImplementedError


class ChangeFeed(RegistryState):
    """Watch streams and the feed reader (module docstring)."""

    async def watch(
        self, from_revision: int, model_id: str = "", max_batch: int = 512
    ) -> AsyncIterator[list[WatchEvent]]:
        """Snapshot (or replay from a revision), then live changes, bookmarks when idle.

        Yields batches: whatever is ready, up to max_batch events, in revision order. A
        watcher that falls behind, or a store that lost state, gets a RESYNC and a new
        snapshot."""
        sub = Subscriber(self.settings.watch_queue_max)
        self._subscribers.add(sub)
        self._subscriber_epoch += 1
        self._subscribed.set()
        if self._draining:
            sub.end(stopping())
        st = _WatchState(from_revision, model_id)
        try:
            if st.last:
                current = await self.store.revision()
                first = await self.store.first_feed_revision()
                oldest_kept = first - 1 if first is not None else current
                if st.last < oldest_kept or st.last > current:
                    yield [WatchEvent(WatchType.RESYNC, current, reason="revision_unavailable")]
                    st.last = 0
            while True:
                if st.last == 0:
                    async for batch in self._snapshot_batches(st, max_batch):
                        yield batch
                async for batch in self._catch_up(st, max_batch):
                    yield batch
                async for batch in self._live(st, sub, max_batch):
                    yield batch
        finally:
            self._subscribers.discard(sub)

    async def _snapshot_batches(
        self, st: _WatchState, max_batch: int
    ) -> AsyncIterator[list[WatchEvent]]:
        """The live workers (of the model, if one is asked for) as SNAPSHOT events, then
        SNAPSHOT_END at the snapshot's revision."""
        rev, records = await self.store.snapshot()
        now = self.clock.now_ms()
        st.known.clear()
        batch: list[WatchEvent] = []
        for rec in records:
            if self.lapsed(rec, now):
                continue
            if not st.model_id or rec.spec.model_id == st.model_id:
                st.known.add(rec.spec.worker_id)
                batch.append(WatchEvent(WatchType.SNAPSHOT, rec.revision, rec.spec.worker_id, rec))
                if len(batch) == max_batch:
                    yield batch
                    batch = []
        batch.append(WatchEvent(WatchType.SNAPSHOT_END, rev))
        yield batch
        st.last = rev

    async def _catch_up(self, st: _WatchState, max_batch: int) -> AsyncIterator[list[WatchEvent]]:
        """The feed's entries after ``st.last``, read from the store until it is exhausted."""
        while True:
            entries = await self.store.feed_after(st.last, max_batch)
            batch = []
            for e in entries:
                st.last = e.revision
                if e.kind == "skip":
                    continue
                ev = entry_event(e)
                if st.wanted(ev):
                    batch.append(ev)
            if batch:
                yield batch
            if len(entries) < max_batch:
                return

    async def _live(
        self, st: _WatchState, sub: Subscriber, max_batch: int
    ) -> AsyncIterator[list[WatchEvent]]:
        """Live changes from the feed reader, until a resync (then ``st.last`` is 0: a new
        snapshot follows)."""
        while True:
            items = [await sub.queue.get()]
            while len(items) < max_batch and not sub.queue.empty():
                items.append(sub.queue.get_nowait())
            batch: list[WatchEvent] = []
            resync = False
            for item in items:
                if isinstance(item, Unavailable):
                    raise item
                if item is _OVERFLOW:
                    sub.overflowed = False
                    batch = [WatchEvent(WatchType.RESYNC, st.last, reason="watcher_fell_behind")]
                    resync = True
                    break
                ev = item
                if ev.type == WatchType.RESYNC:
                    batch.append(ev)
                    resync = True
                    break
                if ev.type == WatchType.BOOKMARK:
                    if not batch:  # a bookmark only says "alive" when nothing else does
                        batch.append(replace(ev, revision=max(ev.revision, st.last)))
                elif ev.revision > st.last:
                    st.last = ev.revision
                    if st.wanted(ev):
                        batch.append(ev)
            if resync:
                st.last = 0
            if batch:
                yield batch
            if resync:
                return

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
                            self._fan_out(entry_event(e))
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
