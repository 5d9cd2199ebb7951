"""A local, continuously updated view of the fleet from the registry's WatchWorkers.

The Kubernetes informer pattern: one stream per process, a snapshot then changes;
on RESYNC the view is rebuilt from the snapshot that follows; on a broken stream
it reconnects with capped exponential backoff and resumes from the last revision
(the registry sends RESYNC + snapshot if that revision is gone). Readers never
make a network call: they read `workers`, which is updated in place by the event
loop's thread only, so any synchronous section of a reader sees a consistent map
(copy it to keep it across an await).

Freshness: `age_s()` is the time since the registry was last heard from (any event,
including the bookmarks it sends when idle). Services compare it with their
staleness bound to decide whether to keep serving from the view.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_common.aio import cancel_and_wait
from hpd_common.channels import CallIdentity, aio_channel
from hpd_common.clock import Clock, SystemClock
from hpd_common.logging import get_logger
from hpd_registry.convert import load_from_pb, spec_from_pb
from hpd_registry.domain import WorkerRecord, WorkerState

log = get_logger("informer")

# Keepalive pings find a dead connection (a partition) in seconds instead of at the next
# TCP timeout; the registry's server options permit pings this often.
CLIENT_OPTIONS = [
    ("grpc.keepalive_time_ms", 6_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass(frozen=True, slots=True)
class FleetChange:
    """What changed: kind is put, load, delete or resync (worker_id empty for resync).

    `reason` says why a worker was deleted: "deregistered" or "lease_expired".
    """

    kind: str
    worker_id: str
    record: WorkerRecord | None
    revision: int
    reason: str = ""


def record_from_pb(w: Any) -> WorkerRecord:
    """A registry Worker message as a domain record."""
    st = w.status
    state = WorkerState(
        registered_at_ms=st.registered_at_unix_ms,
        last_heartbeat_ms=st.last_heartbeat_unix_ms,
        lease_expires_at_ms=st.lease_expires_at_unix_ms,
        lease_ttl_ms=st.lease_ttl_ms,
        suspect=st.health == 2,  # HEALTH_STATE_SUSPECT
        unhealthy=st.health == 6,  # HEALTH_STATE_UNHEALTHY
        unhealthy_reason=st.health_reason if st.health == 6 else "",
        draining=st.draining,
        cordoned=st.cordoned,
        admin_reason=st.health_reason if st.draining or st.cordoned else "",
    )
    return WorkerRecord(
        spec=spec_from_pb(w.capability),
        state=state,
        load=load_from_pb(w.load) if w.HasField("load") else None,
        revision=w.revision,
    )


class FleetInformer:
    """Keeps `workers` (id -> WorkerRecord) in step with the registry."""

    def __init__(
        self,
        target: str,
        *,
        model_id: str = "",
        on_change: Callable[[FleetChange], None] | None = None,
        clock: Clock | None = None,
        identity: CallIdentity | None = None,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.target = target
        self.model_id = model_id
        self.on_change = on_change
        self.clock = clock or SystemClock()
        self._identity = identity
        self._max_backoff_s = max_backoff_s
        self.workers: dict[str, WorkerRecord] = {}
        self._pending: dict[str, WorkerRecord] = {}
        self._in_snapshot = False
        self.revision = 0
        self.synced = False
        self._last_contact: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._synced_event = asyncio.Event()

    def age_s(self) -> float:
        """Seconds since the registry was last heard from (inf before the first snapshot)."""
        if self._last_contact is None or not self.synced:
            return float("inf")
        return self.clock.monotonic() - self._last_contact

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet-informer")

    async def wait_synced(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._synced_event.wait()
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        if self._task is not None:
            # a cancel that lands while the WatchWorkers call is open can surface inside the
            # call as an RpcError(CANCELLED), which the reconnect loop takes for a broken
            # stream: cancel_and_wait cancels again until the task has really ended
            await cancel_and_wait([self._task])

    def _emit(self, change: FleetChange) -> None:
        if self.on_change is not None:
            try:
                self.on_change(change)
            except Exception:  # a bad listener must not stop the informer
                log.exception("informer_listener_failed")

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            channel = aio_channel(self.target, self._identity, CLIENT_OPTIONS)
            try:
                stub = r_grpc.RegistryServiceStub(channel)
                call = stub.WatchWorkers(
                    r.WatchWorkersRequest(
                        from_revision=self._resume_revision(), model_id=self.model_id
                    )
                )
                async for msg in call:
                    backoff = 0.1
                    self._last_contact = self.clock.monotonic()
                    for ev in msg.events:
                        self._apply(ev)
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # a cancel that lands inside the call surfaces as CANCELLED: honour it
                    raise asyncio.CancelledError from exc
                log.warning("informer_stream_broken", target=self.target, code=exc.code().name)
            except Exception:
                log.exception("informer_failed")
            finally:
                with contextlib.suppress(Exception):
                    await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(self._max_backoff_s, backoff * 2)

    def _resume_revision(self) -> int:
        """The revision a (re)connection asks to resume from.

        A stream that broke inside a snapshot left a half-built one behind. Resuming from
        `revision` would then replay changes into a snapshot that never ends (every change
        is ignored until SNAPSHOT_END, which a replay does not send), freezing the view
        while bookmarks keep it looking fresh. So the half-built snapshot is dropped and a
        fresh one asked for (revision 0); the view in use stays until that one ends."""
        if self._in_snapshot:
            self._pending = {}
            self._in_snapshot = False
            return 0
        return self.revision

    def _apply(self, ev: Any) -> None:
        t = ev.type
        if t == r.WATCH_EVENT_TYPE_RESYNC:
            self._pending = {}
            self._in_snapshot = True
            return
        if t == r.WATCH_EVENT_TYPE_SNAPSHOT:
            if not self._in_snapshot:
                self._pending = {}
                self._in_snapshot = True
            self._pending[ev.worker_id] = record_from_pb(ev.worker)
            return
        if t == r.WATCH_EVENT_TYPE_SNAPSHOT_END:
            self.workers = self._pending
            self._pending = {}
            self._in_snapshot = False
            self.revision = ev.revision
            self.synced = True
            self._synced_event.set()
            self._emit(FleetChange("resync", "", None, ev.revision))
            return
        if t == r.WATCH_EVENT_TYPE_BOOKMARK:
            self.revision = max(self.revision, ev.revision)
            return
        if self._in_snapshot:
            return
        self.revision = max(self.revision, ev.revision)
        if t == r.WATCH_EVENT_TYPE_PUT:
            rec = record_from_pb(ev.worker)
            self.workers[ev.worker_id] = rec
            self._emit(FleetChange("put", ev.worker_id, rec, ev.revision))
        elif t == r.WATCH_EVENT_TYPE_LOAD:
            old = self.workers.get(ev.worker_id)
            if old is None:
                return
            st = replace(old.state, last_heartbeat_ms=ev.worker.status.last_heartbeat_unix_ms)
            rec = replace(old, load=load_from_pb(ev.worker.load), state=st, revision=ev.revision)
            self.workers[ev.worker_id] = rec
            self._emit(FleetChange("load", ev.worker_id, rec, ev.revision))
        elif t == r.WATCH_EVENT_TYPE_DELETE:
            self.workers.pop(ev.worker_id, None)
            self._emit(FleetChange("delete", ev.worker_id, None, ev.revision, ev.reason))
