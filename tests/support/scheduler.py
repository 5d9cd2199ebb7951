"""The scheduler harness its component, integration and e2e tests share: a scheduler on
port 0 over the suite's Redis and registry (`start_scheduler`, `own_scheduler`, the
`scheduler` fixture, which honours HPD_SCHEDULER_ADDR), registering workers, building
requests, and the fleets the tests explain plans against."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common import redis_conn
from hpd_common.server import GrpcServer
from hpd_scheduler.service import SchedulerService
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.fleet import capability, load
from tests.support.servers import RegistryHandle, external, stop_server


@dataclass
class SchedulerHandle:
    target: str
    channel: grpc.aio.Channel
    stub: s_grpc.SchedulerServiceStub
    server: GrpcServer | None
    registry: RegistryHandle

    @property
    def service(self) -> SchedulerService | None:
        if self.server is None:
            return None
        svc: SchedulerService = self.server.component.service  # type: ignore[attr-defined]
        return svc

    async def settle(self, worker_ids: list[str], timeout_s: float = 5.0) -> None:
        """Wait until the scheduler's view holds these workers as registered (and their
        latest load), then rebuild the snapshot now."""
        svc = self.service
        if svc is None:
            await asyncio.sleep(1.5)  # external scheduler: one rebuild interval and then some
            return
        want = {
            w: (
                await self.registry.stub.GetWorker(r.GetWorkerRequest(worker_id=w), timeout=5)
            ).worker.revision
            for w in worker_ids
        }
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = svc.informer.workers
            if all(w in seen and seen[w].revision >= rev for w, rev in want.items()):
                svc.rebuild()
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"scheduler never saw {sorted(want)}")


async def start_scheduler(
    redis_url: str, prefix: str, registry: str, **overrides: Any
) -> GrpcServer:
    from hpd_scheduler.__main__ import build_server
    from hpd_scheduler.settings import SchedulerSettings

    defaults: dict[str, Any] = {
        "staleness_bound_ms": 3_000,
        "fleet_rebuild_interval_ms": 5,
        "reservation_sync_interval_ms": 100,
        "directive_interval_ms": 0,
        "informer_max_backoff_ms": 200,
        "scheduler_id": "test",
    }
    defaults.update(overrides)
    settings = SchedulerSettings(
        port=0, redis_url=redis_url, key_prefix=prefix, registry_target=registry, **defaults
    )
    server = build_server(settings, redis_conn.connect(redis_url))
    server._probe_interval_s = 0.1
    await server.start()
    return server


@contextlib.asynccontextmanager
async def own_scheduler(
    redis_url: str, registry: RegistryHandle, **overrides: Any
) -> AsyncIterator[SchedulerHandle]:
    """A scheduler of the test's own (settings overridden) and a handle on it."""
    server = await start_scheduler(redis_url, registry.prefix, registry.target, **overrides)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield SchedulerHandle(
            f"127.0.0.1:{server.port}", channel, s_grpc.SchedulerServiceStub(channel), server,
            registry,
        )  # fmt: skip
    finally:
        await channel.close()
        await stop_server(server)


@pytest.fixture
async def scheduler(
    redis_server: EmbeddedRedis, registry: RegistryHandle
) -> AsyncIterator[SchedulerHandle]:
    addr = external("scheduler")
    server = None
    if addr is None:
        server = await start_scheduler(redis_server.url, registry.prefix, registry.target)
        addr = f"127.0.0.1:{server.port}"
    channel = grpc.aio.insecure_channel(addr)
    try:
        yield SchedulerHandle(addr, channel, s_grpc.SchedulerServiceStub(channel), server, registry)
    finally:
        await channel.close()
        if server is not None:
            await stop_server(server)


async def register(
    reg: RegistryHandle, wid: str, report: c.LoadReport | None = None, **kw: Any
) -> str:
    """Registers a worker (and sends one load report); returns its credential."""
    resp = await reg.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(wid, **kw), lease_ttl_ms=60_000), timeout=5
    )
    if report is not None:
        await reg.stub.Heartbeat(
            r.HeartbeatRequest(worker_id=wid, credential=resp.credential, load=report), timeout=5
        )
    return str(resp.credential)


async def status_of(awaitable: Any) -> tuple[grpc.StatusCode, Any]:
    try:
        return grpc.StatusCode.OK, await awaitable
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc


def sched(rid: str, prompt: int = 1000, output: int = 200, **kw: Any) -> s.ScheduleRequest:
    return s.ScheduleRequest(
        request_id=rid,
        model_id=kw.pop("model", "llama-3-8b"),
        prompt_tokens=prompt,
        expected_output_tokens=output,
        **kw,
    )


IDLE = load(queue=0, batch=4, free=900, total=1000)


async def hetero_fleet(h: SchedulerHandle) -> list[str]:
    """H100 and L4 prefill pools, H200 and L40S decode pools, all in one rack."""
    p = h.registry.prefix
    spec = [
        (f"{p}-h100-p{i}", "h100-prefill", (c.STAGE_PREFILL,), "H100-SXM") for i in range(2)
    ] + [
        (f"{p}-l4-p{i}", "l4-prefill", (c.STAGE_PREFILL,), "L4") for i in range(2)
    ] + [
        (f"{p}-h200-d{i}", "h200-decode", (c.STAGE_DECODE,), "H200") for i in range(2)
    ] + [
        (f"{p}-l40s-d{i}", "l40s-decode", (c.STAGE_DECODE,), "L40S") for i in range(2)
    ]  # fmt: skip
    for wid, pool, stages, gpu in spec:
        await register(h.registry, wid, IDLE, pool_id=pool, stages=stages, gpu=gpu, kv_gib=40)
    ids = [w for w, *_ in spec]
    await h.settle(ids)
    return ids


async def saturated_worker(h: SchedulerHandle) -> str:
    """One worker serving both stages with 2% of its KV free: a batch-tier request is
    refused RESOURCE_EXHAUSTED with a retry delay."""
    wid = f"{h.registry.prefix}-full"
    await register(
        h.registry, wid, load(free=20, total=1000), pool_id="tiny",
        stages=(c.STAGE_PREFILL, c.STAGE_DECODE),
    )  # fmt: skip
    await h.settle([wid])
    return wid


async def reservations_held(redis_url: str, prefix: str) -> int:
    """How many reservations the scheduler replicas hold in Redis under ``prefix``."""
    from hpd_common import redis_conn
    from hpd_scheduler.keys import SchedulerKeys

    client = redis_conn.connect(redis_url)
    try:
        return int(await client.hlen(SchedulerKeys(prefix).reservations))
    finally:
        await client.aclose()
