"""The registry as a process: SIGKILL and restart on the same Redis; Redis stopped and back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_tools.embedded_redis import EmbeddedRedis, free_port
from tests.support.fleet import capability
from tests.support.servers import external
from tests.support.watch import EventReader

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own processes"),
]


def start_process(redis_url: str, port: int, prefix: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "HPD_REDIS_URL": redis_url,
        "HPD_PORT": str(port),
        "HPD_KEY_PREFIX": prefix,
        "HPD_LOG_LEVEL": "warning",
        "HPD_SWEEP_INTERVAL_MS": "100",
        "HPD_BOOKMARK_INTERVAL_MS": "200",
    }
    return subprocess.Popen([sys.executable, "-m", "hpd_registry"], env=env)


async def wait_serving(target: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{target} not SERVING within {timeout_s}s")


@pytest.fixture
def registry_process(redis_server: EmbeddedRedis, key_prefix: str) -> Iterator[dict[str, object]]:
    port = free_port()
    state: dict[str, object] = {
        "port": port,
        "proc": start_process(redis_server.url, port, key_prefix),
    }
    yield state
    proc = state["proc"]
    assert isinstance(proc, subprocess.Popen)
    proc.kill()
    proc.wait()


async def test_sigkill_and_restart_keeps_workers_and_revision(
    registry_process: dict[str, object], redis_server: EmbeddedRedis, key_prefix: str
) -> None:
    port = registry_process["port"]
    target = f"127.0.0.1:{port}"
    await wait_serving(target)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = r_grpc.RegistryServiceStub(ch)
        creds = {}
        for i in range(5):
            resp = await stub.RegisterWorker(
                r.RegisterWorkerRequest(
                    capability=capability(f"{key_prefix}-{i}"), lease_ttl_ms=60_000
                ),
                timeout=5,
            )
            creds[resp.worker_id] = resp.credential
        watch = EventReader(stub.WatchWorkers(r.WatchWorkersRequest()))
        last = 0
        while True:
            ev = await watch.read()
            last = max(last, ev.revision)
            if ev.type == r.WATCH_EVENT_TYPE_SNAPSHOT_END:
                break
    proc = registry_process["proc"]
    assert isinstance(proc, subprocess.Popen)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    registry_process["proc"] = start_process(redis_server.url, int(str(port)), key_prefix)
    await wait_serving(target)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = r_grpc.RegistryServiceStub(ch)
        listed = await stub.ListWorkers(r.ListWorkersRequest(), timeout=5)
        assert sorted(w.capability.worker_id for w in listed.workers) == sorted(creds)
        assert listed.revision >= last
        # a watcher resumes from its last revision and sees only what happened since
        watch = EventReader(stub.WatchWorkers(r.WatchWorkersRequest(from_revision=last)))
        first_id = sorted(creds)[0]
        hb = await stub.Heartbeat(
            r.HeartbeatRequest(worker_id=first_id, credential=creds[first_id], load=None), timeout=5
        )
        assert hb.lease_ttl_ms > 0  # credentials survived the crash
        await stub.CordonWorker(r.CordonWorkerRequest(worker_id=first_id), timeout=5)
        ev = await watch.read()
        while ev.type == r.WATCH_EVENT_TYPE_BOOKMARK:
            ev = await watch.read()
        assert ev.type == r.WATCH_EVENT_TYPE_PUT and ev.worker_id == first_id
        assert ev.revision > last
        watch.cancel()


async def test_redis_outage_unavailable_then_recovers(tmp_path: Path, key_prefix: str) -> None:
    redis = EmbeddedRedis(tmp_path / "r", persist=True).start()
    port = free_port()
    proc = start_process(redis.url, port, key_prefix)
    target = f"127.0.0.1:{port}"
    try:
        await wait_serving(target)
        async with grpc.aio.insecure_channel(target) as ch:
            stub = r_grpc.RegistryServiceStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            acked = await stub.RegisterWorker(
                r.RegisterWorkerRequest(
                    capability=capability(key_prefix + "-kept"), lease_ttl_ms=120_000
                ),
                timeout=5,
            )
            await asyncio.sleep(1.2)  # AOF fsync is every second
            redis.stop()
            deadline = time.monotonic() + 10
            status = None
            while time.monotonic() < deadline:
                status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            for call in (
                stub.GetWorker(r.GetWorkerRequest(worker_id=acked.worker_id), timeout=4),
                stub.RegisterWorker(
                    r.RegisterWorkerRequest(capability=capability(key_prefix + "-new")), timeout=4
                ),
                stub.ListWorkers(r.ListWorkersRequest(), timeout=4),
            ):
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
                assert time.monotonic() - started < 4  # answered, not a hang to the deadline
            redis.start()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.SERVING
            got = await stub.GetWorker(r.GetWorkerRequest(worker_id=acked.worker_id), timeout=5)
            assert got.worker.capability.worker_id == acked.worker_id
    finally:
        proc.kill()
        proc.wait()
        redis.stop()


async def _register(
    stub: r_grpc.RegistryServiceStub, wid: str, lease_ms: int
) -> tuple[r.RegisterWorkerResponse, c.Worker]:
    """Registers ``wid`` with a lease of ``lease_ms``: the answer and the record as read."""
    reg = await stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(wid), lease_ttl_ms=lease_ms), timeout=5
    )
    got = await stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)
    return reg, got.worker


async def test_a_redis_outage_longer_than_the_lease_loses_no_worker(
    tmp_path: Path, key_prefix: str
) -> None:
    """Redis stopped for three leases while a worker keeps heartbeating (its heartbeats
    fail meanwhile): afterwards the worker is the same registration (same credential and
    registration time), no deletion reached the change feed, and its heartbeats succeed."""
    from tests.support.servers import start_registry, stop_server

    lease_ms = 1_000
    redis = EmbeddedRedis(tmp_path / "r", persist=True).start()
    server = await start_registry(redis.url, key_prefix, lease_ttl_ms=lease_ms)
    beats = {"ok": 0, "failed": 0, "gone": 0}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = r_grpc.RegistryServiceStub(ch)
            wid = key_prefix + "-steady"
            reg, first = await _register(stub, wid, lease_ms)
            watch = EventReader(stub.WatchWorkers(r.WatchWorkersRequest(from_revision=1)))

            async def heartbeats() -> None:
                while True:
                    try:
                        await stub.Heartbeat(
                            r.HeartbeatRequest(worker_id=wid, credential=reg.credential),
                            timeout=1,
                        )
                        beats["ok"] += 1
                    except grpc.aio.AioRpcError as exc:
                        key = "gone" if exc.code() == grpc.StatusCode.NOT_FOUND else "failed"
                        beats[key] += 1
                    await asyncio.sleep(lease_ms / 3000)

            beating = asyncio.create_task(heartbeats())
            await asyncio.sleep(1.2)  # AOF fsync is every second
            redis.stop()
            await asyncio.sleep(3 * lease_ms / 1000)
            redis.start()
            deadline = time.monotonic() + 15
            ok_before = beats["ok"]
            while beats["ok"] < ok_before + 3:  # heartbeats land again
                assert time.monotonic() < deadline, beats
                await asyncio.sleep(0.1)
            await asyncio.sleep(3 * lease_ms / 1000)  # and keep landing, past the grace
            assert beats["failed"] > 0 and beats["gone"] == 0, beats
            now = (await stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)).worker
            assert now.status.registered_at_unix_ms == first.status.registered_at_unix_ms
            deleted = []
            drain_until = time.monotonic() + 2.0  # the feed so far (bookmarks keep coming)
            while time.monotonic() < drain_until:
                try:
                    ev = await watch.read(timeout=0.5)
                except TimeoutError:
                    break
                if ev.type == r.WATCH_EVENT_TYPE_DELETE:
                    deleted.append(f"{ev.worker_id} {ev.reason} rev {ev.revision}")
            watch.cancel()
            beating.cancel()  # (only now: without heartbeats the lease would run out)
            assert not [d for d in deleted if d.startswith(wid + " ")], deleted
    finally:
        await stop_server(server)
        redis.stop()


async def test_a_worker_backing_off_after_a_long_outage_keeps_its_registration(
    tmp_path: Path, key_prefix: str
) -> None:
    """Redis stopped for four leases; the worker (as a client backing off exponentially
    would) heartbeats again only two leases after Redis is back. The grace after an outage
    lasts as long as the outage when that is longer than a lease, so the heartbeat renews
    the same registration (a grace of one lease expired it, and the worker registered
    again under a new credential, orphaning its KV sessions)."""
    from tests.support.servers import start_registry, stop_server

    lease_ms = 1_000
    redis = EmbeddedRedis(tmp_path / "r", persist=True).start()
    server = await start_registry(redis.url, key_prefix, lease_ttl_ms=lease_ms)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = r_grpc.RegistryServiceStub(ch)
            wid = key_prefix + "-backoff"
            reg, first = await _register(stub, wid, lease_ms)
            beat = r.HeartbeatRequest(worker_id=wid, credential=reg.credential)
            for _ in range(4):  # alive up to the outage (AOF fsync is every second)
                await asyncio.sleep(lease_ms / 3000)
                await stub.Heartbeat(beat, timeout=5)
            redis.stop()
            await asyncio.sleep(4 * lease_ms / 1000)
            redis.start()
            probe = aioredis.Redis.from_url(redis.url)
            deadline = time.monotonic() + 15
            while True:  # Redis answers again
                try:
                    await probe.ping()
                    break
                except RedisError:
                    assert time.monotonic() < deadline, "Redis never came back"
                    await asyncio.sleep(0.1)
            await probe.aclose()
            await asyncio.sleep(2 * lease_ms / 1000)  # the client's backoff sleep
            await stub.Heartbeat(beat, timeout=5)
            now = (await stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)).worker
            assert now.status.registered_at_unix_ms == first.status.registered_at_unix_ms
    finally:
        await stop_server(server)
        redis.stop()
