"""Who may change what: the whole control plane with a tokens file (auth on), read-only
RPCs closed too, so that the services' own clients must present their tokens.

The table test calls every state-changing RPC of every service with no token, with a
token the file does not hold, and with every role the access table does not allow: each
is refused before the servicer runs. The subject tests then use allowed roles on someone
else's subject: a worker on another worker's record, a gateway on another gateway's
request. The last checks that the plane still works for the callers who are allowed
(its scheduler sees the fleet through a closed registry and plans)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from google.protobuf import descriptor_pool, message_factory

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import diagnostics_pb2, kvbroker_pb2, registry_pb2, scheduler_pb2
from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import scheduler_pb2 as s
from hpd_common.auth import ACCESS, READ, Role
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.component.test_registry_api import code_of
from tests.support.auth_plane import TOKENS, Plane, auth_plane
from tests.support.fleet import capability, load
from tests.support.servers import external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own servers"),
]

FILES = (registry_pb2, scheduler_pb2, kvbroker_pb2, diagnostics_pb2)
SERVICE_OF = {
    "RegistryService": "registry",
    "SchedulerService": "scheduler",
    "KvBrokerService": "kvbroker",
    "DiagnosticsService": "registry",
}


@pytest.fixture
async def plane(
    redis_server: EmbeddedRedis, key_prefix: str, tmp_path: Path
) -> AsyncIterator[Plane]:
    async with auth_plane(redis_server.url, key_prefix, tmp_path) as p:
        yield p


def _methods() -> list[tuple[str, Any, Any]]:
    """(key, method descriptor, request class) of every RPC of every hetero-pd service."""
    out = []
    for f in FILES:
        for service in f.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                cls = message_factory.GetMessageClass(
                    descriptor_pool.Default().FindMessageTypeByName(m.input_type.full_name)
                )
                out.append((f"{service.name}/{m.name}", m, cls))
    return out


async def _code(plane: Plane, key: str, m: Any, cls: Any, who: str) -> grpc.StatusCode:
    """Calls the method (an empty request) as ``who``; the status it ends with."""
    code, _ = await _answer(plane, key, m, cls, who)
    return code


async def _answer(plane: Plane, key: str, m: Any, cls: Any, who: str) -> tuple[Any, str]:
    """Calls the method (an empty request) as ``who``; the status and its message."""
    svc = SERVICE_OF[key.split("/")[0]]
    ch = plane.channels[f"{who}@{svc}"]
    path = f"/{m.containing_service.full_name}/{m.name}"
    ser, de = cls.SerializeToString, lambda b: b
    try:
        if m.client_streaming and m.server_streaming:
            call = ch.stream_stream(path, request_serializer=ser, response_deserializer=de)
            async for _ in call(iter([cls()]), timeout=5):
                break
        elif m.server_streaming:
            call = ch.unary_stream(path, request_serializer=ser, response_deserializer=de)
            async for _ in call(cls(), timeout=5):
                break
        else:
            await ch.unary_unary(path, request_serializer=ser, response_deserializer=de)(
                cls(), timeout=5
            )
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_every_rpc_of_every_service_is_in_the_access_table() -> None:
    keys = {key for key, _, _ in _methods()}
    assert keys == set(ACCESS), (
        f"unclassified: {sorted(keys - set(ACCESS))}; stale: {sorted(set(ACCESS) - keys)}"
    )


async def test_every_state_changing_rpc_refuses_no_token_an_unknown_one_and_other_roles(
    plane: Plane,
) -> None:
    changing = [(k, m, cls) for k, m, cls in _methods() if ACCESS[k] != READ]
    assert len(changing) >= 15  # registry 8, scheduler 3, broker 4 (+ their growth)
    refused: list[str] = []
    for key, m, cls in changing:
        rule = ACCESS[key]
        assert isinstance(rule, frozenset)
        assert await _code(plane, key, m, cls, "anon") == grpc.StatusCode.UNAUTHENTICATED, key
        assert await _code(plane, key, m, cls, "stranger") == grpc.StatusCode.UNAUTHENTICATED, key
        for who, (role, _) in TOKENS.items():
            got, why = await _answer(plane, key, m, cls, who)
            if role is Role.OPERATOR or role in rule:
                # past the gate: the servicer judges the (empty) request itself, and may
                # refuse it for its subject (a worker's record needs that worker's credential)
                assert got != grpc.StatusCode.UNAUTHENTICATED, (key, who, why)
                assert not why.startswith(f"{key} needs role"), (key, who, why)
            else:
                assert got == grpc.StatusCode.PERMISSION_DENIED, (key, who, got)
                assert why.startswith(f"{key} needs role"), (key, who, why)
                refused.append(f"{key}:{who}")
    # every (method, principal) pair the table does not allow was refused: 39 today
    expected = sum(
        1
        for key, _, _ in changing
        for role, _ in TOKENS.values()
        if role is not Role.OPERATOR and role not in ACCESS[key]
    )
    assert len(refused) == expected and expected >= 30


async def test_closed_reads_need_a_known_token_of_any_role(plane: Plane) -> None:
    reads = [(k, m, cls) for k, m, cls in _methods() if ACCESS[k] == READ]
    for key, m, cls in reads:
        assert await _code(plane, key, m, cls, "anon") == grpc.StatusCode.UNAUTHENTICATED, key
    got = await plane.registry("wk").ListWorkers(r.ListWorkersRequest(), timeout=5)
    assert got is not None


async def _register(plane: Plane, wid: str, **kw: Any) -> str:
    resp = await plane.registry("wk").RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(wid, **kw), lease_ttl_ms=60_000), timeout=5
    )
    return str(resp.credential)


async def test_a_worker_touches_only_its_own_record(plane: Plane) -> None:
    cred_a = await _register(plane, "auth-a")
    cred_b = await _register(plane, "auth-b")
    wk, ops = plane.registry("wk"), plane.registry("ops")
    denied = grpc.StatusCode.PERMISSION_DENIED
    # another worker's record, with one's own credential or none
    for call in (
        wk.DrainWorker(r.DrainWorkerRequest(worker_id="auth-b", credential=cred_a), timeout=5),
        wk.DrainWorker(r.DrainWorkerRequest(worker_id="auth-b"), timeout=5),
        wk.DeregisterWorker(
            r.DeregisterWorkerRequest(worker_id="auth-b", credential=cred_a), timeout=5
        ),
        wk.DeregisterWorker(r.DeregisterWorkerRequest(worker_id="auth-b"), timeout=5),
        wk.Heartbeat(r.HeartbeatRequest(worker_id="auth-b", credential=cred_a), timeout=5),
    ):
        assert await code_of(call) == denied
    # taking over a live id with a fresh registration
    takeover = wk.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability("auth-b")), timeout=5
    )
    assert await code_of(takeover) == grpc.StatusCode.ALREADY_EXISTS
    still = await ops.GetWorker(r.GetWorkerRequest(worker_id="auth-b"), timeout=5)
    assert not still.worker.status.draining
    # its own record: allowed
    got = await wk.DrainWorker(
        r.DrainWorkerRequest(worker_id="auth-a", credential=cred_a, reason="self"), timeout=5
    )
    assert got.worker.status.draining
    # an operator may take out someone else's worker without its credential
    with structlog.testing.capture_logs() as logs:
        await ops.DeregisterWorker(r.DeregisterWorkerRequest(worker_id="auth-b"), timeout=5)
    assert await code_of(ops.GetWorker(r.GetWorkerRequest(worker_id="auth-b"), timeout=5)) == (
        grpc.StatusCode.NOT_FOUND
    )
    audits = [e for e in logs if e.get("event") == "audit"]
    assert any(
        e["method"] == "RegistryService/DeregisterWorker"
        and e["caller"] == "ops"
        and e["worker_id"] == "auth-b"
        and e["outcome"] == "OK"
        for e in audits
    ), audits
    assert cred_b  # (b's credential was never needed)


async def test_a_directive_names_its_real_issuer_not_the_one_written(plane: Plane) -> None:
    cred = await _register(plane, "auth-d")
    await plane.registry("ops").SendDirective(
        r.SendDirectiveRequest(
            worker_id="auth-d",
            directive=c.Directive(kind=c.DIRECTIVE_KIND_DRAIN, reason="x", issuer="the-ceo"),
        ),
        timeout=5,
    )
    hb = await plane.registry("wk").Heartbeat(
        r.HeartbeatRequest(worker_id="auth-d", credential=cred), timeout=5
    )
    assert [d.issuer for d in hb.directives] == ["operator:ops"]


async def test_a_gateway_reports_outcomes_of_its_own_requests_only(plane: Plane) -> None:
    # a prefill and a decode worker, each with a load report (the scheduler's informer
    # watches a registry whose reads are closed: it plans only if its token works)
    for wid, stages in (("auth-p", (c.STAGE_PREFILL,)), ("auth-dec", (c.STAGE_DECODE,))):
        cred = await _register(plane, wid, pool_id=f"pool-{wid}", stages=stages)
        await plane.registry("wk").Heartbeat(
            r.HeartbeatRequest(worker_id=wid, credential=cred, load=load()), timeout=5
        )
    gw1, gw2, ops = plane.scheduler("gw-1"), plane.scheduler("gw-2"), plane.scheduler("ops")
    req = s.ScheduleRequest(
        request_id="auth-r1", model_id="llama-3-8b", prompt_tokens=1000, expected_output_tokens=50
    )
    plan = None
    for _ in range(100):  # until the scheduler's view holds both workers
        try:
            plan = (await gw1.Schedule(req, timeout=5)).plan
            break
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
                raise
            await asyncio.sleep(0.1)
    assert plan is not None and plan.decode_worker_id == "auth-dec"
    outcome = s.ReportOutcomeRequest(request_id="auth-r1", success=True, ttft_ms=50, tpot_ms=10)
    # another gateway: refused, and nothing released or recorded
    assert await code_of(gw2.ReportOutcome(outcome, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    rec = await ops.GetRouteRecord(s.GetRouteRecordRequest(request_id="auth-r1"), timeout=5)
    assert not rec.record.HasField("outcome")
    # the gateway that asked: accepted, and its report is the one kept
    got = await gw1.ReportOutcome(outcome, timeout=5)
    assert got.released and got.first_report
    # planned over ScheduleStream: the record names the gateway on the stream just the same
    req2 = s.ScheduleRequest(
        request_id="auth-r2", model_id="llama-3-8b", prompt_tokens=1000, expected_output_tokens=50
    )
    (answer,) = [a async for a in gw1.ScheduleStream(iter([req2]), timeout=5)]
    assert answer.response.plan.decode_worker_id == "auth-dec", answer
    outcome2 = s.ReportOutcomeRequest(request_id="auth-r2", success=True, ttft_ms=50, tpot_ms=10)
    assert await code_of(gw2.ReportOutcome(outcome2, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert (await gw1.ReportOutcome(outcome2, timeout=5)).released
    # a policy switch is an operator's, not a gateway's
    assert (
        await code_of(gw1.ReloadPolicy(s.ReloadPolicyRequest(builtin_profile="random"), timeout=5))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    # the broker: a gateway may not open a session; a worker acts only with its credential
    open_req = kb.OpenSessionRequest(
        request_id="auth-r1", source_worker_id="auth-p", destination_worker_id="auth-dec",
        expected_bytes=1 << 20,
    )  # fmt: skip
    assert await code_of(plane.broker("gw-1").OpenSession(open_req, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert await code_of(
        plane.broker("wk").AbortSession(kb.AbortSessionRequest(session_id="nope"), timeout=5)
    ) in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
