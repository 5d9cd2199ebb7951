"""FleetInformer against a scripted WatchWorkers: reconnects never leave the view frozen."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_registry.informer import FleetInformer
from tests.support.fleet import capability

T = r.WatchEventType


def event(kind: Any, revision: int, worker_id: str = "", reason: str = "") -> r.WorkerEvent:
    ev = r.WorkerEvent(type=kind, revision=revision, worker_id=worker_id, reason=reason)
    if kind in (T.WATCH_EVENT_TYPE_SNAPSHOT, T.WATCH_EVENT_TYPE_PUT):
        ev.worker.CopyFrom(
            c.Worker(
                capability=capability(worker_id),
                status=c.WorkerStatus(lease_expires_at_unix_ms=2**60),
                revision=revision,
            )
        )
    return ev


class ScriptedRegistry(r_grpc.RegistryServiceServicer):  # type: ignore[misc]
    """Serves the n-th WatchWorkers call from `answer(n, from_revision)`: events, then
    either the stream breaks (UNAVAILABLE) or stays open."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def answer(self, n: int, from_revision: int) -> tuple[list[r.WorkerEvent], bool]:
        raise NotImplementedError

    async def WatchWorkers(
        self, request: r.WatchWorkersRequest, context: Any
    ) -> AsyncIterator[r.WatchWorkersResponse]:
        self.asked.append(request.from_revision)
        events, breaks = self.answer(len(self.asked), request.from_revision)
        for ev in events:
            yield r.WatchWorkersResponse(events=[ev])
        if breaks:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "registry went away")
        await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def informing(servicer: ScriptedRegistry) -> AsyncIterator[FleetInformer]:
    """A started informer following `servicer` (served on a free port)."""
    server = grpc.aio.server()
    r_grpc.add_RegistryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    informer = FleetInformer(f"127.0.0.1:{port}", max_backoff_s=0.2)
    try:
        await informer.start()
        yield informer
    finally:
        await informer.stop()
        await server.stop(0)


async def watch_until(informer: FleetInformer, want: set[str], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while set(informer.workers) != want:
        assert asyncio.get_running_loop().time() < deadline, (
            f"view stuck at {sorted(informer.workers)}, wanted {sorted(want)}"
        )
        await asyncio.sleep(0.02)


async def test_a_stream_broken_after_resync_asks_for_a_fresh_snapshot() -> None:
    """RESYNC, then the stream breaks before the new snapshot ends. Resuming from the old
    revision would replay changes into a snapshot that never ends: every one ignored, the
    view frozen while bookmarks make it look fresh."""

    class Registry(ScriptedRegistry):
        def answer(self, n: int, from_revision: int) -> tuple[list[r.WorkerEvent], bool]:
            if n == 1:
                return [
                    event(T.WATCH_EVENT_TYPE_SNAPSHOT, 4, "a"),
                    event(T.WATCH_EVENT_TYPE_SNAPSHOT_END, 5),
                    event(T.WATCH_EVENT_TYPE_RESYNC, 5, reason="watcher_fell_behind"),
                ], True
            if from_revision == 0:
                return [
                    event(T.WATCH_EVENT_TYPE_SNAPSHOT, 8, "b"),
                    event(T.WATCH_EVENT_TYPE_SNAPSHOT_END, 9),
                    event(T.WATCH_EVENT_TYPE_PUT, 10, "c"),
                ], False
            # the feed still holds from_revision: a replay, no snapshot
            return [
                event(T.WATCH_EVENT_TYPE_DELETE, 6, "a", reason="lease_expired"),
                event(T.WATCH_EVENT_TYPE_PUT, 8, "b"),
                event(T.WATCH_EVENT_TYPE_PUT, 10, "c"),
                event(T.WATCH_EVENT_TYPE_BOOKMARK, 10),
            ], False

    registry = Registry()
    async with informing(registry) as informer:
        await watch_until(informer, {"b", "c"})
        assert registry.asked == [0, 0]
        assert informer.revision == 10


async def test_a_snapshot_cut_short_leaves_no_phantom_workers() -> None:
    """The first snapshot breaks half-way; a worker it had sent is gone by the retry. The
    retry's snapshot alone is the view."""

    class Registry(ScriptedRegistry):
        def answer(self, n: int, from_revision: int) -> tuple[list[r.WorkerEvent], bool]:
            if n == 1:
                return [
                    event(T.WATCH_EVENT_TYPE_SNAPSHOT, 3, "a"),
                    event(T.WATCH_EVENT_TYPE_SNAPSHOT, 4, "gone"),
                ], True
            return [
                event(T.WATCH_EVENT_TYPE_SNAPSHOT, 3, "a"),
                event(T.WATCH_EVENT_TYPE_SNAPSHOT_END, 7),
            ], False

    registry = Registry()
    async with informing(registry) as informer:
        assert await informer.wait_synced(5)
        assert set(informer.workers) == {"a"}
        assert registry.asked == [0, 0]
