"""The worker client library against a real registry: it registers, keeps its heartbeat
stream with load reports, receives directives, reports health, and registers again when
its lease is gone."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hpd_agent.worker_client import ClientTiming, WorkerClient
from hpd_common.clock import SystemClock
from hpd_common.worker_model import LoadReport
from tests.support.fleet import capability
from tests.support.servers import RegistryHandle


async def until(cond: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_client_heartbeats_takes_directives_and_re_registers(
    registry: RegistryHandle,
) -> None:
    got: list[c.Directive] = []
    wid = f"{registry.prefix}-w0"
    client = WorkerClient(
        capability(wid),
        registry.channel,
        registry.channel,
        load_fn=lambda: LoadReport(queue_depth=3, queue_max=64, batch_size=5),
        clock=SystemClock(),
        rng=random.Random(1),
        on_directive=got.append,
        lease_ttl_ms=2_000,
        timing=ClientTiming(report_interval_s=0.05, max_backoff_s=0.2),
    )
    await client.start()
    try:
        await asyncio.wait_for(client.connected.wait(), 5)

        async def reported() -> bool:
            w = (await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid))).worker
            return bool(w.load.queue_depth == 3 and w.load.reported_at_unix_ms > 0)

        await until(reported)

        await registry.stub.SendDirective(
            r.SendDirectiveRequest(
                worker_id=wid,
                directive=c.Directive(kind=c.DIRECTIVE_KIND_SET_MAX_BATCH_SIZE, max_batch_size=64),
            )
        )

        async def directed() -> bool:
            return any(d.max_batch_size == 64 for d in got)

        await until(directed)

        client.set_health(False, "ecc errors")

        async def unhealthy() -> bool:
            w = (await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid))).worker
            return bool(w.status.health == c.HEALTH_STATE_UNHEALTHY)

        await until(unhealthy)
        client.set_health(True)

        # the registry forgets the worker (as after a lapsed lease): the client registers again
        await registry.stub.DeregisterWorker(
            r.DeregisterWorkerRequest(worker_id=wid, credential=client.credential)
        )

        async def back() -> bool:
            try:
                await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid))
            except Exception:
                return False
            return client.registrations >= 2

        await until(back)
    finally:
        await client.stop()
    with pytest.raises(ValueError):
        client.set_health(False)
