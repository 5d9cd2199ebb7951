"""Shared reservations: two scheduler processes on one Redis never over-commit a worker.

The two replicas run as separate OS processes (`python -m hpd_scheduler`), each with its
own mirror of the reservations; their mirrors are refreshed only once a minute here, so
each replica believes the decode worker is emptier than it is and only the atomic check
in Redis stands between them and an over-commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.fleet import load
from tests.support.scheduler import (
    SchedulerHandle,
    own_scheduler,
    register,
    reservations_held,
    sched,
    status_of,
)
from tests.support.servers import RegistryHandle

ROOT = Path(__file__).resolve().parents[2]
K = 5
PER_REQUEST_BYTES = (1000 + 24) * 128 * 1024  # llama-3-8b bf16: 128 KiB per token


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(params=["group-commit", "one-call-each"])
async def replicas(
    request: pytest.FixtureRequest, redis_server: EmbeddedRedis, registry: RegistryHandle
) -> AsyncIterator[list[str]]:
    """Two scheduler processes on the suite's Redis and the test's registry, with group
    commit (the default) and without it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        str(ROOT / "services" / d) for d in ("common", "registry", "scheduler", "kvbroker")
    )
    procs: list[subprocess.Popen[bytes]] = []
    targets = []
    for i in range(2):
        port = free_port()
        args = [
            sys.executable, "-m", "hpd_scheduler", "--port", str(port),
            "--redis-url", redis_server.url, "--key-prefix", registry.prefix,
            "--registry-target", registry.target, "--reservation-sync-interval-ms", "60000",
            "--fleet-rebuild-interval-ms", "5", "--directive-interval-ms", "0",
            "--scheduler-id", f"replica-{i}", "--log-level", "warning",
            "--shutdown-grace-s", "0",
        ]  # fmt: skip
        if request.param == "one-call-each":
            args += ["--group-commit-max-batch", "1"]
        if i == 1:  # one plan only: a worker found full refuses at once (a record still)
            args += ["--max-plan-attempts", "1"]
        procs.append(subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL))  # noqa: ASYNC220
        targets.append(f"127.0.0.1:{port}")
    try:
        yield targets
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, 5)
            except subprocess.TimeoutExpired:
                p.kill()
                await asyncio.to_thread(p.wait, 5)


async def wait_serving(target: str, timeout_s: float = 20.0) -> None:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{target} never became SERVING")


async def small_decode_worker(registry: RegistryHandle) -> str:
    wid = f"{registry.prefix}-small"
    # room for exactly K requests of 1,024 tokens: K x 128 MiB of free KV
    await register(
        registry, wid, load(free=1000, total=1000), pool_id="small-decode",
        stages=(c.STAGE_DECODE,), kv_gib=K * PER_REQUEST_BYTES / 2**30,
    )  # fmt: skip
    return wid


held = reservations_held


async def capacity_comes_back(
    stubs: list[s_grpc.SchedulerServiceStub], ok: list[Any], redis_url: str, prefix: str
) -> None:
    """Outcomes give the capacity back, to either replica (the planner keeps 20% headroom
    over a request's KV, so with the worker full two releases are needed before a third
    request fits again)."""
    for resp in ok[:2]:
        rel = await stubs[1].ReportOutcome(
            s.ReportOutcomeRequest(
                request_id=resp.plan.request_id, success=True, ttft_ms=80, tpot_ms=20
            )
        )
        assert rel.released
    code, _ = await status_of(stubs[0].Schedule(sched("k-after", prompt=1000, output=24)))
    assert code == grpc.StatusCode.OK
    assert await held(redis_url, prefix) == len(ok) - 1 <= K


@contextlib.asynccontextmanager
async def racing(
    replicas: list[str], registry: RegistryHandle
) -> AsyncIterator[list[s_grpc.SchedulerServiceStub]]:
    """The small decode worker, both replicas serving and holding it in their views: a
    stub for each."""
    wid = await small_decode_worker(registry)
    for t in replicas:
        await wait_serving(t)
    channels = [grpc.aio.insecure_channel(t) for t in replicas]
    try:
        stubs = [s_grpc.SchedulerServiceStub(ch) for ch in channels]
        await views_hold(stubs, wid)
        yield stubs
    finally:
        for ch in channels:
            await ch.close()


async def views_hold(stubs: list[s_grpc.SchedulerServiceStub], wid: str) -> None:
    """Until every replica's view holds the worker."""
    for stub in stubs:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            recs = await stub.GetRecommendations(s.GetRecommendationsRequest(), timeout=5)
            if wid in {w.worker_id for w in recs.workers}:
                break
            await asyncio.sleep(0.05)


