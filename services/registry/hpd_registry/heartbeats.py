"""Heartbeats: unary and streamed lease renewals with load reports, written in batches
(one Lua call per batch; a batch forms while the previous one is in flight, so there is no
added delay under light load), and directives delivered on the worker's stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from hpd_common.aio import cancel_and_wait
from hpd_common.errors import InvalidArgument, NotFound, PermissionDenied
from hpd_common.ids import check_id
from hpd_common.logging import get_logger
from hpd_common.worker_model import Health, LoadReport
from hpd_registry.domain import Directive, flag_health
from hpd_registry.feed import RegistryState, stopping
from hpd_registry.store import HeartbeatItem, HeartbeatResult, credential_hash
from hpd_registry.validation import stamp_load, validate_load

log = get_logger("registry")


@dataclass(frozen=True, slots=True)
class HeartbeatInput:
    worker_id: str
    credential: str
    load: LoadReport | None
    health: str  # '', 'ok', 'bad'
    reason: str = ""
    acked: tuple[str, ...] = ()  # directive ids the worker has taken


@dataclass(frozen=True, slots=True)
class Acked:
    """Directive ids a stream's worker acked (the stream stops counting them as sent)."""

    ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    lease_expires_at_ms: int


@dataclass(frozen=True, slots=True)
class HeartbeatOutcome:
    lease: LeaseInfo
    directives: list[Directive]
    health: Health


WAKE = object()


END = object()


class Heartbeats(RegistryState):
    """Lease renewals and the heartbeat stream (module docstring)."""

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
        pending = res.pending_directives
        if hb.acked and pending:  # the credential was checked: the worker acks its own
            pending -= await self.store.ack_directives(hb.worker_id, hb.acked)
        # at least once: every un-acked directive is in every answer until it is acked
        directives = await self.store.peek_directives(hb.worker_id) if pending > 0 else []
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
            previous.put_nowait(END)
        self._streams[worker_id] = queue
        if self._draining:
            queue.put_nowait(stopping())
        ttl = outcome.lease.lease_ttl_ms
        reader = asyncio.create_task(self._read_reports(worker_id, ttl, rest, queue))
        log.info("heartbeat_stream_opened", worker_id=worker_id)
        sent = {d.directive_id for d in outcome.directives}  # on this stream, not yet acked
        try:
            queue.put_nowait(WAKE)  # anything queued before the stream existed
            while True:
                item = await queue.get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Acked):
                    sent -= set(item.ids)
                elif item is WAKE:
                    # what is queued and not yet sent here; a directive sent but not acked
                    # when the stream breaks stays queued and goes out again on the next one
                    for d in await self.store.peek_directives(worker_id):
                        if d.directive_id not in sent:
                            sent.add(d.directive_id)
                            yield d
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
                pending = res.pending_directives
                if hb.acked and pending:
                    pending -= await self.store.ack_directives(worker_id, hb.acked)
                    out.put_nowait(Acked(hb.acked))
                if pending > 0:
                    out.put_nowait(WAKE)
                now = self.clock.monotonic()
                if now - last_ack >= interval_s:
                    last_ack = now
                    ttl = res.lease_ttl_ms
                    interval_s = self._interval_for(ttl) / 1000
                    out.put_nowait(LeaseInfo(ttl, self._interval_for(ttl), res.lease_expires_at_ms))
            out.put_nowait(END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            out.put_nowait(exc)
