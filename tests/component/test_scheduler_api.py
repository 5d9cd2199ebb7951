"""The scheduler over real gRPC (port 0), a real registry and a real Redis.

A heterogeneous fleet is registered through the registry; the scheduler sees it through
its informer, and each test checks that the plan is the one the fleet explains:
prefill-heavy work goes to the compute-rich pool, decode-heavy work to the
bandwidth-rich pool, a slow link or KV that cannot be exchanged means recompute, an
unhealthy preferred pool means reroute, nothing executable means reject.

The harness these tests share with the other scheduler tests is `tests/support/scheduler.py`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import scheduler_pb2 as s
from hpd_common import redis_conn
from hpd_scheduler.store import UNREADABLE_EXPLANATION
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.fleet import load
from tests.support.scheduler import (
    IDLE,
    SchedulerHandle,
    hetero_fleet,
    register,
    saturated_worker,
    sched,
    status_of,
)
from tests.support.servers import RegistryHandle, external, stop_server

# The explainable-choice tests need a fleet of their own: a shared registry (the compose
# suite's) holds other tests' workers of the same model, which would change the choices.
pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="needs an isolated fleet"),
]


async def test_prefill_heavy_goes_to_the_compute_rich_pool(scheduler: SchedulerHandle) -> None:
    await hetero_fleet(scheduler)
    resp = await scheduler.stub.Schedule(sched("pf-1", prompt=8000, output=64), timeout=5)
    plan = resp.plan
    assert plan.resource_need == s.RESOURCE_NEED_PREFILL
    assert plan.mode == s.EXECUTION_MODE_TRANSFER
    assert plan.prefill_pool_id == "h100-prefill"
    assert plan.estimates.transfer_ms > 0 and plan.estimates.ttft_ms > plan.estimates.prefill_ms
    assert plan.fallbacks[0].reason == "kv_transfer_failed"
    assert plan.fallbacks[0].mode == s.EXECUTION_MODE_RECOMPUTE
    assert plan.route_record_id == "pf-1" and plan.reserved_kv_bytes == (8000 + 64) * 128 * 1024


async def test_decode_heavy_goes_to_the_bandwidth_rich_pool(scheduler: SchedulerHandle) -> None:
    await hetero_fleet(scheduler)
    resp = await scheduler.stub.Schedule(sched("dc-1", prompt=300, output=3000), timeout=5)
    assert resp.plan.resource_need == s.RESOURCE_NEED_DECODE
    assert resp.plan.decode_pool_id == "h200-decode"


async def test_slow_link_means_recompute(scheduler: SchedulerHandle) -> None:
    p = scheduler.registry.prefix
    ids = [f"{p}-pre", f"{p}-dec"]
    await register(scheduler.registry, ids[0], IDLE, pool_id="far-prefill", zone="z1")
    await register(
        scheduler.registry, ids[1], IDLE, pool_id="near-decode", stages=(c.STAGE_DECODE,),
        zone="z2",
    )  # fmt: skip
    await scheduler.settle(ids)
    # 4,000 prompt tokens = 500 MiB of KV over a 25 Gb/s cross-zone link: ~170 ms, while the
    # H100 decode worker recomputes the prompt in well under that
    resp = await scheduler.stub.Schedule(sched("slow-1", prompt=4000, output=100), timeout=5)
    assert resp.plan.mode == s.EXECUTION_MODE_RECOMPUTE
    assert resp.plan.prefill_worker_id == resp.plan.decode_worker_id == ids[1]


async def test_inconvertible_kv_means_recompute_and_the_record_says_why(
    scheduler: SchedulerHandle,
) -> None:
    p = scheduler.registry.prefix
    ids = [f"{p}-pre", f"{p}-dec"]
    await register(scheduler.registry, ids[0], IDLE, pool_id="bf16-prefill")
    await register(
        scheduler.registry, ids[1], IDLE, pool_id="fp8-decode", stages=(c.STAGE_DECODE,),
        dtype=c.KV_DTYPE_FP8_E4M3,
    )  # fmt: skip
    await scheduler.settle(ids)
    resp = await scheduler.stub.Schedule(sched("kv-1", prompt=8000, output=64), timeout=5)
    assert resp.plan.mode == s.EXECUTION_MODE_RECOMPUTE
    assert resp.plan.decode_worker_id == ids[1]


async def test_layout_mismatch_pays_a_conversion_or_recomputes(
    scheduler: SchedulerHandle,
) -> None:
    """Our shared KV rules convert between paged layouts (at a cost), so a layout mismatch
    is a conversion priced into the hand-off, never a silent direct transfer."""
    p = scheduler.registry.prefix
    ids = [f"{p}-pre", f"{p}-dec"]
    await register(scheduler.registry, ids[0], IDLE, pool_id="nhd-prefill")
    await register(
        scheduler.registry, ids[1], IDLE, pool_id="hnd-decode", stages=(c.STAGE_DECODE,),
        layout=c.KV_LAYOUT_PAGED_HND,
    )  # fmt: skip
    await scheduler.settle(ids)
    plan = (await scheduler.stub.Schedule(sched("lay-1", prompt=8000, output=64), timeout=5)).plan
    if plan.mode == s.EXECUTION_MODE_TRANSFER:
        assert plan.estimates.conversion_ms > 0
    else:
        assert plan.mode == s.EXECUTION_MODE_RECOMPUTE


async def test_unhealthy_preferred_pool_means_reroute(scheduler: SchedulerHandle) -> None:
    ids = await hetero_fleet(scheduler)
    reg = scheduler.registry
    for wid in ids:
        if "h200" in wid:
            await reg.stub.CordonWorker(r.CordonWorkerRequest(worker_id=wid, reason="gpu xid"))
    await scheduler.settle(ids)
    resp = await scheduler.stub.Schedule(
        sched("rr-1", prompt=300, output=3000, preferred_pool="h200-decode"), timeout=5
    )
    assert resp.plan.decision == s.ROUTE_DECISION_REROUTE
    assert resp.plan.decode_pool_id == "l40s-decode"
    await asyncio.sleep(0.3)  # the explanation is written just after the plan
    rec = (await scheduler.stub.GetRouteRecord(s.GetRouteRecordRequest(request_id="rr-1"))).record
    assert rec.summary["route_decision"] == "reroute"
    pools = MessageToDict(rec.explanation)["rejected_pools"]
    assert "h200-decode" in pools and "cordoned" in pools["h200-decode"]


@pytest.mark.parametrize(
    ("stored", "served"),
    [
        pytest.param('{"v":2,"s":["default"],"n":""}', UNREADABLE_EXPLANATION, id="fields-missing"),
        pytest.param('{"v":2,"s":["p","t"', UNREADABLE_EXPLANATION, id="truncated"),
        pytest.param(b"\xff\xfe", UNREADABLE_EXPLANATION, id="not-utf8"),
        pytest.param(
            '{"v":2,"n":"","s":["p","t",[],[],0,[],[],[],[],[],[],[]]}',
            UNREADABLE_EXPLANATION,
            id="numbers-missing",
        ),
        pytest.param(
            # decodes (six numbers, one candidate) but names a factor 1: not Struct-shaped
            '{"v":2,"n":"AAAAAAAA4D8AAAAAAADgPwAAAAAAAOA/AAAAAAAA4D8AAAAAAADgPwAAAAAAAOA/",'
            '"s":["p","t",[],[],0,[[1]],[["w","x",0]],[],[],[],{},[]]}',
            UNREADABLE_EXPLANATION,
            id="bad-factor-table",
        ),
        pytest.param(
            '{"profile":"p","notes":["kept"]}',
            {"profile": "p", "notes": ["kept"]},
            id="plain-old-form",
        ),
    ],
)
async def test_a_damaged_explanation_still_serves_the_record(
    scheduler: SchedulerHandle, stored: str | bytes, served: dict[str, Any]
) -> None:
    """A stored explanation that no longer decodes (hand-edited, truncated, not UTF-8, not
    the shape a record has) leaves the record readable: the head and summary come back and
    the explanation says it is damaged; an explanation in the plain form is served as is."""
    svc = scheduler.service
    if svc is None:
        pytest.skip("needs the in-process scheduler to reach its Redis")
    ids = await hetero_fleet(scheduler)
    await scheduler.settle(ids)
    await scheduler.stub.Schedule(sched("dmg-1"), timeout=5)
    await asyncio.sleep(0.3)  # the explanation is written just after the plan
    key = svc.store.keys.record("dmg-1")
    assert await svc.store.client.hget(key, "x")
    await svc.store.client.hset(key, "x", stored)
    rec = (await scheduler.stub.GetRouteRecord(s.GetRouteRecordRequest(request_id="dmg-1"))).record
    assert rec.summary["route_decision"] == "primary"
    assert MessageToDict(rec.explanation) == served


@pytest.mark.parametrize(
    ("model", "cordon"),
    [
        pytest.param("no-such-model", False, id="model-missing"),
        pytest.param("llama-3-8b", True, id="every-worker-cordoned"),
    ],
)
async def test_nothing_executable_is_rejected_with_failed_precondition(
    scheduler: SchedulerHandle, model: str, cordon: bool
) -> None:
    ids = await hetero_fleet(scheduler)
    if cordon:
        for wid in ids:
            await scheduler.registry.stub.CordonWorker(r.CordonWorkerRequest(worker_id=wid))
        await scheduler.settle(ids)
    code, exc = await status_of(scheduler.stub.Schedule(sched("rej-1", model=model), timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    if not cordon:
        assert exc.details().startswith("the model has no worker in the fleet"), exc.details()
    rec = (await scheduler.stub.GetRouteRecord(s.GetRouteRecordRequest(request_id="rej-1"))).record
    assert rec.decision == s.ROUTE_DECISION_REJECT and rec.reject_class == "no_capable_worker"


async def test_schedule_is_idempotent_per_request_id(scheduler: SchedulerHandle) -> None:
    await hetero_fleet(scheduler)
    first = await scheduler.stub.Schedule(sched("idem-1"), timeout=5)
    again = await scheduler.stub.Schedule(sched("idem-1"), timeout=5)
    assert not first.replayed and again.replayed
    assert again.plan == first.plan
    # the same id asking for something else is a caller's bug, not a retry
    for changed in (
        sched("idem-1", prompt=5, output=5),
        sched("idem-1", model="other-model"),
        sched("idem-1", tier="batch"),
    ):
        code, exc = await status_of(scheduler.stub.Schedule(changed, timeout=5))
        assert code == grpc.StatusCode.ALREADY_EXISTS, code
        assert "different request" in exc.details()
    svc = scheduler.service
    if svc is not None:
        assert await svc.store.reservation_count() == 1


async def test_outcome_releases_and_feeds_the_estimates(scheduler: SchedulerHandle) -> None:
    await hetero_fleet(scheduler)
    plan = (await scheduler.stub.Schedule(sched("oc-1", prompt=2000), timeout=5)).plan
    out = await scheduler.stub.ReportOutcome(
        s.ReportOutcomeRequest(request_id="oc-1", success=True, ttft_ms=150, tpot_ms=30,
                               prefill_ms=100),
        timeout=5,
    )  # fmt: skip
    assert out.released and out.first_report
    again = await scheduler.stub.ReportOutcome(
        s.ReportOutcomeRequest(request_id="oc-1", success=True, ttft_ms=999), timeout=5
    )
    assert not again.released and not again.first_report
    rec = (await scheduler.stub.GetRouteRecord(s.GetRouteRecordRequest(request_id="oc-1"))).record
    assert rec.outcome.success and rec.outcome.ttft_ms == 150
    recs = await scheduler.stub.GetRecommendations(s.GetRecommendationsRequest(), timeout=5)
    by_id = {w.worker_id: w for w in recs.workers}
    prefiller = plan.prefill_worker_id
    assert by_id[prefiller].prefill_tokens_per_s == pytest.approx(2000 / 0.1)
    assert by_id[plan.decode_worker_id].itl_ms == pytest.approx(30)
    code, _ = await status_of(
        scheduler.stub.ReportOutcome(s.ReportOutcomeRequest(request_id="never", success=True))
    )
    assert code == grpc.StatusCode.NOT_FOUND


async def test_list_route_records_filters_and_pages(scheduler: SchedulerHandle) -> None:
    await hetero_fleet(scheduler)
    for i in range(7):
        tier = "batch" if i % 2 else "interactive"
        await scheduler.stub.Schedule(sched(f"ls-{i}", tier=tier), timeout=5)
    seen: list[str] = []
    token = ""
    while True:
        page = await scheduler.stub.ListRouteRecords(
            s.ListRouteRecordsRequest(tier="batch", page_size=2, page_token=token), timeout=5
        )
        seen += [x.request_id for x in page.records]
        token = page.next_page_token
        if not token:
            break
    assert seen == ["ls-5", "ls-3", "ls-1"]
    code, _ = await status_of(
        scheduler.stub.ListRouteRecords(s.ListRouteRecordsRequest(page_token="nonsense"))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_policy_reload_refuses_a_bad_profile_and_keeps_the_old(
    scheduler: SchedulerHandle,
) -> None:
    before = (await scheduler.stub.GetPolicy(s.GetPolicyRequest(), timeout=5)).policy
    bad = before.source_yaml.replace("weight: 0.35", "weight: -1", 1)
    code, exc = await status_of(
        scheduler.stub.ReloadPolicy(s.ReloadPolicyRequest(profile_yaml=bad), timeout=5)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "decode.scorers[0].weight" in exc.details()
    after = (await scheduler.stub.GetPolicy(s.GetPolicyRequest(), timeout=5)).policy
    assert after.generation == before.generation
    ok = await scheduler.stub.ReloadPolicy(s.ReloadPolicyRequest(builtin_profile="seed"))
    assert ok.applied and ok.policy.profile == "seed"
    assert ok.policy.generation == before.generation + 1


async def test_saturated_tier_is_resource_exhausted_with_a_retry_delay(
    scheduler: SchedulerHandle,
) -> None:
    await saturated_worker(scheduler)
    code, exc = await status_of(scheduler.stub.Schedule(sched("sat-1", tier="batch"), timeout=5))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = {k: v for k, v in (exc.trailing_metadata() or ())}
    assert int(trailers["retry-after-ms"]) > 0


@pytest.mark.skipif(external("scheduler") is not None, reason="starts its own scheduler")
async def test_health_turns_serving_when_the_view_syncs_not_at_the_next_probe(
    redis_server: EmbeddedRedis, registry: RegistryHandle
) -> None:
    """The readiness probe runs every few seconds; the first run comes before the fleet view
    has synced. The sync itself re-checks readiness, so SERVING does not wait for the
    next probe (5 s here)."""
    from hpd_scheduler.__main__ import build_server
    from hpd_scheduler.settings import SchedulerSettings

    settings = SchedulerSettings(
        port=0,
        redis_url=redis_server.url,
        key_prefix=registry.prefix,
        registry_target=registry.target,
        directive_interval_ms=0,
    )
    server = build_server(settings, redis_conn.connect(redis_server.url))
    server._probe_interval_s = 5.0
    t0 = time.monotonic()
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="hetero_pd.v1.SchedulerService")
        while (await stub.Check(request)).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() - t0 < 2.5, "SERVING waited for the next readiness probe"
            await asyncio.sleep(0.02)
    finally:
        await channel.close()
        await stop_server(server)


async def test_a_reported_queue_does_not_count_planned_prefills_twice(
    scheduler: SchedulerHandle,
) -> None:
    """A prefill the scheduler planned counts by its prompt's tokens; when the engine's next
    load report shows it waiting, it is not priced again at the mean prompt. A request the
    report shows beyond the plans (from another front door) still is. Until the prefill's
    predicted end the transfer counts on its decode worker as one on its way there."""
    svc = scheduler.service
    if svc is None:
        pytest.skip("needs the in-process scheduler")
    p = scheduler.registry.prefix
    pw, dw = f"{p}-tq-p", f"{p}-tq-d"
    cred = await register(
        scheduler.registry, pw, IDLE, pool_id="tq-prefill", stages=(c.STAGE_PREFILL,), gpu="L40S"
    )
    await register(
        scheduler.registry, dw, IDLE, pool_id="tq-decode", stages=(c.STAGE_DECODE,), gpu="L4"
    )
    await scheduler.settle([pw, dw])
    plan = (await scheduler.stub.Schedule(sched("tq-known", prompt=7500), timeout=5)).plan
    assert plan.prefill_worker_id == pw and plan.decode_worker_id == dw, plan
    # counted in tokens until its predicted prefill end, which the checks below precede
    assert plan.estimates.prefill_wait_ms + plan.estimates.prefill_ms > 500

    async def report(queue: int) -> None:
        hb = r.HeartbeatRequest(worker_id=pw, credential=cred, load=load(queue=queue))
        await scheduler.registry.stub.Heartbeat(hb, timeout=5)
        await scheduler.settle([pw])

    def backlog(wid: str = pw) -> tuple[float, int]:
        ws = svc.fleet().worker(wid)
        assert ws is not None
        return ws.backlog_tokens, ws.live_tokens

    await report(queue=1)  # the engine holds the planned request
    ref = svc.fleet().ref_tokens  # the traffic's mean prompt, as this snapshot has it
    assert backlog() == (0, 7500)
    assert backlog(dw) == (ref, 0)  # on its way to the decode worker
    await report(queue=2)  # and one the scheduler did not plan
    assert backlog() == (svc.fleet().ref_tokens, 7500)


async def test_health_serves_once_the_view_is_fresh(scheduler: SchedulerHandle) -> None:
    stub = health_pb2_grpc.HealthStub(scheduler.channel)
    deadline = time.monotonic() + 5
    status = None
    while time.monotonic() < deadline:
        resp = await stub.Check(
            health_pb2.HealthCheckRequest(service="hetero_pd.v1.SchedulerService")
        )
        status = resp.status
        if status == health_pb2.HealthCheckResponse.SERVING:
            break
        await asyncio.sleep(0.05)
    assert status == health_pb2.HealthCheckResponse.SERVING


async def test_queued_prefill_tokens_follow_reservations(scheduler: SchedulerHandle) -> None:
    """A plan's prompt counts as queued prefill work on its prefill worker from the moment it
    is reserved until its predicted first token, not until its outcome: a request decoding
    for seconds no longer makes its prefill worker look backlogged."""
    svc = scheduler.service
    if svc is None:
        pytest.skip("needs the in-process scheduler")
    await hetero_fleet(scheduler)
    plan = (await scheduler.stub.Schedule(sched("tq-1", prompt=3000), timeout=5)).plan
    pw = plan.prefill_worker_id

    def queued() -> int:
        ws = svc.fleet().worker(pw)
        assert ws is not None
        return ws.live_tokens

    assert svc.reserved(pw).prefill_tokens == 3000
    assert queued() == 3000
    # past the predicted first token: still reserved, no longer queued
    await asyncio.sleep(plan.estimates.ttft_ms / 1000 + 0.05)
    svc.rebuild()
    assert svc.reserved(pw).prefill_tokens == 3000
    assert queued() == 0
    # the next Schedule sees the same without waiting for a rebuild
    second = (await scheduler.stub.Schedule(sched("tq-2", prompt=1000), timeout=5)).plan
    await asyncio.sleep(second.estimates.ttft_ms / 1000 + 0.05)
    await scheduler.stub.Schedule(sched("tq-3", prompt=500), timeout=5)
    assert svc.fleet().worker(second.prefill_worker_id).live_tokens in (0, 500)  # type: ignore[union-attr]
    # the outcome releases the reservation without counting the tokens twice
    for rid in ("tq-1", "tq-2", "tq-3"):
        await scheduler.stub.ReportOutcome(
            s.ReportOutcomeRequest(request_id=rid, success=True), timeout=5
        )
    assert svc.reserved(pw).prefill_tokens == 0
    assert queued() == 0
    svc.rebuild()
    assert queued() == 0


async def test_the_snapshot_knows_how_long_the_traffics_sequences_live(
    scheduler: SchedulerHandle,
) -> None:
    """The decode admission wait drains a full batch at the traffic's mean output
    (``Fleet.ref_output_tokens``): unknown (0) before the first request, then the mean of
    the expected outputs the scheduler has planned."""
    svc = scheduler.service
    if svc is None:
        pytest.skip("needs the in-process scheduler")
    await hetero_fleet(scheduler)
    assert svc.rebuild().ref_output_tokens == 0
    await scheduler.stub.Schedule(sched("om-1", prompt=800, output=600), timeout=5)
    assert 600 / 1.25 < svc.rebuild().ref_output_tokens < 600 * 1.25
    for _ in range(200):  # the mix follows the traffic (about 50 requests of memory)
        svc.output_mix.observe(60)
    assert 60 / 1.25 < svc.rebuild().ref_output_tokens < 60 * 1.25
