"""The scheduler inside the gateway (``hpd_gateway/embedded_client.py``) is one more replica: two
gateways planning in their own processes' replicas and the scheduler service, all on one
Redis, never hold more than a decode worker's limit however the requests race; a plan
either gateway made is the service's to read (``GetRouteRecord``), and an outcome a gateway
reports releases it there.

Each gateway here is the product's ``ControlPlane`` (what ``hpd gateway`` plans with), with
a replica of its own: its own fleet view, Redis client and reservation mirror, refreshed
only once a minute, so each believes the worker emptier than it is and only the check in
Redis stands between the three and an over-commit."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.channels import CallIdentity
from hpd_gateway.control_client import ControlPlane as GatewayControl
from hpd_gateway.embedded_client import replica_settings
from hpd_gateway.plan import Outcome, Plan
from hpd_gateway.protocol import GatewayError
from hpd_tools.controlplane import ControlPlane
from tests.support.fleet import load
from tests.support.scheduler import register, reservations_held, sched, status_of
from tests.support.servers import RegistryHandle, external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own servers"),
]

K = 5
PER_REQUEST_BYTES = (1000 + 24) * 128 * 1024  # llama-3-8b bf16: 128 KiB per token
MODEL = "llama-3-8b"


held = reservations_held


@contextlib.asynccontextmanager
async def gateways(
    plane: ControlPlane, tmp_path: Path, n: int
) -> AsyncIterator[list[GatewayControl]]:
    """``n`` gateways' control sides, each with an embedded replica on the plane's Redis."""
    config = tmp_path / "replica.yaml"
    config.write_text(
        f"key_prefix: {plane.settings.key_prefix}\n"
        "reservation_sync_interval_ms: 60000\n"
        "fleet_rebuild_interval_ms: 5\n"
        "directive_interval_ms: 0\n"
    )
    out = []
    for _ in range(n):
        settings = replica_settings(
            str(config), plane.settings.redis_url, plane.registry_target,
            plane.kvbroker_target, CallIdentity(),
        )  # fmt: skip
        out.append(GatewayControl("", plane.kvbroker_target, plane.registry_target,
                                  timeout_s=10, embedded=settings))  # fmt: skip
    try:
        for g in out:
            await g.start()
        yield out
    finally:
        for g in out:
            await g.close()


async def views_hold(gws: list[GatewayControl], wid: str) -> None:
    deadline = time.monotonic() + 10
    for g in gws:
        assert g.embedded is not None
        svc = g.embedded.service
        while not (wid in svc.informer.workers and svc.informer.workers[wid].load):
            assert time.monotonic() < deadline, "a replica never saw the worker"
            await asyncio.sleep(0.02)
        svc.rebuild()


async def plan_at(g: GatewayControl, rid: str) -> Plan | GatewayError:
    try:
        return await g.schedule(rid, MODEL, 1000, 24, "")
    except GatewayError as exc:
        return exc


async def test_two_embedded_gateways_and_the_service_never_hold_more_than_k(
    plane: ControlPlane, tmp_path: Path
) -> None:
    prefix = plane.settings.key_prefix
    async with (
        grpc.aio.insecure_channel(plane.registry_target) as reg_ch,
        grpc.aio.insecure_channel(plane.scheduler_target) as sched_ch,
        gateways(plane, tmp_path, 2) as gws,
    ):
        reg = RegistryHandle(plane.registry_target, reg_ch, r_grpc.RegistryServiceStub(reg_ch),
                             None, prefix)  # fmt: skip
        wid = f"{prefix}-small"
        # room for exactly K requests of 1,024 tokens: K x 128 MiB of free KV
        await register(
            reg, wid, load(free=1000, total=1000), pool_id="small-decode",
            stages=(c.STAGE_DECODE,), kv_gib=K * PER_REQUEST_BYTES / 2**30,
        )  # fmt: skip
        await views_hold(gws, wid)
        service = s_grpc.SchedulerServiceStub(sched_ch)
        deadline = time.monotonic() + 10
        while wid not in {w.worker_id for w in (await service.GetRecommendations(
                s.GetRecommendationsRequest(), timeout=5)).workers}:  # fmt: skip
            assert time.monotonic() < deadline, "the service never saw the worker"
            await asyncio.sleep(0.05)

        async def at_service(rid: str) -> Any:
            code, resp = await status_of(
                service.Schedule(sched(rid, prompt=1000, output=24), timeout=10)
            )
            return resp.plan if code == grpc.StatusCode.OK else code

        calls = [
            plan_at(gws[i % 3], f"k-{i}") if i % 3 < 2 else at_service(f"k-{i}")
            for i in range(6 * K)
        ]
        results = await asyncio.gather(*calls)
        granted = {f"k-{i}": r for i, r in enumerate(results)
                   if isinstance(r, (Plan, s.RoutePlan))}  # fmt: skip
        odd = [r for r in results if isinstance(r, GatewayError) and r.status != 429]
        odd += [r for r in results if isinstance(r, grpc.StatusCode)
                and r is not grpc.StatusCode.RESOURCE_EXHAUSTED]  # fmt: skip
        assert not odd, odd[:3]
        assert 1 <= len(granted) <= K
        assert await held(plane.settings.redis_url, prefix) == len(granted)
        by_gateway = [rid for rid, p in granted.items() if isinstance(p, Plan)]
        assert by_gateway, "the gateways' replicas planned nothing"
        # a plan a gateway made is the service's to read, with the replica that made it
        replicas = {g.embedded.service.scheduler_id for g in gws if g.embedded is not None}
        for rid in by_gateway:
            got = await service.GetRouteRecord(s.GetRouteRecordRequest(request_id=rid), timeout=5)
            assert got.record.decision != s.ROUTE_DECISION_REJECT, got.record
            assert got.record.plan.decode_worker_id == wid
            assert got.record.scheduler_id in replicas, got.record.scheduler_id
        # and a gateway's outcome releases it: one place frees again for the next request
        before = await held(plane.settings.redis_url, prefix)
        await gws[1].report(by_gateway[0], Outcome(success=True, ttft_ms=80.0, tpot_ms=20.0))
        assert await held(plane.settings.redis_url, prefix) == before - 1
        got = await service.GetRouteRecord(
            s.GetRouteRecordRequest(request_id=by_gateway[0]), timeout=5
        )
        assert got.record.HasField("outcome") and got.record.outcome.success
