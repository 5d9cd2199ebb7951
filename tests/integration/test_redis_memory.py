"""Redis memory as a deployment sizes it: route records bounded by a count whatever the
request rate, and new plans refused (RESOURCE_EXHAUSTED) before Redis itself refuses
writes, while heartbeats go on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common import metrics
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.scheduler import (
    IDLE,
    SchedulerHandle,
    register,
    sched,
    start_scheduler,
    status_of,
)
from tests.support.servers import RegistryHandle, stop_server


async def handle(redis_server: EmbeddedRedis, registry: RegistryHandle, **kw: Any) -> Any:
    server = await start_scheduler(redis_server.url, registry.prefix, registry.target, **kw)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return SchedulerHandle(
        f"127.0.0.1:{server.port}", channel, s_grpc.SchedulerServiceStub(channel), server, registry
    )


@pytest.fixture
async def capped(
    redis_server: EmbeddedRedis, registry: RegistryHandle
) -> AsyncIterator[SchedulerHandle]:
    h = await handle(redis_server, registry, record_index_cap=5, reservation_ttl_ms=800)
    try:
        yield h
    finally:
        await h.channel.close()
        assert h.server is not None
        await stop_server(h.server)


async def fleet(h: SchedulerHandle) -> tuple[str, str]:
    p = h.registry.prefix
    pw, dw = f"{p}-mem-p", f"{p}-mem-d"
    await register(h.registry, pw, IDLE, pool_id="mem-prefill", stages=(c.STAGE_PREFILL,))
    cred = await register(h.registry, dw, IDLE, pool_id="mem-decode", stages=(c.STAGE_DECODE,))
    await h.settle([pw, dw])
    return dw, cred


async def record_exists(h: SchedulerHandle, rid: str) -> bool:
    code, _ = await status_of(h.stub.GetRouteRecord(s.GetRouteRecordRequest(request_id=rid)))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND), code
    return bool(code == grpc.StatusCode.OK)


async def test_records_past_the_cap_are_deleted_once_older_than_a_reservation(
    capped: SchedulerHandle,
) -> None:
    h = capped
    await fleet(h)
    for i in range(8):
        code, _ = await status_of(h.stub.Schedule(sched(f"cap-{i}", output=24), timeout=5))
        assert code == grpc.StatusCode.OK
    # over the cap, but every record is younger than a reservation's TTL: all kept (each
    # is the idempotency key of a plan that may still be retried)
    assert all([await record_exists(h, f"cap-{i}") for i in range(8)])
    await asyncio.sleep(0.9)
    code, _ = await status_of(h.stub.Schedule(sched("cap-8", output=24), timeout=5))
    assert code == grpc.StatusCode.OK
    kept = [await record_exists(h, f"cap-{i}") for i in range(9)]
    assert kept == [False] * 4 + [True] * 5  # the cap (5) holds, newest first


async def test_new_plans_are_refused_before_redis_refuses_writes(
    redis_server: EmbeddedRedis, registry: RegistryHandle
) -> None:
    h = await handle(redis_server, registry)
    admin = aioredis.Redis.from_url(redis_server.url)
    filler: list[str] = []
    try:
        dw, cred = await fleet(h)
        code, _ = await status_of(h.stub.Schedule(sched("mem-ok", output=24), timeout=5))
        assert code == grpc.StatusCode.OK
        # a 32 MB filler, so the few hundred KB Redis's own buffers move do not matter
        # (many small values: one big one is counted twice while its query buffer lives)
        filler += [f"{registry.prefix}:filler:{i}" for i in range(320)]
        async with admin.pipeline(transaction=False) as pipe:
            for key in filler:
                pipe.set(key, b"x" * 100_000)
            await pipe.execute()
        refused = None
        for i in range(200):  # the health probe reads memory about once a second
            if i % 20 == 0:
                # 95% used: past the 90% limit; set again about once a second, since keys of
                # earlier tests expiring in this shared Redis can take the ratio back under it
                used = int((await admin.info("memory"))["used_memory"])
                await admin.config_set("maxmemory", int(used / 0.95))
            code, err = await status_of(h.stub.Schedule(sched("mem-full", output=24), timeout=5))
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                refused = err
                break
            assert code == grpc.StatusCode.OK
            await asyncio.sleep(0.05)
        assert refused is not None, "never refused"
        assert "state store memory at" in refused.details()
        # the gauge per service follows the shared reading at that service's next probe
        gauge = metrics.REDIS_MEMORY_RATIO.labels(service="scheduler")
        for _ in range(40):
            if gauge._value.get() > 0:
                break
            await asyncio.sleep(0.05)
        ratio = gauge._value.get()
        assert 0.9 <= ratio < 1.0
        # Redis itself still takes writes: a worker's heartbeat is stored
        reply = await h.registry.stub.Heartbeat(
            r.HeartbeatRequest(worker_id=dw, credential=cred, load=IDLE), timeout=5
        )
        assert reply.lease_expires_at_unix_ms > 0
        await admin.config_set("maxmemory", 0)
        for _ in range(60):
            code, _ = await status_of(h.stub.Schedule(sched("mem-back", output=24), timeout=5))
            if code == grpc.StatusCode.OK:
                break
            await asyncio.sleep(0.05)
        assert code == grpc.StatusCode.OK
    finally:
        await admin.config_set("maxmemory", 0)
        if filler:
            await admin.delete(*filler)
        await admin.aclose()
        await h.channel.close()
        await stop_server(h.server)
