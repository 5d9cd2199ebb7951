"""ScheduleStream: many requests over one stream, answered by request id, each with what
Schedule would have returned (plan or status), with a bound on requests in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from hetero_pd.v1 import scheduler_pb2 as s
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.scheduler import (
    SchedulerHandle,
    hetero_fleet,
    own_scheduler,
    saturated_worker,
    sched,
    scheduler,
)
from tests.support.servers import RegistryHandle, external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="needs an isolated fleet"),
]
__all__ = ["scheduler"]  # the fixture, re-exported for pytest


async def one_stream(h: SchedulerHandle, reqs: list[s.ScheduleRequest]) -> list[Any]:
    """Sends every request on one stream; the answers in the order they came."""
    call = h.stub.ScheduleStream(iter(reqs), timeout=20)
    return [answer async for answer in call]


async def test_every_request_is_answered_by_id_with_schedules_answer(
    scheduler: SchedulerHandle,
) -> None:
    await hetero_fleet(scheduler)
    reqs = [sched(f"st-{i}", prompt=500 + 100 * i, output=64) for i in range(24)]
    answers = await one_stream(scheduler, reqs)
    assert sorted(a.request_id for a in answers) == sorted(r.request_id for r in reqs)
    for a in answers:
        assert a.WhichOneof("result") == "response", a
        assert a.response.plan.request_id == a.request_id and not a.response.replayed
        # the same plan as Schedule's replay of that id (it was recorded)
        again = await scheduler.stub.Schedule(
            next(r for r in reqs if r.request_id == a.request_id), timeout=5
        )
        assert again.replayed and again.plan == a.response.plan


async def test_a_refused_request_gets_its_status_and_the_stream_goes_on(
    scheduler: SchedulerHandle,
) -> None:
    await hetero_fleet(scheduler)
    reqs = [
        sched("ok-1"),
        sched("bad-1", prompt=0),  # INVALID_ARGUMENT naming the field
        sched("nomodel-1", model="no-such-model"),  # FAILED_PRECONDITION
        sched("ok-1"),  # a retry on the same stream: replayed
        sched("ok-1", prompt=7),  # the id asking for something else: ALREADY_EXISTS
        sched("ok-2"),
    ]
    got: dict[str, list[Any]] = {}
    for a in await one_stream(scheduler, reqs):
        got.setdefault(a.request_id, []).append(a)
    bad = got["bad-1"][0].error
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.field == "prompt_tokens" and "prompt_tokens" in bad.message
    nomodel = got["nomodel-1"][0].error
    assert nomodel.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert nomodel.message.startswith("the model has no worker in the fleet")
    assert got["ok-2"][0].response.plan.request_id == "ok-2"
    ok1 = got["ok-1"]
    assert len(ok1) == 3
    plans = [a for a in ok1 if a.WhichOneof("result") == "response"]
    conflicts = [a for a in ok1 if a.WhichOneof("result") == "error"]
    assert len(plans) == 2 and sorted(p.response.replayed for p in plans) == [False, True]
    assert plans[0].response.plan == plans[1].response.plan
    assert [x.error.code for x in conflicts] == [grpc.StatusCode.ALREADY_EXISTS.value[0]]


async def test_a_saturated_request_carries_its_retry_delay(scheduler: SchedulerHandle) -> None:
    await saturated_worker(scheduler)
    (a,) = await one_stream(scheduler, [sched("sat-s", tier="batch")])
    assert a.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert a.error.retry_after_ms > 0


@pytest.fixture
async def narrow(
    redis_server: EmbeddedRedis, registry: RegistryHandle
) -> AsyncIterator[SchedulerHandle]:
    async with own_scheduler(redis_server.url, registry, stream_max_in_flight=3) as h:
        yield h


async def test_no_more_than_the_bound_is_decided_at_once(narrow: SchedulerHandle) -> None:
    await hetero_fleet(narrow)
    svc = narrow.service
    assert svc is not None
    inside, most = 0, 0
    planned = svc.schedule

    async def slow(req: Any) -> Any:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        try:
            await asyncio.sleep(0.02)
            return await planned(req)
        finally:
            inside -= 1

    svc.schedule = slow  # type: ignore[method-assign]
    answers = await one_stream(narrow, [sched(f"nb-{i}") for i in range(12)])
    assert len(answers) == 12 and all(a.WhichOneof("result") == "response" for a in answers)
    assert most == 3


async def test_a_client_that_goes_away_mid_stream_leaves_the_server_serving(
    scheduler: SchedulerHandle,
) -> None:
    await hetero_fleet(scheduler)

    async def endless() -> AsyncIterator[s.ScheduleRequest]:
        i = 0
        while True:
            yield sched(f"gone-{i}")
            i += 1
            await asyncio.sleep(0.001)

    call = scheduler.stub.ScheduleStream(endless(), timeout=20)
    n = 0
    async for _ in call:
        n += 1
        if n == 5:
            break
    call.cancel()
    resp = await scheduler.stub.Schedule(sched("after-gone"), timeout=5)
    assert resp.plan.request_id == "after-gone"


# -- the gateway's client ----------------------------------------------------------------------


def unary_schedules() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("hpd_rpc_seconds_count", {"method": "Schedule"}) or 0.0


async def test_the_gateway_plans_over_one_stream(scheduler: SchedulerHandle) -> None:
    from hpd_gateway.control_client import ControlPlane

    await hetero_fleet(scheduler)
    cp = ControlPlane(scheduler.target, "127.0.0.1:1", "127.0.0.1:1", timeout_s=5)
    try:
        before = unary_schedules()
        plans = await asyncio.gather(
            *(cp.schedule(f"gw-{i}", "llama-3-8b", 800, 64, "standard") for i in range(20))
        )
        assert [p.request_id for p in plans] == [f"gw-{i}" for i in range(20)]
        assert all(p.steps[0].decode_worker for p in plans)
        assert unary_schedules() == before  # not one unary Schedule
        with pytest.raises(Exception) as refused:
            await cp.schedule("gw-x", "no-such-model", 800, 64, "standard")
        assert getattr(refused.value, "status", None) == 404
    finally:
        await cp.close()


async def test_a_broken_stream_retries_its_waiting_requests_unary(
    scheduler: SchedulerHandle,
) -> None:
    from hpd_gateway.control_client import ControlPlane

    await hetero_fleet(scheduler)
    svc = scheduler.service
    assert svc is not None
    planned = svc.schedule
    held = asyncio.Event()

    async def hold_the_first(req: Any) -> Any:
        if req.request_id == "br-0" and not held.is_set():
            held.set()
            await asyncio.sleep(30)  # the stream breaks while this one waits
        return await planned(req)

    svc.schedule = hold_the_first  # type: ignore[method-assign]
    cp = ControlPlane(scheduler.target, "127.0.0.1:1", "127.0.0.1:1", timeout_s=5)
    try:
        before = unary_schedules()
        waiting = asyncio.ensure_future(cp.schedule("br-0", "llama-3-8b", 800, 64, "standard"))
        await asyncio.wait_for(held.wait(), 5)
        call = cp.streams[0]._call
        assert call is not None
        call.cancel()  # the connection lost, as far as the client can tell
        plan = await asyncio.wait_for(waiting, 5)
        assert plan.request_id == "br-0"
        assert unary_schedules() == before + 1  # retried unary, under the same id
        again = await cp.schedule("br-1", "llama-3-8b", 800, 64, "standard")  # a new stream
        assert again.request_id == "br-1" and unary_schedules() == before + 1
    finally:
        await cp.close()


async def test_a_stream_answer_that_never_comes_is_a_504(scheduler: SchedulerHandle) -> None:
    from hpd_gateway.control_client import ControlPlane
    from hpd_gateway.protocol import GatewayError

    await hetero_fleet(scheduler)
    svc = scheduler.service
    assert svc is not None
    planned = svc.schedule

    async def stuck(req: Any) -> Any:
        if req.request_id == "slow-0":
            await asyncio.sleep(30)
        return await planned(req)

    svc.schedule = stuck  # type: ignore[method-assign]
    cp = ControlPlane(scheduler.target, "127.0.0.1:1", "127.0.0.1:1", timeout_s=0.3)
    try:
        with pytest.raises(GatewayError) as late:
            await cp.schedule("slow-0", "llama-3-8b", 800, 64, "standard")
        assert late.value.status == 504
        # the stream is still good for the next request
        plan = await cp.schedule("slow-1", "llama-3-8b", 800, 64, "standard")
        assert plan.request_id == "slow-1"
    finally:
        await cp.close()
