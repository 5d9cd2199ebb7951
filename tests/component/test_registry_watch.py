"""WatchWorkers (snapshot, changes, resume, resync) and leases (SUSPECT, then EXPIRED)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from tests.support.fleet import capability, load
from tests.support.servers import RegistryHandle, external, start_registry, stop_server
from tests.support.watch import EventReader

T = r.WatchEventType


async def next_event(
    call: EventReader, want: int, worker_id: str = "", timeout: float = 5.0
) -> Any:
    """Reads events until one of type `want` (for `worker_id`, if given) arrives."""
    return await call.next(want, worker_id, timeout)


@contextlib.asynccontextmanager
async def own_registry(
    redis_server: Any, key_prefix: str, **settings: Any
) -> AsyncIterator[tuple[Any, Any]]:
    """A registry of this test's own (with `settings`) and a stub for it: (server, stub)."""
    from hetero_pd.v1 import registry_pb2_grpc as r_grpc

    server = await start_registry(redis_server.url, key_prefix, **settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, r_grpc.RegistryServiceStub(channel)
    finally:
        await channel.close()
        await stop_server(server)


async def test_watch_snapshot_then_changes(registry: RegistryHandle) -> None:
    model = registry.prefix + "-model"
    a = registry.prefix + "-a"
    reg_a = await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(a, model=model)), timeout=5
    )
    call = EventReader(registry.stub.WatchWorkers(r.WatchWorkersRequest(model_id=model)))
    snap = await next_event(call, T.WATCH_EVENT_TYPE_SNAPSHOT)
    assert snap.worker_id == a and snap.worker.capability.model_id == model
    end = await next_event(call, T.WATCH_EVENT_TYPE_SNAPSHOT_END)
    assert end.revision >= snap.revision

    b = registry.prefix + "-b"
    await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(
            capability=capability(b, model=model, pool_id="a100-decode", stages=(c.STAGE_DECODE,))
        ),
        timeout=5,
    )
    put = await next_event(call, T.WATCH_EVENT_TYPE_PUT, b)
    assert put.worker.capability.pool_id == "a100-decode" and put.revision > end.revision

    await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=a, credential=reg_a.credential, load=load(queue=5)), timeout=5
    )
    ev = await next_event(call, T.WATCH_EVENT_TYPE_LOAD, a)
    assert ev.worker.load.queue_depth == 5 and ev.revision > put.revision

    await registry.stub.CordonWorker(r.CordonWorkerRequest(worker_id=a), timeout=5)
    ev = await next_event(call, T.WATCH_EVENT_TYPE_PUT, a)
    assert ev.worker.status.health == c.HEALTH_STATE_CORDONED

    await registry.stub.DeregisterWorker(
        r.DeregisterWorkerRequest(worker_id=a, credential=reg_a.credential), timeout=5
    )
    gone = await next_event(call, T.WATCH_EVENT_TYPE_DELETE, a)
    assert gone.reason == "deregistered"
    # other models' workers never appear on this watch
    await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(registry.prefix + "-other")), timeout=5
    )
    ev = await next_event(call, T.WATCH_EVENT_TYPE_BOOKMARK)
    assert ev.worker_id == ""
    call.cancel()


async def test_watch_resumes_from_revision(registry: RegistryHandle) -> None:
    model = registry.prefix + "-m"
    first = await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(registry.prefix + "-1", model=model)),
        timeout=5,
    )
    second_id = registry.prefix + "-2"
    await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(second_id, model=model)), timeout=5
    )
    call = EventReader(
        registry.stub.WatchWorkers(
            r.WatchWorkersRequest(from_revision=first.revision, model_id=model)
        )
    )
    ev = await call.read()
    # no snapshot: the change after the revision, replayed
    assert ev.type == T.WATCH_EVENT_TYPE_PUT and ev.worker_id == second_id
    call.cancel()


@pytest.mark.skipif(external("registry") is not None, reason="needs its own registry settings")
async def test_watch_from_trimmed_revision_resyncs(redis_server: Any, key_prefix: str) -> None:
    async with own_registry(redis_server, key_prefix, feed_max_len=10) as (_, stub):
        reg = await stub.RegisterWorker(
            r.RegisterWorkerRequest(capability=capability(key_prefix + "-x")), timeout=5
        )
        for i in range(300):  # push the feed well past its cap (trimming is approximate)
            await stub.Heartbeat(
                r.HeartbeatRequest(
                    worker_id=key_prefix + "-x", credential=reg.credential, load=load(queue=i)
                ),
                timeout=5,
            )
        call = EventReader(stub.WatchWorkers(r.WatchWorkersRequest(from_revision=1)))
        ev = await call.read()
        assert ev.type == T.WATCH_EVENT_TYPE_RESYNC
        ev = await call.read()
        assert ev.type == T.WATCH_EVENT_TYPE_SNAPSHOT and ev.worker.load.queue_depth == 299
        call.cancel()