async def test_two_processes_never_hold_more_than_k(
    replicas: list[str], registry: RegistryHandle, redis_server: EmbeddedRedis
) -> None:
    async with racing(replicas, registry) as stubs:
        calls = [
            status_of(stubs[i % 2].Schedule(sched(f"k-{i}", prompt=1000, output=24), timeout=10))
            for i in range(4 * K)
        ]
        results = await asyncio.gather(*calls)
        ok = [resp for code, resp in results if code == grpc.StatusCode.OK]
        odd = [
            r.details()
            for code, r in results
            if code not in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED)
        ]
        assert not odd, odd[:3]
        assert 1 <= len(ok) <= K
        assert await held(redis_server.url, registry.prefix) == len(ok) <= K
        # every refusal has its REJECT record, also one refused because each attempt found
        # the worker fully reserved by the other replica
        for i, (code, _) in enumerate(results):
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                got = await stubs[0].GetRouteRecord(
                    s.GetRouteRecordRequest(request_id=f"k-{i}"), timeout=5
                )
                assert got.record.decision == s.ROUTE_DECISION_REJECT, got.record
                assert got.record.reject_class == "saturated", got.record
        await capacity_comes_back(stubs, ok, redis_server.url, registry.prefix)


async def test_retries_racing_their_originals_never_hold_more_than_k(
    replicas: list[str], registry: RegistryHandle, redis_server: EmbeddedRedis
) -> None:
    """The same race with the first K ids sent again at once to the other replica: with
    group commit, batches then mix fresh, replayed and full entries."""
    async with racing(replicas, registry) as stubs:
        # 4K fresh ids, and the first K sent again at once to the other replica (retries
        # racing their originals: with group commit, batches mix fresh, full and replayed)
        sends = [(f"k-{i}", i % 2) for i in range(4 * K)] + [
            (f"k-{i}", (i + 1) % 2) for i in range(K)
        ]
        ids = [rid for rid, _ in sends]
        calls = [
            status_of(stubs[to].Schedule(sched(rid, prompt=1000, output=24), timeout=10))
            for rid, to in sends
        ]
        results = await asyncio.gather(*calls)
        odd = [
            r.details()
            for code, r in results
            if code not in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED)
        ]
        assert not odd, odd[:3]
        granted = {
            rid: resp
            for rid, (code, resp) in zip(ids, results, strict=True)
            if code == grpc.StatusCode.OK
        }
        ok = list(granted.values())
        assert 1 <= len(ok) <= K
        assert await held(redis_server.url, registry.prefix) == len(ok) <= K
        # an id granted twice (original and retry): the same plan
        for rid, (code, resp) in zip(ids, results, strict=True):
            if code == grpc.StatusCode.OK:
                assert resp.plan.decode_worker_id == granted[rid].plan.decode_worker_id
        # every refusal has its REJECT record, also one refused because each attempt found
        # the worker fully reserved by the other replica
        for rid in set(ids) - set(granted):
            got = await stubs[0].GetRouteRecord(s.GetRouteRecordRequest(request_id=rid), timeout=5)
            assert got.record.decision == s.ROUTE_DECISION_REJECT, got.record
            assert got.record.reject_class == "saturated", got.record
        await capacity_comes_back(stubs, ok, redis_server.url, registry.prefix)


@pytest.fixture
async def short_ttl_scheduler(
    redis_server: EmbeddedRedis, registry: RegistryHandle
) -> AsyncIterator[SchedulerHandle]:
    async with own_scheduler(
        redis_server.url, registry, reservation_ttl_ms=600, reservation_sync_interval_ms=100
    ) as h:
        yield h


async def test_capacity_returns_when_reservations_lapse(
    short_ttl_scheduler: SchedulerHandle, redis_server: EmbeddedRedis
) -> None:
    h = short_ttl_scheduler
    wid = await small_decode_worker(h.registry)
    await h.settle([wid])
    results = [
        await status_of(h.stub.Schedule(sched(f"ttl-{i}", prompt=1000, output=24), timeout=5))
        for i in range(K + 2)
    ]
    granted = [code for code, _ in results if code == grpc.StatusCode.OK]
    assert 1 <= len(granted) <= K
    assert results[-1][0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    await asyncio.sleep(0.9)  # past the TTL; the sync loop purges and mirrors
    code, resp = await status_of(h.stub.Schedule(sched("ttl-late", prompt=1000, output=24)))
    assert code == grpc.StatusCode.OK and resp.plan.decode_worker_id == wid
    assert await held(redis_server.url, h.registry.prefix) == 1
