"""The compose stack as shipped (compose.yaml: mutual TLS by default), as
scripts/compose-e2e.sh brings it up in its second phase: mutual TLS on every port, callers
identified by their client certificates (no tokens), and the services reaching each other
over mTLS.

Skipped unless HPD_COMPOSE_TLS_DIR names the folder `hpd certs` wrote for the stack."""

from __future__ import annotations

import os
import time
import uuid

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.channels import CallIdentity, sync_channel
from tests.support.fleet import capability, load

TLS = os.environ.get("HPD_COMPOSE_TLS_DIR", "")
pytestmark = pytest.mark.skipif(not TLS, reason="the stack as shipped (compose-e2e.sh, phase 2)")


def addr(service: str) -> str:
    return os.environ[f"HPD_{service.upper()}_ADDR"]


def as_role(role: str) -> CallIdentity:
    return CallIdentity(
        ca_file=f"{TLS}/ca.pem",
        cert_file=f"{TLS}/role-{role}.pem",
        key_file=f"{TLS}/role-{role}.key",
    )


def test_plaintext_and_certificate_less_callers_are_refused() -> None:
    with grpc.insecure_channel(addr("registry")) as ch, pytest.raises(grpc.RpcError) as err:
        r_grpc.RegistryServiceStub(ch).ListWorkers(r.ListWorkersRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    server_only = CallIdentity(ca_file=f"{TLS}/ca.pem")
    with sync_channel(addr("scheduler"), server_only) as ch, pytest.raises(grpc.RpcError) as err:
        s_grpc.SchedulerServiceStub(ch).GetPolicy(s.GetPolicyRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake wants a cert


def test_a_plan_across_the_stack_by_certificate_identities() -> None:
    tag = uuid.uuid4().hex[:6]
    pw, dw = f"tls-p-{tag}", f"tls-d-{tag}"
    with sync_channel(addr("registry"), as_role("worker")) as ch:
        reg = r_grpc.RegistryServiceStub(ch)
        for wid, stage in ((pw, c.STAGE_PREFILL), (dw, c.STAGE_DECODE)):
            cred = reg.RegisterWorker(
                r.RegisterWorkerRequest(
                    capability=capability(wid, pool_id=f"pool-{wid}", stages=(stage,))
                ),
                timeout=5,
            ).credential
            beat = r.HeartbeatRequest(worker_id=wid, credential=cred, load=load())
            reg.Heartbeat(beat, timeout=5)
    # the gateway's plan: the scheduler saw the workers through its mTLS watch of the
    # registry, and opened the KV session at the broker as the scheduler certificate
    plan = None
    with sync_channel(addr("scheduler"), as_role("gateway")) as ch:
        sched = s_grpc.SchedulerServiceStub(ch)
        deadline = time.monotonic() + 30
        while plan is None:
            try:
                plan = sched.Schedule(
                    s.ScheduleRequest(request_id=f"tls-{tag}", model_id="llama-3-8b",
                                      prompt_tokens=800, expected_output_tokens=40),
                    timeout=5,
                ).plan  # fmt: skip
            except grpc.RpcError as exc:
                retry = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)
                if exc.code() not in retry or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert plan.decode_worker_id == dw
        if plan.mode == s.EXECUTION_MODE_TRANSFER:
            assert plan.kv_session_id  # the broker took the scheduler's certificate
        reply = sched.ReportOutcome(
            s.ReportOutcomeRequest(request_id=f"tls-{tag}", success=True, output_tokens=40),
            timeout=5,
        )
        assert reply.first_report
    cordon = r.CordonWorkerRequest(worker_id=dw, reason="compose TLS test")
    gateway = as_role("gateway")
    with sync_channel(addr("registry"), gateway) as ch, pytest.raises(grpc.RpcError) as e:
        r_grpc.RegistryServiceStub(ch).CordonWorker(cordon, timeout=5)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "hpd-gateway-certificate" in str(e.value.details())
    with sync_channel(addr("registry"), as_role("operator")) as ch:
        got = r_grpc.RegistryServiceStub(ch).CordonWorker(cordon, timeout=5)
    assert got.worker.status.cordoned