@pytest.mark.skipif(external("registry") is not None, reason="needs its own registry settings")
async def test_first_watcher_gets_live_changes_without_waiting_out_the_idle_tailer(
    redis_server: Any, key_prefix: str
) -> None:
    """With nobody watching, the feed reader only checks the revision, once a second here.
    A new watcher wakes it: a registration right after the snapshot arrives at once, not
    when the idle second is over (a broker or scheduler started just before its workers
    would otherwise look them up in Redis for up to that second)."""
    async with own_registry(redis_server, key_prefix, bookmark_interval_ms=1_000) as (_, stub):
        await asyncio.sleep(0.1)  # the reader has found nobody watching and idles
        call = EventReader(stub.WatchWorkers(r.WatchWorkersRequest()))
        await next_event(call, T.WATCH_EVENT_TYPE_SNAPSHOT_END)
        wid = key_prefix + "-late"
        t0 = time.monotonic()
        await stub.RegisterWorker(r.RegisterWorkerRequest(capability=capability(wid)), timeout=5)
        await next_event(call, T.WATCH_EVENT_TYPE_PUT, wid)
        waited = time.monotonic() - t0
        assert waited < 0.5, f"the registration reached the new watcher after {waited:.2f} s"
        call.cancel()


@pytest.mark.skipif(external("registry") is not None, reason="writes into the registry's feed")
async def test_an_unreadable_feed_entry_is_skipped_not_a_stall(
    redis_server: Any, key_prefix: str
) -> None:
    """A feed row that does not decode (damaged, or of a kind a newer version writes) is
    passed over, live and on replay; it used to fail every read of the feed that held it."""
    from hpd_registry.keys import RegistryKeys

    keys = RegistryKeys(key_prefix)
    async with own_registry(redis_server, key_prefix) as (server, stub):
        client = server.redis
        first = r.RegisterWorkerRequest(capability=capability(key_prefix + "-first"))
        await stub.RegisterWorker(first, timeout=5)
        live = EventReader(stub.WatchWorkers(r.WatchWorkersRequest()))
        end = await next_event(live, T.WATCH_EVENT_TYPE_SNAPSHOT_END)
        assert end.revision > 0
        for fields in ({"t": "put", "id": "torn"}, {"t": "resize", "id": "future"}):
            rev = await client.incr(keys.revision)
            await client.xadd(keys.feed, fields, id=f"{rev}-0")
        wid = key_prefix + "-after"
        await stub.RegisterWorker(r.RegisterWorkerRequest(capability=capability(wid)), timeout=5)
        put = await next_event(live, T.WATCH_EVENT_TYPE_PUT, wid)
        replay = EventReader(stub.WatchWorkers(r.WatchWorkersRequest(from_revision=end.revision)))
        again = await replay.read()
        assert (again.type, again.worker_id, again.revision) == (
            T.WATCH_EVENT_TYPE_PUT,
            wid,
            put.revision,
        )
        live.cancel()
        replay.cancel()


@pytest.mark.skipif(external("registry") is not None, reason="stops its own registry")
async def test_stopping_ends_open_streams_instead_of_waiting_out_the_grace(
    redis_server: Any, key_prefix: str
) -> None:
    """Heartbeat and watch streams never end by themselves; a stopping registry ends them
    with UNAVAILABLE (their clients reconnect elsewhere) rather than holding shutdown for
    the whole grace."""
    async with own_registry(redis_server, key_prefix) as (server, stub):
        wid = key_prefix + "-streaming"
        reg = await stub.RegisterWorker(
            r.RegisterWorkerRequest(capability=capability(wid)), timeout=5
        )
        outbox: asyncio.Queue[r.StreamHeartbeatsRequest] = asyncio.Queue()
        await outbox.put(r.StreamHeartbeatsRequest(worker_id=wid, credential=reg.credential))

        async def requests() -> Any:
            while True:
                yield await outbox.get()

        beats = stub.StreamHeartbeats(requests())
        assert (await asyncio.wait_for(beats.read(), 5)).WhichOneof("event") == "ack"
        watch = EventReader(stub.WatchWorkers(r.WatchWorkersRequest()))
        await next_event(watch, T.WATCH_EVENT_TYPE_SNAPSHOT_END)
        t0 = time.monotonic()
        await server.stop(10)
        took = time.monotonic() - t0
        assert took < 5, f"stopping took {took:.1f} s of its 10 s grace"
        for call in (beats, watch.call):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await asyncio.wait_for(call.read(), 5) is not grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "registry stopping" in (err.value.details() or "")


