"""`hpd up` runs the scheduler and the KV broker in one process: the scheduler opens KV
sessions by calling the broker there (``InProcessKvBroker``) instead of over a loopback
gRPC call. It must answer as the gRPC path does: a session the broker really holds, as the
scheduler (whoever called Schedule), and the same refusal reasons."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common import auth
from hpd_scheduler.broker_client import SessionRefused
from hpd_tools.controlplane import ControlPlane, InProcessKvBroker
from tests.component.test_prefix_routing import _register
from tests.support.servers import external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own servers"),
]


def _opener(plane: ControlPlane) -> InProcessKvBroker:
    assert plane.scheduler is not None
    opener = plane.scheduler.component.service.opener  # type: ignore[attr-defined]
    assert isinstance(opener, InProcessKvBroker)
    return opener


async def test_a_transfer_plan_holds_a_session_the_broker_really_opened(
    plane: ControlPlane,
) -> None:
    async with (
        grpc.aio.insecure_channel(plane.registry_target) as rch,
        grpc.aio.insecure_channel(plane.scheduler_target) as sch,
        grpc.aio.insecure_channel(plane.kvbroker_target) as bch,
    ):
        reg = r_grpc.RegistryServiceStub(rch)
        sched = s_grpc.SchedulerServiceStub(sch)
        broker = kb_grpc.KvBrokerServiceStub(bch)
        await _register(reg, "ip-p", pool_id="h100-prefill", stages=(c.STAGE_PREFILL,))
        await _register(reg, "ip-d", pool_id="a100-decode", stages=(c.STAGE_DECODE,),
                        gpu="A100-80G")  # fmt: skip
        req = s.ScheduleRequest(
            request_id="ip-1", model_id="llama-3-8b", prompt_tokens=2000,
            expected_output_tokens=20,
        )  # fmt: skip
        plan = None
        for _ in range(100):  # until the scheduler's view holds both workers
            try:
                plan = (await sched.Schedule(req, timeout=5)).plan
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        assert plan is not None
        assert plan.mode == s.EXECUTION_MODE_TRANSFER, plan
        assert plan.kv_session_id
        got = await broker.GetSession(
            kb.GetSessionRequest(session_id=plan.kv_session_id), timeout=5
        )
        assert got.session.source_worker_id == "ip-p"
        assert got.session.destination_worker_id == "ip-d"
        assert got.session.state == kb.SESSION_STATE_NEGOTIATED
        # the scheduler aborts it in process too (what it does when a reservation fails)
        await _opener(plane).abort(plan.kv_session_id, "test")
        got = await broker.GetSession(
            kb.GetSessionRequest(session_id=plan.kv_session_id), timeout=5
        )
        assert got.session.state == kb.SESSION_STATE_ABORTED


async def test_the_broker_is_called_as_the_scheduler_whoever_called_schedule(
    plane: ControlPlane,
) -> None:
    """With auth on, the Schedule handler runs as the gateway that called it; the broker
    refuses a gateway that opens a session. The in-process call is the scheduler's."""
    async with grpc.aio.insecure_channel(plane.registry_target) as rch:
        reg = r_grpc.RegistryServiceStub(rch)
        await _register(reg, "ip-p2", pool_id="h100-prefill", stages=(c.STAGE_PREFILL,))
        await _register(reg, "ip-d2", pool_id="a100-decode", stages=(c.STAGE_DECODE,),
                        gpu="A100-80G")  # fmt: skip
    opener = _opener(plane)
    gateway = auth.Principal("gw", auth.Role.GATEWAY)
    with auth.acting_as(gateway):
        sid = await opener.open("ip-2", "ip-p2", "ip-d2", 1 << 20)
        assert auth.current() is gateway  # restored after the call
    assert sid
    assert auth.current() is None


@pytest.mark.parametrize(
    ("src", "dst", "reason"),
    [
        ("ip-nobody", "ip-nobody-2", "broker_not_found"),
        ("ip-same", "ip-same", "broker_invalid_argument"),
    ],
)
async def test_refusals_carry_the_grpc_paths_reasons(
    plane: ControlPlane, src: str, dst: str, reason: str
) -> None:
    with pytest.raises(SessionRefused) as refused:
        await _opener(plane).open("ip-3", src, dst, 1 << 20)
    assert refused.value.reason == reason
