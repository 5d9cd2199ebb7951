"""An attacker with some credential of the fleet: each attempt is refused by the caller's
verified identity, never decided by what the message says about itself.

Every test here failed on the code before its fix: a worker token plus any in-message
``gateway_token`` completed another pair's KV session (the broker's token settings were
empty, so the token check was skipped and the actor became the trusted ''); any worker token
registered any id in any pool; reads were open to anyone with auth on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_common.auth import TokenBook
from hpd_common.channels import CallIdentity, aio_channel
from hpd_common.errors import InvalidArgument
from hpd_tools.controlplane import ControlPlane, ControlPlaneSettings
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.auth_plane import Plane, auth_plane
from tests.support.fleet import capability
from tests.support.kvbroker import code_of, open_request, start_broker
from tests.support.servers import external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own servers"),
]

RACK7 = {
    "role": "worker",
    "token": "rack-seven-token-0123456789abcd",
    "workers": "r7-*",
    "pools": ["h100-prefill"],
}


@pytest.fixture
async def plane(
    redis_server: EmbeddedRedis, key_prefix: str, tmp_path: Path
) -> AsyncIterator[Plane]:
    async with auth_plane(redis_server.url, key_prefix, tmp_path, {"rack7": RACK7}) as p:
        yield p


async def _register(plane: Plane, wid: str, who: str = "wk", **kw: Any) -> str:
    resp = await plane.registry(who).RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(wid, **kw), lease_ttl_ms=60_000), timeout=5
    )
    return str(resp.credential)


async def test_a_worker_cannot_finish_fail_or_abort_another_pairs_session(plane: Plane) -> None:
    await _register(plane, "sec-p")
    await _register(plane, "sec-d", pool_id="h100-decode", stages=(c.STAGE_DECODE,))
    cred_x = await _register(plane, "sec-x")
    opened = await plane.broker("sched").OpenSession(
        open_request("sec-r1", src="sec-p", dst="sec-d", who=kb.SessionCaller()), timeout=5
    )
    sid = opened.session.session_id
    broker = plane.broker("wk")
    # a worker that names itself and adds any in-message token of the control plane
    for forged in (
        kb.SessionCaller(worker_id="sec-x", credential=cred_x, gateway_token="anything"),
        kb.SessionCaller(worker_id="sec-x", credential=cred_x, scheduler_token="anything"),
        kb.SessionCaller(gateway_token="anything"),
        kb.SessionCaller(scheduler_token="anything"),
    ):
        attempts = (
            broker.CompleteSession(
                kb.CompleteSessionRequest(session_id=sid, caller=forged, all_bytes_arrived=True),
                timeout=5,
            ),
            broker.ReportProgress(
                kb.ReportProgressRequest(session_id=sid, caller=forged, bytes_done=1), timeout=5
            ),
            broker.AbortSession(kb.AbortSessionRequest(session_id=sid, caller=forged), timeout=5),
        )
        for call in attempts:
            assert await code_of(call) in (
                grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.INVALID_ARGUMENT,
            ), forged
    got = await plane.broker("ops").GetSession(kb.GetSessionRequest(session_id=sid), timeout=5)
    assert got.session.state == kb.SESSION_STATE_NEGOTIATED
    assert got.session.bytes_done == 0


async def test_in_message_tokens_are_refused_where_none_is_configured(
    redis_server: EmbeddedRedis, key_prefix: str
) -> None:
    """Auth off, no broker tokens: a forged token is refused (it was accepted)."""
    broker = await start_broker(redis_server.url, key_prefix)
    try:
        for forged in (
            kb.SessionCaller(scheduler_token="guess"),
            kb.SessionCaller(gateway_token="guess"),
        ):
            call = broker.stub.OpenSession(open_request("sec-open", who=forged), timeout=5)
            assert await code_of(call) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await broker.close()


async def test_a_scoped_worker_token_registers_only_its_ids_and_pools(plane: Plane) -> None:
    assert await _register(plane, "r7-a", who="rack7")  # its pattern, its pool
    for wid, pool in (("r8-a", "h100-prefill"), ("r7-b", "h100-decode")):
        call = plane.registry("rack7").RegisterWorker(
            r.RegisterWorkerRequest(
                capability=capability(wid, pool_id=pool, stages=(c.STAGE_DECODE,)),
                lease_ttl_ms=60_000,
            ),
            timeout=5,
        )
        assert await code_of(call) == grpc.StatusCode.PERMISSION_DENIED, (wid, pool)
    # and without any token, nothing registers
    anon = plane.registry("anon").RegisterWorker(
        r.RegisterWorkerRequest(capability=capability("r7-c"), lease_ttl_ms=60_000), timeout=5
    )
    assert await code_of(anon) == grpc.StatusCode.UNAUTHENTICATED
    listed = await plane.registry("ops").ListWorkers(r.ListWorkersRequest(), timeout=5)
    assert {w.capability.worker_id for w in listed.workers} == {"r7-a"}


def test_a_scope_is_for_worker_tokens_only() -> None:
    doc = {"tokens": [{"name": "g", "role": "gateway", "token": "x" * 20, "pools": ["p"]}]}
    with pytest.raises(InvalidArgument, match="scopes a worker token"):
        TokenBook.parse(doc, "tokens")
    bad = {"tokens": [{"name": "w", "role": "worker", "token": "x" * 20, "workers": []}]}
    with pytest.raises(InvalidArgument, match="non-empty"):
        TokenBook.parse(bad, "tokens")


async def test_with_auth_on_reads_need_an_identity_by_default(
    redis_server: EmbeddedRedis, key_prefix: str, tmp_path: Path
) -> None:
    """Auth on and nothing said about reads: a stranger cannot list the fleet's endpoints."""
    path = tmp_path / "tokens.yaml"
    path.write_text(
        'tokens:\n  - {name: s, role: scheduler, token: "scheduler-token-0123456789"}\n'
    )
    cp = ControlPlane(
        ControlPlaneSettings(
            redis_url=redis_server.url,
            key_prefix=key_prefix,
            auth_tokens_file=str(path),
            service_token="scheduler-token-0123456789",
        )
    )
    await cp.start()
    try:
        async with aio_channel(cp.registry_target, CallIdentity()) as ch:
            call = r_grpc.RegistryServiceStub(ch).ListWorkers(r.ListWorkersRequest(), timeout=5)
            assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await cp.stop()