def test_a_full_watch_queue_still_ends_when_the_registry_stops() -> None:
    """A watcher far behind (its queue full) gets the stop, not a RESYNC and a snapshot."""
    from hpd_common.errors import Unavailable
    from hpd_registry.feed import Subscriber

    sub = Subscriber(maxsize=2)
    sub.offer("event-1")
    sub.offer("event-2")
    stop = Unavailable("registry stopping")
    sub.end(stop)
    sub.offer("event-3")  # a bookmark after the stop: ignored, no overflow
    assert sub.queue.get_nowait() is stop and sub.queue.empty() and not sub.overflowed


@pytest.mark.skipif(external("registry") is not None, reason="drains its own registry")
async def test_streams_opened_while_draining_end_at_once(registry: RegistryHandle) -> None:
    """A stream that arrives after the registry began stopping (a worker reconnecting from
    another stopping replica) ends at once too, instead of holding the grace."""
    from hpd_registry.api import RegistryComponent

    assert registry.server is not None
    component = registry.server.component
    assert isinstance(component, RegistryComponent)
    wid = registry.prefix + "-late"
    reg = await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(wid)), timeout=5
    )
    component.drain()

    async def one() -> Any:
        yield r.StreamHeartbeatsRequest(worker_id=wid, credential=reg.credential)
        await asyncio.Event().wait()

    beats = registry.stub.StreamHeartbeats(one())
    watch = registry.stub.WatchWorkers(r.WatchWorkersRequest())
    for call in (beats, watch):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await asyncio.wait_for(call.read(), 5) is not grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.skipif(external("registry") is not None, reason="needs its own registry settings")
async def test_registering_over_an_unswept_expired_lease_reports_the_expiry_first(
    redis_server: Any, key_prefix: str
) -> None:
    """A worker that restarts and registers again after its lease lapsed, before a sweep got
    to it, is a new incarnation: watchers see the old one's DELETE (lease_expired) before
    the new PUT, so whatever they held for it (a KV session in flight) is released."""
    async with own_registry(redis_server, key_prefix, sweep_interval_ms=60_000) as (_, stub):
        wid = key_prefix + "-restarts"
        first = r.RegisterWorkerRequest(capability=capability(wid), lease_ttl_ms=100)
        await stub.RegisterWorker(first, timeout=5)
        call = EventReader(stub.WatchWorkers(r.WatchWorkersRequest()))
        await next_event(call, T.WATCH_EVENT_TYPE_SNAPSHOT_END)
        await asyncio.sleep(0.2)  # the lease lapses; no sweep runs for a minute
        again = r.RegisterWorkerRequest(capability=capability(wid), lease_ttl_ms=30_000)
        await stub.RegisterWorker(again, timeout=5)
        gone = await next_event(call, T.WATCH_EVENT_TYPE_DELETE, wid)
        assert gone.reason == "lease_expired"
        back = await next_event(call, T.WATCH_EVENT_TYPE_PUT, wid)  # after it, not before
        assert back.revision > gone.revision
        call.cancel()


async def test_silent_worker_turns_suspect_then_expires(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-quiet"
    ttl_ms = 1_200
    reg = await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(wid), lease_ttl_ms=ttl_ms), timeout=5
    )
    assert reg.lease_ttl_ms == ttl_ms
    call = EventReader(
        registry.stub.WatchWorkers(r.WatchWorkersRequest(from_revision=reg.revision))
    )
    start = time.monotonic()
    ev = await next_event(call, T.WATCH_EVENT_TYPE_PUT, wid, timeout=5)
    assert ev.worker.status.health == c.HEALTH_STATE_SUSPECT
    suspect_after = time.monotonic() - start
    gone = await next_event(call, T.WATCH_EVENT_TYPE_DELETE, wid, timeout=5)
    expired_after = time.monotonic() - start
    assert gone.reason == "lease_expired"
    # SUSPECT after two missed intervals (2 x 400 ms), EXPIRED within TTL + one sweep (+ slack)
    assert 0.7 <= suspect_after < expired_after
    assert expired_after <= (ttl_ms + 100) / 1000 + 1.0
    code = None
    try:
        await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
    assert code == grpc.StatusCode.NOT_FOUND
    hb = r.HeartbeatRequest(worker_id=wid, credential=reg.credential)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await registry.stub.Heartbeat(hb, timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    call.cancel()


async def test_heartbeat_after_suspect_restores_healthy(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-back"
    reg = await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(wid), lease_ttl_ms=1_500), timeout=5
    )
    call = EventReader(
        registry.stub.WatchWorkers(r.WatchWorkersRequest(from_revision=reg.revision))
    )
    await next_event(call, T.WATCH_EVENT_TYPE_PUT, wid)  # SUSPECT
    await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=reg.credential), timeout=5
    )
    ev = await next_event(call, T.WATCH_EVENT_TYPE_PUT, wid)
    assert ev.worker.status.health == c.HEALTH_STATE_HEALTHY
    call.cancel()


