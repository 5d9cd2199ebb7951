"""The registry over real gRPC (port 0) and a real Redis.

Runs against a local registry, or against HPD_REGISTRY_ADDR (the compose suite):
worker ids carry the test's unique prefix, so tests never see each other's workers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hpd_common.aio import cancel_and_wait
from hpd_registry.api import RegistryComponent
from tests.support.fleet import capability, load
from tests.support.servers import RegistryHandle, external


async def register(reg: RegistryHandle, wid: str, **kw: Any) -> r.RegisterWorkerResponse:
    ttl = kw.pop("lease_ttl_ms", 0)
    cred = kw.pop("credential", "")
    resp: r.RegisterWorkerResponse = await reg.stub.RegisterWorker(
        r.RegisterWorkerRequest(
            capability=capability(wid, **kw), credential=cred, lease_ttl_ms=ttl
        ),
        timeout=5,
    )
    return resp


async def code_of(awaitable: Any) -> grpc.StatusCode:
    try:
        await awaitable
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_register_then_get_and_list(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-p1"
    resp = await register(registry, wid)
    assert resp.worker_id == wid
    assert resp.credential and resp.lease_ttl_ms > 0 and resp.revision > 0
    assert resp.heartbeat_interval_ms == resp.lease_ttl_ms // 3
    got = await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)
    assert got.worker.capability == capability(wid)
    assert got.worker.status.health == c.HEALTH_STATE_HEALTHY
    assert not got.worker.HasField("load")
    listed = await registry.stub.ListWorkers(
        r.ListWorkersRequest(pool_id="h100-prefill"), timeout=5
    )
    assert wid in [w.capability.worker_id for w in listed.workers]


async def test_reregister_with_credential_is_idempotent(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-idem"
    first = await register(registry, wid)
    again = await register(registry, wid, credential=first.credential)
    assert again.changed is False
    assert again.revision == first.revision
    assert again.credential == first.credential
    changed = await register(registry, wid, credential=first.credential, kv_gib=20)
    assert changed.changed is True and changed.revision > first.revision
    got = await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)
    assert got.worker.capability.kv_memory_total_bytes == 20 * 2**30


async def test_claiming_live_id_without_credential_is_refused(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-claim"
    await register(registry, wid)
    assert await code_of(register(registry, wid)) == grpc.StatusCode.ALREADY_EXISTS
    assert await code_of(register(registry, wid, credential="forged")) == (
        grpc.StatusCode.ALREADY_EXISTS
    )


async def test_only_the_credential_holder_acts_as_the_worker(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-auth"
    reg = await register(registry, wid)
    bad = r.HeartbeatRequest(worker_id=wid, credential="wrong")
    assert (
        await code_of(registry.stub.Heartbeat(bad, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    )
    dereg = r.DeregisterWorkerRequest(worker_id=wid, credential="wrong")
    assert await code_of(registry.stub.DeregisterWorker(dereg, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    ok = r.DeregisterWorkerRequest(worker_id=wid, credential=reg.credential)
    await registry.stub.DeregisterWorker(ok, timeout=5)
    assert await code_of(registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)) == (
        grpc.StatusCode.NOT_FOUND
    )


async def test_heartbeat_stores_load_with_its_time(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-hb"
    reg = await register(registry, wid)
    report = load(queue=7, batch=12, free=300, total=1000)
    report.reported_at_unix_ms = 0
    await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=reg.credential, load=report), timeout=5
    )
    got = (await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)).worker
    assert got.load.queue_depth == 7 and got.load.batch_size == 12
    assert got.load.reported_at_unix_ms > 0  # stamped with the receive time
    assert got.status.last_heartbeat_unix_ms >= got.status.registered_at_unix_ms


async def test_worker_reports_unhealthy_and_recovers(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-sick"
    reg = await register(registry, wid)
    resp = await registry.stub.Heartbeat(
        r.HeartbeatRequest(
            worker_id=wid,
            credential=reg.credential,
            reported_health=c.HEALTH_STATE_UNHEALTHY,
            health_reason="ecc_error",
        ),
        timeout=5,
    )
    assert resp.health == c.HEALTH_STATE_UNHEALTHY
    got = (await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)).worker
    assert got.status.health == c.HEALTH_STATE_UNHEALTHY
    assert got.status.health_reason == "ecc_error"
    resp = await registry.stub.Heartbeat(
        r.HeartbeatRequest(
            worker_id=wid, credential=reg.credential, reported_health=c.HEALTH_STATE_HEALTHY
        ),
        timeout=5,
    )
    assert resp.health == c.HEALTH_STATE_HEALTHY


async def test_drain_cordon_uncordon(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-ops"
    reg = await register(registry, wid)
    w = (
        await registry.stub.CordonWorker(
            r.CordonWorkerRequest(worker_id=wid, reason="maint"), timeout=5
        )
    ).worker
    assert w.status.health == c.HEALTH_STATE_CORDONED and w.status.health_reason == "maint"
    w = (
        await registry.stub.DrainWorker(
            r.DrainWorkerRequest(worker_id=wid, reason="upgrade"), timeout=5
        )
    ).worker
    assert w.status.health == c.HEALTH_STATE_DRAINING and w.status.draining
    hb = await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=reg.credential), timeout=5
    )
    assert hb.health == c.HEALTH_STATE_DRAINING
    assert [d.kind for d in hb.directives] == [c.DIRECTIVE_KIND_DRAIN]
    w = (
        await registry.stub.UncordonWorker(r.UncordonWorkerRequest(worker_id=wid), timeout=5)
    ).worker
    assert w.status.health == c.HEALTH_STATE_HEALTHY
    listed = await registry.stub.ListWorkers(
        r.ListWorkersRequest(health=c.HEALTH_STATE_DRAINING, pool_id="h100-prefill"), timeout=5
    )
    assert wid not in [x.capability.worker_id for x in listed.workers]
    missing = r.DrainWorkerRequest(worker_id=registry.prefix + "-nobody")
    assert await code_of(registry.stub.DrainWorker(missing, timeout=5)) == grpc.StatusCode.NOT_FOUND


async def test_list_filters_and_pagination(registry: RegistryHandle) -> None:
    pool = registry.prefix + "-pool"
    ids = [f"{registry.prefix}-w{i:02d}" for i in range(25)]
    for i, wid in enumerate(ids):
        stage = c.STAGE_DECODE if i % 2 else c.STAGE_PREFILL
        await register(
            registry,
            wid,
            pool_id=pool,
            stages=(stage,),
            labels={"parity": "odd" if i % 2 else "even"},
        )
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        resp = await registry.stub.ListWorkers(
            r.ListWorkersRequest(pool_id=pool, page_size=7, page_token=token), timeout=5
        )
        assert len(resp.workers) <= 7
        seen += [w.capability.worker_id for w in resp.workers]
        pages += 1
        token = resp.next_page_token
        if not token:
            break
    assert seen == sorted(ids) and pages == 4
    decode = await registry.stub.ListWorkers(
        r.ListWorkersRequest(pool_id=pool, stage=c.STAGE_DECODE), timeout=5
    )
    assert [w.capability.worker_id for w in decode.workers] == ids[1::2]
    odd = await registry.stub.ListWorkers(
        r.ListWorkersRequest(pool_id=pool, labels={"parity": "odd"}), timeout=5
    )
    assert [w.capability.worker_id for w in odd.workers] == ids[1::2]
    pools = await registry.stub.ListPools(r.ListPoolsRequest(), timeout=5)
    mine = [p for p in pools.pools if p.pool_id == pool]
    assert mine and mine[0].worker_count == 25
    assert mine[0].workers_by_health["HEALTHY"] == 25


async def test_send_directive_delivered_on_next_unary_heartbeat(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-dir"
    reg = await register(registry, wid)
    sent = await registry.stub.SendDirective(
        r.SendDirectiveRequest(
            worker_id=wid,
            directive=c.Directive(
                kind=c.DIRECTIVE_KIND_SET_MAX_BATCH_SIZE,
                max_batch_size=96,
                reason="itl_p99_high",
                issuer="scheduler",
            ),
        ),
        timeout=5,
    )
    assert sent.directive_id
    hb = await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=reg.credential), timeout=5
    )
    assert [(d.directive_id, d.max_batch_size) for d in hb.directives] == [(sent.directive_id, 96)]
    # not acked (the answer may have been lost): delivered again
    hb = await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=reg.credential), timeout=5
    )
    assert [d.directive_id for d in hb.directives] == [sent.directive_id]
    hb = await registry.stub.Heartbeat(
        r.HeartbeatRequest(
            worker_id=wid, credential=reg.credential, acked_directive_ids=[sent.directive_id]
        ),
        timeout=5,
    )
    assert list(hb.directives) == []  # acked: gone


async def test_stream_heartbeats_ack_then_directive(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-stream"
    reg = await register(registry, wid)
    outbox: asyncio.Queue[r.StreamHeartbeatsRequest | None] = asyncio.Queue()
    await outbox.put(
        r.StreamHeartbeatsRequest(worker_id=wid, credential=reg.credential, load=load(queue=1))
    )

    async def requests() -> Any:
        while (m := await outbox.get()) is not None:
            yield m

    call = registry.stub.StreamHeartbeats(requests())
    first = await asyncio.wait_for(call.read(), 5)
    assert first.WhichOneof("event") == "ack"
    await registry.stub.SendDirective(
        r.SendDirectiveRequest(
            worker_id=wid,
            directive=c.Directive(
                kind=c.DIRECTIVE_KIND_THROTTLE, fraction=0.5, reason="memory_pressure"
            ),
        ),
        timeout=5,
    )
    while True:
        msg = await asyncio.wait_for(call.read(), 5)
        if msg.WhichOneof("event") == "directive":
            break
    assert msg.directive.kind == c.DIRECTIVE_KIND_THROTTLE and msg.directive.fraction == 0.5
    await outbox.put(r.StreamHeartbeatsRequest(load=load(queue=9)))
    for _ in range(50):
        got = (await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)).worker
        if got.load.queue_depth == 9:
            break
        await asyncio.sleep(0.05)
    assert got.load.queue_depth == 9
    await outbox.put(None)
    call.cancel()


@pytest.mark.skipif(external("registry") is not None, reason="restarts the registry's listener")
async def test_a_directive_sent_while_the_listener_resubscribes_still_arrives(
    registry: RegistryHandle,
) -> None:
    """The registry hears of new directives by pub/sub. One published while its listener
    is not subscribed (after a Redis error) is not heard; the stream must still deliver it
    without waiting for the worker's next report to mention it."""
    wid = registry.prefix + "-gap"
    reg = await register(registry, wid)
    outbox: asyncio.Queue[r.StreamHeartbeatsRequest | None] = asyncio.Queue()
    await outbox.put(r.StreamHeartbeatsRequest(worker_id=wid, credential=reg.credential))

    async def requests() -> Any:
        while (m := await outbox.get()) is not None:
            yield m

    call = registry.stub.StreamHeartbeats(requests())
    assert (await asyncio.wait_for(call.read(), 5)).WhichOneof("event") == "ack"
    assert registry.server is not None
    component = registry.server.component
    assert isinstance(component, RegistryComponent)
    svc = component.service
    (listener,) = [t for t in svc._tasks if t.get_name() == "registry-directives"]
    await cancel_and_wait([listener])
    await registry.stub.SendDirective(
        r.SendDirectiveRequest(
            worker_id=wid, directive=c.Directive(kind=c.DIRECTIVE_KIND_DRAIN, reason="gap")
        ),
        timeout=5,
    )
    svc._tasks.append(asyncio.create_task(svc._directive_listener()))
    while True:  # no further report is sent: only the listener's resubscription can tell
        msg = await asyncio.wait_for(call.read(), 3)
        if msg.WhichOneof("event") == "directive":
            break
    assert (msg.directive.kind, msg.directive.reason) == (c.DIRECTIVE_KIND_DRAIN, "gap")
    await outbox.put(None)
    call.cancel()


