"""KvBrokerService through its gRPC API: negotiation rules, the matrix, session lifecycle,
who may do what, WatchSession and ListSessions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as k
from hetero_pd.v1 import registry_pb2 as r
from hpd_common.errors import InvalidArgument
from hpd_kvbroker.settings import KvBrokerSettings, policy_from
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.fleet import capability, kv_format
from tests.support.kvbroker import (
    GIB,
    BrokerHandle,
    caller,
    open_request,
    register,
    start_broker,
)
from tests.support.servers import RegistryHandle, external

# These start their own broker over the suite's Redis; against a compose stack (whose
# registry keeps its credentials in the stack's Redis) the stack's own suite covers it.
pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own broker"),
]

TOKEN = "sched-secret"
SCHED = k.SessionCaller(scheduler_token=TOKEN)
V = k.CompatibilityVerdict


@dataclass
class Env:
    broker: BrokerHandle
    registry: RegistryHandle
    creds: dict[str, str]

    @property
    def stub(self) -> Any:
        return self.broker.stub

    def as_(self, worker_id: str) -> k.SessionCaller:
        return caller(worker_id, self.creds[worker_id])


@pytest.fixture
async def env(
    redis_server: EmbeddedRedis, registry: RegistryHandle, key_prefix: str
) -> AsyncIterator[Env]:
    creds = {
        "p1": await register(registry.stub, "p1", lease_ttl_ms=30_000),
        "d1": await register(
            registry.stub,
            "d1",
            lease_ttl_ms=30_000,
            pool_id="a100-decode",
            stages=(c.STAGE_DECODE,),
            gpu="A100-80G",
            block=32,
        ),
        "d2": await register(
            registry.stub,
            "d2",
            lease_ttl_ms=30_000,
            pool_id="l40s-decode",
            stages=(c.STAGE_DECODE,),
            gpu="L40S",
            dtype=c.KV_DTYPE_FP8_E4M3,
        ),
        "x1": await register(registry.stub, "x1", lease_ttl_ms=30_000),
    }
    broker = await start_broker(
        redis_server.url, key_prefix, registry_target=registry.target, scheduler_token=TOKEN
    )
    assert broker.service.informer is not None
    assert await broker.service.informer.wait_synced(5)
    yield Env(broker, registry, creds)
    await broker.close()


async def code_of(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# -- negotiation -------------------------------------------------------------------------------

FP8, BF16, FP16 = c.KV_DTYPE_FP8_E4M3, c.KV_DTYPE_BF16, c.KV_DTYPE_FP16
NHD, HND, CONT = c.KV_LAYOUT_PAGED_NHD, c.KV_LAYOUT_PAGED_HND, c.KV_LAYOUT_CONTIGUOUS


def fmt(**kw: Any) -> c.KvFormat:
    layers = kw.pop("num_layers", None)
    heads = kw.pop("num_kv_heads", None)
    dim = kw.pop("head_dim", None)
    f = kv_format(**kw)
    if layers is not None:
        f.num_layers = layers
    if heads is not None:
        f.num_kv_heads = heads
    if dim is not None:
        f.head_dim = dim
    return f


RULES = [
    pytest.param({}, V.COMPATIBILITY_VERDICT_COMPATIBLE, [], id="identical"),
    pytest.param({"revision": "rev-b"}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["model_revision_mismatch"], id="model-revision"),
    pytest.param({"num_layers": 40}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["num_layers_mismatch"], id="layers"),
    pytest.param({"num_kv_heads": 4}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["kv_heads_mismatch"], id="kv-heads"),
    pytest.param({"head_dim": 64}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["head_dim_mismatch"], id="head-dim"),
    pytest.param({"dtype": FP8}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["kv_dtype_narrowing_not_allowed"], id="dtype-narrowing-refused"),
    pytest.param({"dtype": FP16}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["kv_dtype_narrowing_not_allowed"], id="dtype-same-width-lossy"),
    pytest.param({"layout": HND}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["kv_layout_mismatch"], id="layout-permute"),
    pytest.param({"layout": CONT}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["kv_layout_mismatch"], id="layout-repack"),
    pytest.param({"block": 32}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["block_size_mismatch"], id="block-regroup"),
    pytest.param({"tp": 2}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["tp_size_mismatch"], id="tp-reshard"),
    pytest.param({"backend": "flashinfer"}, V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["attention_backend_mismatch"], id="attention-backend"),
    pytest.param({"layout": HND, "block": 64, "tp": 4}, V.COMPATIBILITY_VERDICT_CONVERTIBLE,
                 ["kv_layout_mismatch", "block_size_mismatch", "tp_size_mismatch"],
                 id="three-conversions"),
    pytest.param({"revision": "x", "backend": "sdpa", "block": 32},
                 V.COMPATIBILITY_VERDICT_INCOMPATIBLE,
                 ["model_revision_mismatch", "attention_backend_mismatch"], id="every-reason"),
]  # fmt: skip


@pytest.mark.parametrize(("dst", "verdict", "reasons"), RULES)
async def test_negotiate_rules(
    env: Env, dst: dict[str, Any], verdict: int, reasons: list[str]
) -> None:
    resp = await env.stub.Negotiate(
        k.NegotiateRequest(source_format=fmt(), destination_format=fmt(**dst), kv_bytes=GIB),
        timeout=5,
    )
    n = resp.negotiation
    assert (n.verdict, list(n.reasons)) == (verdict, reasons)
    assert len(n.details) == len(reasons)
    if verdict == V.COMPATIBILITY_VERDICT_CONVERTIBLE:
        assert len(n.steps) == len(reasons)
        assert resp.conversion_ms == pytest.approx(sum(s.cost_ms_per_gib for s in n.steps))
    else:
        assert list(n.steps) == []


def test_fp8_widening_is_allowed_by_the_rules_the_broker_uses() -> None:
    """The widening direction of the dtype rule (fp8 -> bf16) is a conversion."""
    from hpd_common.kvformat import KvDtype, KvFormat, KvLayout, negotiate

    src = KvFormat(KvDtype.FP8_E4M3, KvLayout.PAGED_NHD, 16, 32, 8, 128)
    dst = KvFormat(KvDtype.BF16, KvLayout.PAGED_NHD, 16, 32, 8, 128)
    policy = policy_from(KvBrokerSettings())
    assert negotiate(src, dst, policy).reasons == ("kv_dtype_mismatch",)


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        pytest.param("", frozenset(), id="none"),
        pytest.param(
            "flash_attn+flashinfer, xformers+sdpa",
            frozenset({frozenset({"flash_attn", "flashinfer"}), frozenset({"xformers", "sdpa"})}),
            id="two-groups",
        ),
    ],
)
def test_policy_from_settings(text: str, groups: frozenset[frozenset[str]]) -> None:
    assert policy_from(KvBrokerSettings(compatible_backends=text)).compatible_backends == groups


def test_policy_refuses_a_group_of_one() -> None:
    with pytest.raises(InvalidArgument, match="compatible_backends"):
        policy_from(KvBrokerSettings(compatible_backends="flash_attn"))


async def test_negotiate_between_registered_workers(env: Env) -> None:
    resp = await env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_worker_id="d1", kv_bytes=4 * GIB),
        timeout=5,
    )
    assert resp.negotiation.verdict == V.COMPATIBILITY_VERDICT_CONVERTIBLE
    assert resp.destination_format.block_size_tokens == 32
    assert resp.conversion_ms == pytest.approx(4.0)  # block regroup: 1 ms/GiB x 4 GiB
    mixed = await env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_format=fmt()), timeout=5
    )
    assert mixed.negotiation.verdict == V.COMPATIBILITY_VERDICT_COMPATIBLE
    missing = env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_worker_id="nobody"), timeout=5
    )
    assert await code_of(missing) == grpc.StatusCode.NOT_FOUND


async def test_workers_of_different_models_are_incompatible_whatever_their_formats(
    env: Env,
) -> None:
    """A descriptor does not name its model: another model with the same shapes and the same
    revision name has an identical format. Its KV is still meaningless here."""
    await register(
        env.registry.stub, "m1", lease_ttl_ms=30_000, model="mistral-7b", stages=(c.STAGE_DECODE,)
    )
    resp = await env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_worker_id="m1"), timeout=5
    )
    assert resp.source_format == resp.destination_format
    assert resp.negotiation.verdict == V.COMPATIBILITY_VERDICT_INCOMPATIBLE
    assert list(resp.negotiation.reasons) == ["model_mismatch"]
    assert "mistral-7b" in resp.negotiation.details[0]
    opened = env.stub.OpenSession(open_request("cross-model", dst="m1", who=SCHED), timeout=5)
    assert await code_of(opened) == grpc.StatusCode.FAILED_PRECONDITION
    by_format = await env.stub.Negotiate(
        k.NegotiateRequest(source_worker_id="p1", destination_format=resp.destination_format),
        timeout=5,
    )
    assert by_format.negotiation.verdict == V.COMPATIBILITY_VERDICT_COMPATIBLE


async def _matrix(env: Env) -> list[tuple[str, str, int]]:
    resp = await env.stub.GetCompatibilityMatrix(
        k.GetCompatibilityMatrixRequest(model_id="llama-3-8b"), timeout=5
    )
    return [(p.prefill_worker_id, p.decode_worker_id, p.negotiation.verdict) for p in resp.pairs]


async def _eventually(check: Callable[[], Any], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def test_matrix_follows_the_registry(env: Env) -> None:
    assert await _matrix(env) == [
        ("p1", "d1", V.COMPATIBILITY_VERDICT_CONVERTIBLE),
        ("p1", "d2", V.COMPATIBILITY_VERDICT_INCOMPATIBLE),
        ("x1", "d1", V.COMPATIBILITY_VERDICT_CONVERTIBLE),
        ("x1", "d2", V.COMPATIBILITY_VERDICT_INCOMPATIBLE),
    ]
    await register(env.registry.stub, "d3", stages=(c.STAGE_DECODE,), lease_ttl_ms=30_000)

    async def has_d3() -> bool:
        return ("p1", "d3", V.COMPATIBILITY_VERDICT_COMPATIBLE) in await _matrix(env)

    await _eventually(has_d3)
    await env.registry.stub.DeregisterWorker(
        r.DeregisterWorkerRequest(worker_id="x1", credential=env.creds["x1"]), timeout=5
    )

    async def no_x1() -> bool:
        return all(p != "x1" for p, _, _ in await _matrix(env))

    await _eventually(no_x1)


# -- sessions: who may do what ---------------------------------------------------------------

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
        "gateway": k.SessionCaller(gateway_token="gw"),
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

    await _eventually(failed)
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
    open_broker = await start_broker(redis_server.url, key_prefix)
    try:
        resp = await open_broker.stub.OpenSession(open_request("req-5"), timeout=5)
        assert resp.session.updated_by == "scheduler"
        progress = open_broker.stub.ReportProgress(
            k.ReportProgressRequest(session_id=resp.session.session_id, bytes_done=1), timeout=5
        )
        assert await code_of(progress) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await open_broker.close()


# -- lifecycle, watch, list --------------------------------------------------------------------


async def test_all_bytes_arrived_completes_without_progress_in_one_call(env: Env) -> None:
    """A caller that reported no progress (a gateway that saw the decode side produce from
    the KV) completes a NEGOTIATED or RESERVED session in one call when it says every byte
    arrived; without saying so, completing still needs reported progress."""
    p1, d1 = env.as_("p1"), env.as_("d1")
    for i, reserve in enumerate((False, True)):
        opened = await env.stub.OpenSession(open_request(f"req-all-{i}", who=p1), timeout=5)
        sid = opened.session.session_id
        if reserve:
            await env.stub.ReportProgress(
                k.ReportProgressRequest(session_id=sid, caller=d1, state=k.SESSION_STATE_RESERVED),
                timeout=5,
            )
        early = env.stub.CompleteSession(k.CompleteSessionRequest(session_id=sid, caller=d1))
        assert await code_of(early) == grpc.StatusCode.FAILED_PRECONDITION
        before = (await env.stub.GetSession(k.GetSessionRequest(session_id=sid))).session
        assert before.bytes_done == 0
        done = await env.stub.CompleteSession(
            k.CompleteSessionRequest(session_id=sid, caller=d1, all_bytes_arrived=True)
        )
        assert done.session.state == k.SESSION_STATE_COMPLETE
        assert done.session.bytes_done == done.session.expected_bytes > 0
        assert done.session.version == before.version + 1
        again = await env.stub.CompleteSession(
            k.CompleteSessionRequest(session_id=sid, caller=p1, all_bytes_arrived=True)
        )
        assert again.session == done.session  # a retry changes nothing


async def test_a_full_lifecycle_seen_by_a_watcher(env: Env) -> None:
    opened = await env.stub.OpenSession(open_request("req-6", who=env.as_("p1")), timeout=5)
    sid = opened.session.session_id
    watch = env.stub.WatchSession(k.WatchSessionRequest(request_id="req-6"))
    seen = [(await watch.read()).session]
    p1, d1 = env.as_("p1"), env.as_("d1")
    await env.stub.ReportProgress(
        k.ReportProgressRequest(session_id=sid, caller=d1, state=k.SESSION_STATE_RESERVED),
        timeout=5,
    )
    for n in (GIB // 4, GIB // 2):
        await env.stub.ReportProgress(
            k.ReportProgressRequest(session_id=sid, caller=p1, bytes_done=n), timeout=5
        )
    back = env.stub.ReportProgress(
        k.ReportProgressRequest(session_id=sid, caller=p1, bytes_done=GIB // 8), timeout=5
    )
    assert await code_of(back) == grpc.StatusCode.FAILED_PRECONDITION
    done = await env.stub.CompleteSession(k.CompleteSessionRequest(session_id=sid, caller=d1))
    again = await env.stub.CompleteSession(k.CompleteSessionRequest(session_id=sid, caller=p1))
    assert again.session == done.session
    late = env.stub.AbortSession(k.AbortSessionRequest(session_id=sid, caller=SCHED), timeout=5)
    assert await code_of(late) == grpc.StatusCode.FAILED_PRECONDITION
    while (msg := await watch.read()) is not grpc.aio.EOF:
        seen.append(msg.session)
    assert [(s.state, s.bytes_done, s.version) for s in seen] == [
        (k.SESSION_STATE_NEGOTIATED, 0, 1),
        (k.SESSION_STATE_RESERVED, 0, 2),
        (k.SESSION_STATE_TRANSFERRING, GIB // 4, 3),
        (k.SESSION_STATE_TRANSFERRING, GIB // 2, 4),
        (k.SESSION_STATE_COMPLETE, GIB, 5),
    ]
    resumed = env.stub.WatchSession(k.WatchSessionRequest(session_id=sid, from_version=3))
    assert [m.session.version async for m in resumed] == [5]


async def test_a_failure_report_needs_a_reason_and_ends_the_session(env: Env) -> None:
    opened = await env.stub.OpenSession(open_request("req-7", who=SCHED), timeout=5)
    sid = opened.session.session_id
    no_reason = k.ReportProgressRequest(
        session_id=sid, caller=env.as_("d1"), state=k.SESSION_STATE_FAILED
    )
    assert await code_of(env.stub.ReportProgress(no_reason, timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    no_reason.reason = "rdma link down"
    failed = await env.stub.ReportProgress(no_reason, timeout=5)
    assert (failed.session.state, failed.session.reason) == (
        k.SESSION_STATE_FAILED,
        "rdma link down",
    )


async def test_list_sessions_filters_and_pages(env: Env) -> None:
    sids = []
    for i in range(5):
        opened = await env.stub.OpenSession(open_request(f"list-{i}", who=SCHED), timeout=5)
        sids.append(opened.session.session_id)
    await env.stub.AbortSession(k.AbortSessionRequest(session_id=sids[1], caller=SCHED))
    pages: list[list[str]] = []
    token = ""
    while True:
        resp = await env.stub.ListSessions(
            k.ListSessionsRequest(page_size=2, page_token=token), timeout=5
        )
        pages.append([s.session_id for s in resp.sessions])
        token = resp.next_page_token
        if not token:
            break
    assert [sid for page in pages for sid in page] == sorted(sids)
    assert [len(p) for p in pages] == [2, 2, 1]
    aborted = await env.stub.ListSessions(
        k.ListSessionsRequest(state=k.SESSION_STATE_ABORTED), timeout=5
    )
    assert [s.session_id for s in aborted.sessions] == [sids[1]]
    of_d2 = await env.stub.ListSessions(k.ListSessionsRequest(worker_id="d2"), timeout=5)
    assert list(of_d2.sessions) == []
    of_d1 = await env.stub.ListSessions(k.ListSessionsRequest(worker_id="d1"), timeout=5)
    assert len(of_d1.sessions) == 5


async def test_listing_moves_past_ids_whose_sessions_are_gone(env: Env) -> None:
    """A scan batch whose sessions were all purged between the index read and the hash
    reads is not the end of the listing."""
    sids = []
    for i in range(5):
        opened = await env.stub.OpenSession(open_request(f"gone-{i}", who=SCHED), timeout=5)
        sids.append(opened.session.session_id)
    sids.sort()  # listing order (ids opened in the same millisecond sort by their random part)
    svc = env.broker.service
    await svc.client.delete(*(svc.store.keys.session(sid) for sid in sids[:3]))
    listed, token = await svc.list_sessions(None, "", 10, "", scan_batch=2)
    assert ([s.session_id for s in listed], token) == (sids[3:], "")
    first, token = await svc.list_sessions(None, "", 1, "", scan_batch=2)
    assert [s.session_id for s in first] == [sids[3]] and token == sids[3]
    rest, token = await svc.list_sessions(None, "", 1, token, scan_batch=2)
    assert ([s.session_id for s in rest], token) == ([sids[4]], "")


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_metrics_count_changes_bytes_durations_expiries_and_verdicts(env: Env) -> None:
    """What the broker exports (`hpd_kv_*`) moves with each session change it makes."""
    names = {
        "opened": ("hpd_kv_sessions_total", {"state": "NEGOTIATED"}),
        "moving": ("hpd_kv_sessions_total", {"state": "TRANSFERRING"}),
        "complete": ("hpd_kv_sessions_total", {"state": "COMPLETE"}),
        "expired": ("hpd_kv_sessions_total", {"state": "EXPIRED"}),
        "moved_bytes": ("hpd_kv_session_bytes_total", {"state": "COMPLETE"}),
        "stranded_bytes": ("hpd_kv_session_bytes_total", {"state": "EXPIRED"}),
        "durations": ("hpd_kv_session_duration_seconds_count", {"state": "COMPLETE"}),
        "deadline_expiries": ("hpd_kv_session_expiries_total", {"reason": "deadline_exceeded"}),
        "convertible": ("hpd_kv_negotiations_total", {"verdict": "convertible"}),
    }

    def snapshot() -> dict[str, float]:
        return {key: _sample(name, **labels) for key, (name, labels) in names.items()}

    before = snapshot()
    p1, d1 = env.as_("p1"), env.as_("d1")
    opened = await env.stub.OpenSession(open_request("metrics-1", who=p1), timeout=5)
    assert opened.session.negotiation.verdict == V.COMPATIBILITY_VERDICT_CONVERTIBLE
    sid = opened.session.session_id
    await env.stub.ReportProgress(
        k.ReportProgressRequest(session_id=sid, caller=p1, bytes_done=GIB // 2), timeout=5
    )
    await env.stub.CompleteSession(k.CompleteSessionRequest(session_id=sid, caller=d1), timeout=5)
    late = await env.stub.OpenSession(
        open_request("metrics-2", who=p1, deadline_ms=1_000, lease_ttl_ms=1_000), timeout=5
    )
    await env.stub.ReportProgress(
        k.ReportProgressRequest(session_id=late.session.session_id, caller=p1, bytes_done=GIB // 4),
        timeout=5,
    )

    async def expired() -> bool:
        got = await env.stub.GetSession(
            k.GetSessionRequest(session_id=late.session.session_id), timeout=5
        )
        return bool(got.session.state == k.SESSION_STATE_EXPIRED)

    await _eventually(expired)
    after = snapshot()
    assert {key: after[key] - before[key] for key in names} == {
        "opened": 2,
        "moving": 2,
        "complete": 1,
        "expired": 1,
        "moved_bytes": GIB,
        "stranded_bytes": GIB // 4,
        "durations": 1,
        "deadline_expiries": 1,
        "convertible": 2,
    }


async def test_hpd_sessions_and_hpd_compat_print_tables(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator's views: `hpd sessions` (filters, --limit, JSON) and `hpd compat MODEL`."""
    from hpd_tools.tables import kvbroker as tables

    for i in range(3):
        await env.stub.OpenSession(open_request(f"cli-{i}", who=SCHED), timeout=5)
    base = ["--kvbroker", env.broker.target]

    async def hpd(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await asyncio.to_thread(tables.main, [argv[0], *base, *argv[1:]])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = await hpd("sessions", "--limit", "2")
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].split()[:2] == ["SESSION", "REQUEST"]
    assert len(lines) == 3 and all("NEGOTIATED" in line for line in lines[1:])
    code, out, _ = await hpd("sessions", "--state", "negotiated", "-o", "json")
    assert code == 0 and sorted(s["request_id"] for s in json.loads(out)) == [
        "cli-0",
        "cli-1",
        "cli-2",
    ]
    code, out, _ = await hpd("sessions", "--state", "complete")
    assert code == 0 and len(out.strip().splitlines()) == 1  # the header alone
    for bad in (("--limit", "0"), ("--state", "bogus")):
        code, _, err = await hpd("sessions", *bad)
        assert code == 2 and err.startswith("hpd sessions:")
    code, out, _ = await hpd("compat", "llama-3-8b")
    rows = [line.split() for line in out.strip().splitlines()]
    assert code == 0 and rows[0] == ["PREFILL", "DECODE", "VERDICT", "MS/GIB", "REASONS"]
    assert ["p1", "d1", "CONVERTIBLE", "1", "block_size_mismatch"] in rows[1:], out
