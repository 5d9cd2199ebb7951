"""KvBrokerService through its gRPC API: who may open, report, complete and abort a session."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as k
from hetero_pd.v1 import registry_pb2 as r
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.fleet import capability
from tests.support.kvbroker import (
    GATEWAY,
    GIB,
    SCHED,
    Env,
    V,
    caller,
    code_of,
    eventually,
    open_request,
    register,
    start_broker,
)
from tests.support.kvbroker import (
    env as env,
)
from tests.support.servers import external

# These start their own broker over the suite's Redis; against a compose stack (whose
# registry keeps its credentials in the stack's Redis) the stack's own suite covers it.
pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own broker"),
]


# -- sessions: who may do what ---------------------------------------------------------------

BF16 = c.KV_DTYPE_BF16

AUTH_CASES = [
    pytest.param("scheduler", grpc.StatusCode.OK, id="scheduler-token"),
    pytest.param("p1", grpc.StatusCode.OK, id="source-worker"),
    pytest.param("d1", grpc.StatusCode.OK, id="destination-worker"),
    pytest.param("x1", grpc.StatusCode.PERMISSION_DENIED, id="other-worker"),
    pytest.param("p1-bad", grpc.StatusCode.PERMISSION_DENIED, id="wrong-credential"),
    pytest.param("bad-token", grpc.StatusCode.PERMISSION_DENIED, id="wrong-token"),
    pytest.param("nobody", grpc.StatusCode.INVALID_ARGUMENT, id="no-caller"),
    pytest.param("gateway", grpc.StatusCode.PERMISSION_DENIED, id="gateway-may-not-open"),
]


def who(env: Env, name: str) -> k.SessionCaller | None:
    special = {
        "scheduler": SCHED,
        "p1-bad": caller("p1", "not-it"),
        "bad-token": k.SessionCaller(scheduler_token="guess"),
        "gateway": GATEWAY,
        "gateway-guess": k.SessionCaller(gateway_token="guess"),
        "nobody": None,
    }
    return special[name] if name in special else env.as_(name)


@pytest.mark.parametrize(("name", "code"), AUTH_CASES)
async def test_who_may_open(env: Env, name: str, code: grpc.StatusCode) -> None:
    call = env.stub.OpenSession(open_request("req-1", who=who(env, name)), timeout=5)
    assert await code_of(call) == code


@pytest.mark.parametrize(
    ("name", "progress", "abort"),
    [
        pytest.param("p1", grpc.StatusCode.OK, grpc.StatusCode.OK, id="source"),
        pytest.param("d1", grpc.StatusCode.OK, grpc.StatusCode.OK, id="destination"),
        pytest.param("scheduler", grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK,
                     id="scheduler-aborts-only"),
        pytest.param("gateway", grpc.StatusCode.OK, grpc.StatusCode.OK,
                     id="gateway-runs-the-transfer"),
        pytest.param("gateway-guess", grpc.StatusCode.PERMISSION_DENIED,
                     grpc.StatusCode.PERMISSION_DENIED, id="wrong-gateway-token"),
        pytest.param("x1", grpc.StatusCode.PERMISSION_DENIED,
                     grpc.StatusCode.PERMISSION_DENIED, id="other-worker"),
        pytest.param("p1-bad", grpc.StatusCode.PERMISSION_DENIED,
                     grpc.StatusCode.PERMISSION_DENIED, id="wrong-credential"),
    ],
)  # fmt: skip
async def test_who_may_advance(
    env: Env, name: str, progress: grpc.StatusCode, abort: grpc.StatusCode
) -> None:
    opened = await env.stub.OpenSession(open_request("req-2", who=SCHED), timeout=5)
    sid = opened.session.session_id
    req = k.ReportProgressRequest(session_id=sid, caller=who(env, name), bytes_done=10)
    assert await code_of(env.stub.ReportProgress(req, timeout=5)) == progress
    abort_req = k.AbortSessionRequest(session_id=sid, caller=who(env, name))
    assert await code_of(env.stub.AbortSession(abort_req, timeout=5)) == abort
    got = await env.stub.GetSession(k.GetSessionRequest(session_id=sid), timeout=5)
    expected = k.SESSION_STATE_ABORTED if abort == grpc.StatusCode.OK else (
        k.SESSION_STATE_TRANSFERRING if progress == grpc.StatusCode.OK
        else k.SESSION_STATE_NEGOTIATED
    )  # fmt: skip
    assert got.session.state == expected


async def test_open_is_idempotent_per_request_id(env: Env) -> None:
    first = await env.stub.OpenSession(open_request("req-3", who=SCHED), timeout=5)
    again = await env.stub.OpenSession(open_request("req-3", who=env.as_("d1")), timeout=5)
    assert first.created and not again.created
    assert again.session == first.session
    other = env.stub.OpenSession(open_request("req-3", who=SCHED, expected=GIB + 1), timeout=5)
    assert await code_of(other) == grpc.StatusCode.ALREADY_EXISTS


async def test_a_retried_open_after_a_worker_left_returns_its_session(env: Env) -> None:
    """The first OpenSession succeeded, then the decode worker left and its session failed.
    A retry of the same request gets that session (created false), not NOT_FOUND."""
    cred = await register(env.registry.stub, "d9", lease_ttl_ms=30_000, stages=(c.STAGE_DECODE,))
    req = open_request("retry-1", dst="d9", who=SCHED)
    first = await env.stub.OpenSession(req, timeout=5)
    sid = first.session.session_id
    await env.registry.stub.DeregisterWorker(
        r.DeregisterWorkerRequest(worker_id="d9", credential=cred), timeout=5
    )

    async def failed() -> bool:
        got = await env.stub.GetSession(k.GetSessionRequest(session_id=sid), timeout=5)
        return bool(got.session.state == k.SESSION_STATE_FAILED)

    await eventually(failed)
    again = await env.stub.OpenSession(req, timeout=5)
    assert (again.created, again.session.session_id) == (False, sid)
    assert again.session.state == k.SESSION_STATE_FAILED
    fresh = env.stub.OpenSession(open_request("retry-2", dst="d9", who=SCHED), timeout=5)
    assert await code_of(fresh) == grpc.StatusCode.NOT_FOUND


async def test_a_worker_that_changes_its_kv_format_gets_a_new_verdict(env: Env) -> None:
    """A verdict follows the workers' current records: re-registered with another KV
    dtype, the same pair gets the new verdict."""
    refused = env.stub.OpenSession(open_request("req-fmt-1", dst="d2", who=SCHED), timeout=5)
    assert await code_of(refused) == grpc.StatusCode.FAILED_PRECONDITION
    informer = env.broker.service.informer
    assert informer is not None
    before = informer.workers["d2"]
    cap = capability("d2", pool_id="l40s-decode", stages=(c.STAGE_DECODE,), gpu="L40S", dtype=BF16)
    await env.registry.stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=cap, credential=env.creds["d2"], lease_ttl_ms=30_000),
        timeout=5,
    )
    for _ in range(100):
        if informer.workers["d2"] is not before:
            break
        await asyncio.sleep(0.05)
    opened = await env.stub.OpenSession(open_request("req-fmt-2", dst="d2", who=SCHED), timeout=5)
    assert opened.created
    assert opened.session.negotiation.verdict == V.COMPATIBILITY_VERDICT_COMPATIBLE


async def test_an_incompatible_pair_gets_no_session(env: Env) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await env.stub.OpenSession(open_request("req-4", dst="d2", who=SCHED), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "bf16" in (err.value.details() or "")
    got = env.stub.GetSession(k.GetSessionRequest(request_id="req-4"), timeout=5)
    assert await code_of(got) == grpc.StatusCode.NOT_FOUND


async def test_open_without_a_token_configured_needs_no_credential(
    redis_server: EmbeddedRedis, env: Env, key_prefix: str
) -> None:
    """Auth off and no token configured (development): an empty caller is the control
    plane; an in-message token it cannot check is refused, not waved through."""
    open_broker = await start_broker(redis_server.url, key_prefix)
    try:
        resp = await open_broker.stub.OpenSession(open_request("req-5"), timeout=5)
        assert resp.session.updated_by == "scheduler"
        sid = resp.session.session_id
        guessed = open_broker.stub.ReportProgress(
            k.ReportProgressRequest(
                session_id=sid, bytes_done=1, caller=k.SessionCaller(gateway_token="gateway")
            ),
            timeout=5,
        )
        assert await code_of(guessed) == grpc.StatusCode.PERMISSION_DENIED
        progress = await open_broker.stub.ReportProgress(
            k.ReportProgressRequest(session_id=sid, bytes_done=1), timeout=5
        )
        assert progress.session.bytes_done == 1
    finally:
        await open_broker.close()