async def test_watch_filtered_by_event_type_skips_loads_but_keeps_snapshot_end(
    registry: RegistryHandle,
) -> None:
    model = registry.prefix + "-kinds"
    a = registry.prefix + "-ka"
    reg_a = await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(a, model=model)), timeout=5
    )
    want = [T.WATCH_EVENT_TYPE_PUT, T.WATCH_EVENT_TYPE_DELETE]
    call = EventReader(
        registry.stub.WatchWorkers(r.WatchWorkersRequest(model_id=model, event_types=want))
    )
    # no SNAPSHOT event for a, but the snapshot's end always comes through
    first = await call.read()
    assert first.type == T.WATCH_EVENT_TYPE_SNAPSHOT_END
    for q in (1, 2, 3):
        await registry.stub.Heartbeat(
            r.HeartbeatRequest(worker_id=a, credential=reg_a.credential, load=load(queue=q)),
            timeout=5,
        )
    await registry.stub.CordonWorker(r.CordonWorkerRequest(worker_id=a), timeout=5)
    await registry.stub.DeregisterWorker(
        r.DeregisterWorkerRequest(worker_id=a, credential=reg_a.credential), timeout=5
    )
    # the three loads came before these, and none of them is on this watch
    put = await call.read()
    assert (put.type, put.worker.status.health) == (
        T.WATCH_EVENT_TYPE_PUT,
        c.HEALTH_STATE_CORDONED,
    )
    gone = await call.read()
    assert (gone.type, gone.reason) == (T.WATCH_EVENT_TYPE_DELETE, "deregistered")
    call.cancel()


async def test_watch_with_an_unknown_event_type_is_refused(registry: RegistryHandle) -> None:
    call = registry.stub.WatchWorkers(
        r.WatchWorkersRequest(event_types=[r.WATCH_EVENT_TYPE_UNSPECIFIED])
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "event_types" in (err.value.details() or "")


async def _hpd(*argv: str) -> tuple[int, str, str]:
    """The installed `hpd` command in a child process: exit code, stdout, stderr."""
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).with_name("hpd"))
    proc = await asyncio.create_subprocess_exec(
        exe, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:  # timed out or cancelled: no process left behind
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_hpd_watch_prints_the_kinds_asked_for(registry: RegistryHandle) -> None:
    model = registry.prefix + "-cli"
    a = registry.prefix + "-wa"
    reg = await registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(a, model=model)), timeout=5
    )
    # from revision 1: the registration (a PUT) replays
    code, out, err = await _hpd(
        "watch", "--registry", registry.target, "--model", model,
        "--kind", "put", "--from-revision", "1", "--count", "1",
    )  # fmt: skip
    assert code == 0, err
    (line,) = out.strip().splitlines()
    assert line.split()[1:3] == ["put", a] and "pool=h100-prefill health=" in line, line
    # loads are live only (not replayed): heartbeat until the watcher has seen one
    argv = ["watch", "--registry", registry.target, "--model", model, "--kind", "load"]
    watcher = asyncio.create_task(_hpd(*argv, "--count", "1", "-o", "json"))
    while not watcher.done():
        await registry.stub.Heartbeat(
            r.HeartbeatRequest(worker_id=a, credential=reg.credential, load=load(queue=4)),
            timeout=5,
        )
        await asyncio.wait({watcher}, timeout=0.2)
    code, out, err = watcher.result()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["type"] == "WATCH_EVENT_TYPE_LOAD" and doc["worker"]["load"]["queue_depth"] == 4
    code, out, err = await _hpd("watch", "--registry", registry.target, "--kind", "loads")
    assert code == 2 and "unknown event kind 'loads'" in err and "known: snapshot" in err


async def test_hpd_workers_json_into_a_closed_pipe_exits_cleanly(
    registry: RegistryHandle,
) -> None:
    """`hpd workers -o json | head -1`: the reader leaves early; no traceback, exit 0."""
    import sys
    from pathlib import Path

    for i in range(30):
        await registry.stub.RegisterWorker(
            r.RegisterWorkerRequest(capability=capability(f"{registry.prefix}-pipe{i}")), timeout=5
        )
    exe = str(Path(sys.executable).with_name("hpd"))
    proc = await asyncio.create_subprocess_shell(
        f"set -o pipefail; {exe} workers --registry {registry.target} -o json | head -1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        executable="/bin/bash",
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "[" and not err.decode(), err.decode()