async def test_stream_with_wrong_credential_is_refused(registry: RegistryHandle) -> None:
    wid = registry.prefix + "-streambad"
    await register(registry, wid)

    async def requests() -> Any:
        yield r.StreamHeartbeatsRequest(worker_id=wid, credential="nope")

    call = registry.stub.StreamHeartbeats(requests())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(call.read(), 5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_health_service_reports_serving(registry: RegistryHandle) -> None:
    stub = health_pb2_grpc.HealthStub(registry.channel)
    for name in ("", "hetero_pd.v1.RegistryService"):
        for _ in range(50):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_heartbeat_renews_the_lease_the_worker_registered_with(
    registry: RegistryHandle,
) -> None:
    """A worker that asked for a long lease keeps it across heartbeats (the registry's
    default, 3 s in this suite, must not replace it)."""
    wid = registry.prefix + "-longlease"
    reg = await register(registry, wid, lease_ttl_ms=60_000)
    assert reg.lease_ttl_ms == 60_000
    hb = await registry.stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=reg.credential, load=load()), timeout=5
    )
    assert hb.lease_ttl_ms == 60_000
    got = (await registry.stub.GetWorker(r.GetWorkerRequest(worker_id=wid), timeout=5)).worker
    assert got.status.lease_ttl_ms == 60_000
    remaining = got.status.lease_expires_at_unix_ms - got.status.last_heartbeat_unix_ms
    assert remaining == 60_000
