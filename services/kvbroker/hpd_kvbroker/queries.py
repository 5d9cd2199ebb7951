"""Reading KV sessions: one by session or request id, pages with filters (`hpd
sessions`), and watch streams of a session's changes (fed by one feed reader per replica,
started when the first watcher comes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from hpd_common.clock import Clock
from hpd_common.errors import InvalidArgument, NotFound, Unavailable
from hpd_common.ids import check_id
from hpd_common.logging import get_logger
from hpd_kvbroker.domain import Session, SessionState
from hpd_kvbroker.settings import KvBrokerSettings
from hpd_kvbroker.store import SessionStore, SweepResult, decode_session

log = get_logger("kvbroker")


class BrokerState:
    """What the parts of the broker service share: the attributes `KvBrokerService` sets
    up, declared once so each part's methods are checked against them."""

    settings: KvBrokerSettings
    client: aioredis.Redis
    clock: Clock
    store: SessionStore
    _watchers: dict[str, set[asyncio.Queue[Session | None]]]
    _draining: bool
    _tail_client: aioredis.Redis | None
    _tail_wanted: asyncio.Event
    _tail_ready: asyncio.Event

    async def sweep_once(self) -> SweepResult:
        raise NotImplementedError


class SessionQueries(BrokerState):
    """The read side of sessions (module docstring)."""

    async def _resolve(self, session_id: str, request_id: str) -> Session:
        if bool(session_id) == bool(request_id):
            raise InvalidArgument("session_id", "give exactly one of session_id and request_id")
        if session_id:
            check_id("session_id", session_id)
            s = await self.store.get(session_id)
            if s is None:
                raise NotFound("session", session_id)
            return s
        check_id("request_id", request_id)
        s = await self.store.get_by_request(request_id)
        if s is None:
            raise NotFound("session for request", request_id)
        return s

    async def get(self, session_id: str = "", request_id: str = "") -> Session:
        return await self._resolve(session_id, request_id)

    async def list_sessions(
        self,
        state: SessionState | None,
        worker_id: str,
        page_size: int,
        page_token: str,
        scan_batch: int = 256,
    ) -> tuple[list[Session], str]:
        """A page of matching sessions in id order and the next page token ('' at the end).

        Filters are applied while scanning the id index, `scan_batch` ids at a time, so a
        selective filter over many kept sessions reads more than one page of them (bounded
        by retention)."""
        if page_size == 0:
            page_size = 100
        if not 1 <= page_size <= 1000:
            raise InvalidArgument("page_size", "must be in 1..1000")
        if page_token:
            check_id("page_token", page_token)
        if worker_id:
            check_id("worker_id", worker_id)
        out: list[Session] = []
        after = page_token
        while len(out) < page_size:
            batch, scanned = await self.store.page(after, scan_batch)
            if scanned is None:
                return out, ""
            for s in batch:
                if (state is None or s.state is state) and (
                    not worker_id or worker_id in s.parties()
                ):
                    out.append(s)
                    if len(out) == page_size:
                        after = s.session_id
                        break
            else:  # the whole batch looked at, purged ids included
                after = scanned
        more = await self.store.has_more(after)
        return out, (after if more else "")

    async def watch(
        self, session_id: str, request_id: str, from_version: int
    ) -> AsyncIterator[Session]:
        """The session's state (if newer than from_version), then each change, up to and
        including a terminal state.

        The stream subscribes before it reads, so a change made between the read and the
        subscription cannot be lost; and it re-reads the session whenever it has heard
        nothing for `watch_poll_ms`, so a missed feed entry costs latency, never a state.
        """
        if session_id:
            check_id("session_id", session_id)
        queue: asyncio.Queue[Session | None] = asyncio.Queue()
        poll_s = self.settings.watch_poll_ms / 1000
        key = session_id
        if key:
            await self._subscribe(key, queue, poll_s)
        try:
            s = await self._resolve(session_id, request_id)
            if not key:
                key = s.session_id
                await self._subscribe(key, queue, poll_s)
                s = await self._resolve(key, "")
            last = from_version
            while True:
                if s.version > last:
                    last = s.version
                    yield s
                if s.state.terminal:
                    return
                try:
                    async with asyncio.timeout(poll_s):
                        got = await queue.get()
                    if got is None:
                        raise Unavailable(
                            f"kv broker stopping: watch again from version {last} "
                            "(on another replica)"
                        )
                    s = got
                except TimeoutError:
                    fresh = await self.store.get(key)
                    if fresh is None:
                        raise NotFound("session", key) from None
                    s = fresh
        finally:
            subs = self._watchers.get(key)
            if subs is not None:
                subs.discard(queue)
                if not subs:
                    del self._watchers[key]

    async def _subscribe(
        self, key: str, queue: asyncio.Queue[Session | None], wait_s: float
    ) -> None:
        """Registers a watcher and waits (up to wait_s) until the feed reader has its
        position, so that the session read which follows cannot miss a change."""
        self._watchers.setdefault(key, set()).add(queue)
        if self._draining:
            queue.put_nowait(None)
        self._tail_wanted.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self._tail_ready.wait()

    async def _tail_feed(self) -> None:
        """One blocking reader per replica feeds every WatchSession stream it serves.

        It reads only while this replica has watchers (an idle reader would pay a Redis
        reply per session change for nothing). When it starts it fixes its position at the
        feed's last entry and then sets `_tail_ready`; a new watcher waits for that before
        reading its session, so every change after that read is delivered."""
        assert self._tail_client is not None
        last: str | None = None
        while True:
            try:
                if not self._watchers:
                    last = None
                    self._tail_ready.clear()
                    await self._tail_wanted.wait()
                    self._tail_wanted.clear()
                    continue
                if last is None:
                    last = await self.store.feed_last_id()
                    self._tail_ready.set()
                entries = await self.store.feed_block(self._tail_client, last, 500)
                for entry_id, sid, fields in entries:
                    last = entry_id
                    queues = self._watchers.get(sid)
                    if queues:
                        s = decode_session(fields)
                        for q in list(queues):
                            q.put_nowait(s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: retry; watchers poll meanwhile
                log.warning("feed_tail_failed", error=str(exc))
                await asyncio.sleep(0.5)
