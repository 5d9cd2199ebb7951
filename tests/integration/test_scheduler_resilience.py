"""Bursts spread out; the view's staleness bound holds while the registry or Redis is away."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc

from hetero_pd.v1 import common_pb2 as c
from hpd_common import redis_conn
from hpd_common.server import GrpcServer
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.fleet import load
from tests.support.scheduler import (
    SchedulerHandle,
    register,
    sched,
    start_scheduler,
    status_of,
)
from tests.support.servers import RegistryHandle, start_registry, stop_server


async def restart_registry(redis_url: str, prefix: str, port: int) -> GrpcServer:
    """A registry like the suite's, on a given port (the one a stopped registry held)."""
    from hpd_registry.__main__ import build_server
    from hpd_registry.settings import RegistrySettings

    settings = RegistrySettings(
        port=port, redis_url=redis_url, key_prefix=prefix, lease_ttl_ms=3_000,
        sweep_interval_ms=100, bookmark_interval_ms=200, min_lease_ttl_ms=100,
    )  # fmt: skip
    server = build_server(settings, redis_conn.connect(redis_url))
    await server.start()
    return server


def equal_report(at_ms: int) -> c.LoadReport:
    """One load report for every worker of a burst test, stamped at the same instant: the
    planner trusts an older report's inter-token latency less (its freshness weighs the
    correction), so reports stamped on arrival, seconds apart on a loaded machine, made
    equal workers unequal and the burst favoured the oldest (15 / 8). ``at_ms``: taken in
    the test, just before it registers them (a stamp taken at import was minutes old by
    then in a full run, past the staleness bound)."""
    report = load(free=1000, total=1000)
    report.reported_at_unix_ms = at_ms
    return report


async def test_burst_of_identical_requests_lands_on_every_decode_worker(
    redis_server: EmbeddedRedis, registry: RegistryHandle
) -> None:
    server = await start_scheduler(redis_server.url, registry.prefix, registry.target)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc

    h = SchedulerHandle("", channel, s_grpc.SchedulerServiceStub(channel), server, registry)
    try:
        ids = [f"{registry.prefix}-d{i}" for i in range(8)]
        at_ms = int(time.time() * 1000)
        for wid in ids:
            await register(registry, wid, equal_report(at_ms), pool_id="equal-decode",
                           stages=(c.STAGE_DECODE,))  # fmt: skip
        await h.settle(ids)
        results = await asyncio.gather(
            *(h.stub.Schedule(sched(f"burst-{i}", prompt=800, output=200), timeout=10)
              for i in range(100))
        )  # fmt: skip
        per_worker = Counter(r.plan.decode_worker_id for r in results)
        assert set(per_worker) == set(ids)
        assert max(per_worker.values()) - min(per_worker.values()) <= 4
    finally:
        await channel.close()
        await stop_server(server)


async def test_registry_away_then_stale_then_recovers(redis_server: EmbeddedRedis) -> None:
    prefix = "out" + str(int(time.time() * 1000) % 10**8)
    reg = await start_registry(redis_server.url, prefix)
    port = reg.port
    server = await start_scheduler(
        redis_server.url, prefix, f"127.0.0.1:{port}", staleness_bound_ms=1_500,
        informer_max_backoff_ms=200,
    )  # fmt: skip
    from hetero_pd.v1 import registry_pb2_grpc as r_grpc
    from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc

    rch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    handle = RegistryHandle(f"127.0.0.1:{port}", rch, r_grpc.RegistryServiceStub(rch), reg, prefix)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    h = SchedulerHandle("", channel, s_grpc.SchedulerServiceStub(channel), server, handle)
    try:
        wid = f"{prefix}-both"
        await register(handle, wid, load(), stages=(c.STAGE_PREFILL, c.STAGE_DECODE))
        await h.settle([wid])
        await stop_server(reg)
        # within the bound: still deciding from the last view
        code, _ = await status_of(h.stub.Schedule(sched("away-1"), timeout=5))
        assert code == grpc.StatusCode.OK
        await asyncio.sleep(1.8)  # past the bound
        code, exc = await status_of(h.stub.Schedule(sched("away-2"), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE, exc
        assert "staleness bound" in exc.details()
        assert h.service is not None and not h.service.ready()
        # the registry returns on the same port and Redis: the view recovers by itself
        reg = await restart_registry(redis_server.url, prefix, port)
        deadline = time.monotonic() + 10
        code = grpc.StatusCode.UNAVAILABLE
        exc = None
        while time.monotonic() < deadline and code != grpc.StatusCode.OK:
            await asyncio.sleep(0.1)
            code, exc = await status_of(h.stub.Schedule(sched("away-3"), timeout=5))
        assert code == grpc.StatusCode.OK, exc and exc.details()
    finally:
        await channel.close()
        await rch.close()
        await stop_server(server)
        await stop_server(reg)


async def test_redis_away_means_unavailable_not_an_unreserved_plan(
    tmp_path: object, registry: RegistryHandle
) -> None:
    """A private Redis for the scheduler, stopped mid-test: Schedule answers UNAVAILABLE
    (a plan whose reservation cannot be written could over-commit), the read-only RPCs
    answer from memory, and after Redis returns Schedule works again."""
    from pathlib import Path

    from hetero_pd.v1 import scheduler_pb2 as s
    from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc

    red = EmbeddedRedis(Path(str(tmp_path)), persist=True)
    red.start()
    server = await start_scheduler(red.url, registry.prefix, registry.target)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    h = SchedulerHandle("", channel, s_grpc.SchedulerServiceStub(channel), server, registry)
    try:
        wid = f"{registry.prefix}-both"
        await register(registry, wid, load(), stages=(c.STAGE_PREFILL, c.STAGE_DECODE))
        await h.settle([wid])
        assert (await status_of(h.stub.Schedule(sched("r-1"), timeout=5)))[0] == grpc.StatusCode.OK
        port = red.port
        red.stop()
        code, _ = await status_of(h.stub.Schedule(sched("r-2"), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
        pol = await h.stub.GetPolicy(s.GetPolicyRequest(), timeout=5)
        assert pol.policy.profile == "default"
        red = EmbeddedRedis(Path(str(tmp_path)), port=port, persist=True)
        red.start()
        deadline = time.monotonic() + 10
        code = grpc.StatusCode.UNAVAILABLE
        while time.monotonic() < deadline and code != grpc.StatusCode.OK:
            await asyncio.sleep(0.1)
            code, _ = await status_of(h.stub.Schedule(sched("r-3"), timeout=5))
        assert code == grpc.StatusCode.OK
    finally:
        await channel.close()
        await stop_server(server)
        red.stop()
