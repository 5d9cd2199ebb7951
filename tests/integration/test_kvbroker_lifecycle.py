"""The broker among failures: a worker's lease expiring mid-transfer, a broker restart,
Redis going away and coming back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as k
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_common import redis_conn
from hpd_common.errors import Unavailable
from hpd_kvbroker.api import SERVICE_NAME
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.kvbroker import (
    GIB,
    BrokerHandle,
    caller,
    open_request,
    register,
    start_broker,
)
from tests.support.servers import RegistryHandle, start_registry, stop_server


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)


async def open_p1_to_d1(
    reg_stub: Any, broker: BrokerHandle, deadline_ms: int = 60_000
) -> tuple[str, k.KvSession]:
    """Registers p1 (prefill) and d1 (decode) for a minute and opens a p1 -> d1 session
    whose deadline and lease are `deadline_ms`; (p1's credential, the session)."""
    p1 = await register(reg_stub, "p1", lease_ttl_ms=60_000)
    await register(reg_stub, "d1", lease_ttl_ms=60_000, stages=(c.STAGE_DECODE,))
    opened = await broker.stub.OpenSession(
        open_request(
            "req-1", who=caller("p1", p1), deadline_ms=deadline_ms, lease_ttl_ms=deadline_ms
        ),
        timeout=5,
    )
    return p1, opened.session


async def watch_until_terminal(broker: BrokerHandle, sid: str) -> list[k.KvSession]:
    seen = []
    async for msg in broker.stub.WatchSession(k.WatchSessionRequest(session_id=sid), timeout=10):
        seen.append(msg.session)
    return seen


@pytest.mark.parametrize(
    ("via", "reasons"),
    [
        pytest.param("feed", {"worker_lease_expired: p1"}, id="registry-feed"),
        pytest.param(
            "sweeper", {"worker_lease_expired: p1", "worker_gone: p1"}, id="sweeper-safety-net"
        ),
    ],
)
async def test_a_lease_expiring_mid_transfer_fails_the_session_and_watchers_see_it(
    redis_server: EmbeddedRedis,
    registry: RegistryHandle,
    key_prefix: str,
    via: str,
    reasons: set[str],
) -> None:
    """feed: the broker follows the registry's WatchWorkers (its own sweeper idle), so the
    registry's DELETE with reason lease_expired fails the session. sweeper: no feed; the
    sweeper finds the worker's registry lease gone."""
    options = (
        {"registry_target": registry.target, "sweep_interval_ms": 60_000}
        if via == "feed"
        else {"sweep_interval_ms": 50}
    )
    broker = await start_broker(redis_server.url, key_prefix, **options)
    try:
        p1 = await register(registry.stub, "p1", lease_ttl_ms=400)
        d1 = await register(registry.stub, "d1", lease_ttl_ms=30_000, stages=(c.STAGE_DECODE,))
        opened = await broker.stub.OpenSession(
            open_request("req-1", who=caller("p1", p1), lease_ttl_ms=10_000), timeout=5
        )
        sid = opened.session.session_id
        await broker.stub.ReportProgress(
            k.ReportProgressRequest(session_id=sid, caller=caller("p1", p1), bytes_done=GIB // 3),
            timeout=5,
        )
        seen = await watch_until_terminal(broker, sid)
        assert [s.state for s in seen] == [k.SESSION_STATE_TRANSFERRING, k.SESSION_STATE_FAILED]
        assert seen[-1].reason in reasons
        assert (seen[-1].bytes_done, seen[-1].updated_by) == (GIB // 3, "broker")
        late = broker.stub.CompleteSession(
            k.CompleteSessionRequest(session_id=sid, caller=caller("d1", d1)), timeout=5
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await late
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await broker.close()


async def test_a_restarted_broker_continues_open_sessions(
    redis_server: EmbeddedRedis, registry: RegistryHandle, key_prefix: str
) -> None:
    p1 = await register(registry.stub, "p1", lease_ttl_ms=30_000)
    d1 = await register(registry.stub, "d1", lease_ttl_ms=30_000, stages=(c.STAGE_DECODE,))
    first = await start_broker(redis_server.url, key_prefix, registry_target=registry.target)
    opened = await first.stub.OpenSession(open_request("req-1", who=caller("p1", p1)), timeout=5)
    sid = opened.session.session_id
    await first.stub.ReportProgress(
        k.ReportProgressRequest(session_id=sid, caller=caller("p1", p1), bytes_done=100), timeout=5
    )
    await first.close()  # stopped with the session in flight

    second = await start_broker(redis_server.url, key_prefix, registry_target=registry.target)
    try:
        again = await second.stub.OpenSession(
            open_request("req-1", who=caller("d1", d1)), timeout=5
        )
        assert (again.created, again.session.state, again.session.bytes_done) == (
            False,
            k.SESSION_STATE_TRANSFERRING,
            100,
        )
        watch = asyncio.create_task(watch_until_terminal(second, sid))
        await second.stub.ReportProgress(
            k.ReportProgressRequest(session_id=sid, caller=caller("p1", p1), bytes_done=GIB),
            timeout=5,
        )
        await second.stub.CompleteSession(
            k.CompleteSessionRequest(session_id=sid, caller=caller("d1", d1)), timeout=5
        )
        seen = await watch
        assert [(s.state, s.version) for s in seen][-1] == (k.SESSION_STATE_COMPLETE, 4)
    finally:
        await second.close()


async def test_redis_down_unavailable_not_serving_then_recovery(tmp_path: Path) -> None:
    redis = EmbeddedRedis(tmp_path / "redis", persist=True).start()
    registry = await start_registry(redis.url, "hpd")
    reg_channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    broker = await start_broker(redis.url, "hpd")
    health = health_pb2_grpc.HealthStub(broker.channel)

    async def status() -> int:
        resp = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2)
        return int(resp.status)

    try:
        reg_stub = r_grpc.RegistryServiceStub(reg_channel)
        p1, session = await open_p1_to_d1(reg_stub, broker)
        sid = session.session_id
        acked = await broker.stub.ReportProgress(
            k.ReportProgressRequest(session_id=sid, caller=caller("p1", p1), bytes_done=7),
            timeout=5,
        )
        await eventually(lambda: _is(status, health_pb2.HealthCheckResponse.SERVING))

        redis.stop()
        for call in (
            broker.stub.GetSession(k.GetSessionRequest(session_id=sid), timeout=5),
            broker.stub.OpenSession(open_request("req-2", who=caller("p1", p1)), timeout=5),
            broker.stub.ReportProgress(
                k.ReportProgressRequest(session_id=sid, caller=caller("p1", p1), bytes_done=8),
                timeout=5,
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await eventually(lambda: _is(status, health_pb2.HealthCheckResponse.NOT_SERVING))

        redis.start()
        await eventually(lambda: _is(status, health_pb2.HealthCheckResponse.SERVING))
        got = await broker.stub.GetSession(k.GetSessionRequest(session_id=sid), timeout=5)
        assert got.session == acked.session  # nothing acknowledged was lost
        more = await broker.stub.ReportProgress(
            k.ReportProgressRequest(session_id=sid, caller=caller("p1", p1), bytes_done=9),
            timeout=5,
        )
        assert (more.session.bytes_done, more.session.version) == (9, acked.session.version + 1)
    finally:
        await broker.close()
        await reg_channel.close()
        await stop_server(registry)
        redis.stop()


async def _is(status: Callable[[], Awaitable[int]], want: int) -> bool:
    return await status() == want


async def test_redis_refusing_writes_answers_unavailable_and_the_sweepers_carry_on(
    tmp_path: Path,
) -> None:
    """Redis at its memory limit refuses every script (OOM): the RPCs answer UNAVAILABLE, and
    the broker's and the registry's sweepers, failing meanwhile, resume once it accepts
    writes again: an overdue session expires and a silent worker's lease ends."""
    redis = EmbeddedRedis(tmp_path / "redis", persist=False).start()
    registry = await start_registry(redis.url, "hpd")
    reg_channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    broker = await start_broker(redis.url, "hpd")
    admin = redis_conn.connect(redis.url)
    try:
        reg_stub = r_grpc.RegistryServiceStub(reg_channel)
        await register(reg_stub, "silent", lease_ttl_ms=300)
        p1, session = await open_p1_to_d1(reg_stub, broker, deadline_ms=1_000)
        sid = session.session_id

        await admin.config_set("maxmemory", 1)  # before the deadline: no sweep expired it yet
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await broker.stub.ReportProgress(
                k.ReportProgressRequest(session_id=sid, caller=caller("p1", p1), bytes_done=7),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        await asyncio.sleep(1.2)  # both are overdue now; every sweep meanwhile was refused
        still = await broker.stub.GetSession(k.GetSessionRequest(session_id=sid), timeout=5)
        assert still.session.state == k.SESSION_STATE_NEGOTIATED  # not expired under OOM
        await admin.config_set("maxmemory", 0)

        async def expired() -> bool:
            got = await broker.stub.GetSession(k.GetSessionRequest(session_id=sid), timeout=5)
            assert got.session.state in (k.SESSION_STATE_NEGOTIATED, k.SESSION_STATE_EXPIRED), (
                got.session
            )
            return bool(got.session.state == k.SESSION_STATE_EXPIRED)

        async def silent_gone() -> bool:
            try:
                await reg_stub.GetWorker(r.GetWorkerRequest(worker_id="silent"), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return bool(exc.code() == grpc.StatusCode.NOT_FOUND)
            return False

        await eventually(expired)
        await eventually(silent_gone)
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()
        await broker.close()
        await reg_channel.close()
        await stop_server(registry)
        redis.stop()


async def test_a_stopping_broker_ends_watch_streams_with_unavailable(tmp_path: Path) -> None:
    """A WatchSession lasts as long as its transfer; a stopping broker ends it with
    UNAVAILABLE and the version to resume from, instead of holding shutdown for the grace."""
    redis = EmbeddedRedis(tmp_path / "redis", persist=False).start()
    registry = await start_registry(redis.url, "hpd")
    reg_channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    broker = await start_broker(redis.url, "hpd")
    try:
        reg_stub = r_grpc.RegistryServiceStub(reg_channel)
        _, session = await open_p1_to_d1(reg_stub, broker)
        watch = broker.stub.WatchSession(k.WatchSessionRequest(session_id=session.session_id))
        assert (await asyncio.wait_for(watch.read(), 5)).session.version == 1
        t0 = asyncio.get_running_loop().time()
        await broker.server.stop(10)
        took = asyncio.get_running_loop().time() - t0
        assert took < 5, f"stopping took {took:.1f} s of its 10 s grace"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(watch.read(), 5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "from version 1" in (err.value.details() or "")
        # a watch that subscribes after the stop began ends too, after the current state
        broker.service.drain()
        late = broker.service.watch(session.session_id, "", 0)
        assert (await anext(late)).version == 1
        with pytest.raises(Unavailable):
            await anext(late)
    finally:
        await broker.close()
        await reg_channel.close()
        await stop_server(registry)
        redis.stop()
