"""Bad input to every field of every KvBrokerService RPC, and random messages to every RPC:
INVALID_ARGUMENT naming the field, nothing written, never INTERNAL or UNKNOWN."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as k
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.fleet import kv_format
from tests.support.kvbroker import GIB, BrokerHandle, caller, register, start_broker
from tests.support.servers import RegistryHandle, external

# These start their own broker over the suite's Redis; against a compose stack (whose
# registry keeps its credentials in the stack's Redis) the stack's own suite covers it.
pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own broker"),
]

TOKEN = "tok"
SCHED = k.SessionCaller(scheduler_token=TOKEN)
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


@pytest.fixture
async def broker(
    redis_server: EmbeddedRedis, registry: RegistryHandle, key_prefix: str
) -> AsyncIterator[tuple[BrokerHandle, str, str]]:
    cred = await register(registry.stub, "p1", lease_ttl_ms=30_000)
    await register(registry.stub, "d1", lease_ttl_ms=30_000, stages=(c.STAGE_DECODE,))
    b = await start_broker(redis_server.url, key_prefix, scheduler_token=TOKEN)
    opened = await b.stub.OpenSession(
        k.OpenSessionRequest(
            request_id="base",
            source_worker_id="p1",
            destination_worker_id="d1",
            expected_bytes=GIB,
            caller=SCHED,
        ),
        timeout=5,
    )
    yield b, opened.session.session_id, cred
    await b.close()


def named(exc: grpc.aio.AioRpcError) -> str:
    """The field an INVALID_ARGUMENT names in its `hpd-field` trailer."""
    return next((str(v) for key, v in exc.trailing_metadata() or () if key == "hpd-field"), "")


def bad_format(**fields: Any) -> c.KvFormat:
    f = kv_format()
    for name, value in fields.items():
        setattr(f, name, value)
    return f


# size: a table of bad inputs, one row per field and fault
def cases(sid: str, cred: str) -> list[tuple[str, str, Any]]:
    """(method, field the error must name, request)."""
    good = caller("p1", cred)

    def open_(**kw: Any) -> k.OpenSessionRequest:
        base: dict[str, Any] = {
            "request_id": "new-req",
            "source_worker_id": "p1",
            "destination_worker_id": "d1",
            "expected_bytes": GIB,
            "caller": SCHED,
        }
        base.update(kw)
        return k.OpenSessionRequest(**base)

    def neg(**kw: Any) -> k.NegotiateRequest:
        base: dict[str, Any] = {"source_format": kv_format(), "destination_format": kv_format()}
        base.update(kw)
        return k.NegotiateRequest(**base)

    def report(**kw: Any) -> k.ReportProgressRequest:
        base: dict[str, Any] = {"session_id": sid, "caller": good, "bytes_done": 1}
        base.update(kw)
        return k.ReportProgressRequest(**base)

    out: list[tuple[str, str, Any]] = [
        ("Negotiate", "source_worker_id", k.NegotiateRequest(destination_format=kv_format())),
        ("Negotiate", "destination_worker_id", k.NegotiateRequest(source_format=kv_format())),
        ("Negotiate", "source_worker_id", neg(source_worker_id="bad id!")),
        ("Negotiate", "destination_worker_id", neg(destination_worker_id="")),
        ("Negotiate", "destination_worker_id", neg(destination_worker_id="x" * 129)),
        ("Negotiate", "source_format.tp_size", neg(source_format=bad_format(tp_size=3))),
    ]
    for name, value in [
        ("dtype", c.KV_DTYPE_UNSPECIFIED),
        ("layout", c.KV_LAYOUT_UNSPECIFIED),
        ("block_size_tokens", 0),
        ("block_size_tokens", 24),
        ("num_layers", 0),
        ("num_kv_heads", 0),
        ("head_dim", 0),
        ("tp_size", 0),
        ("attention_backend", ""),
    ]:
        out.append(
            (
                "Negotiate",
                f"destination_format.{name}",
                neg(destination_format=bad_format(**{name: value})),
            )
        )
    out += [
        ("GetCompatibilityMatrix", "model_id", k.GetCompatibilityMatrixRequest()),
        ("GetCompatibilityMatrix", "model_id", k.GetCompatibilityMatrixRequest(model_id="a b")),
        ("OpenSession", "request_id", open_(request_id="")),
        ("OpenSession", "request_id", open_(request_id="r" * 129)),
        ("OpenSession", "source_worker_id", open_(source_worker_id="")),
        ("OpenSession", "destination_worker_id", open_(destination_worker_id="d/1")),
        ("OpenSession", "destination_worker_id", open_(destination_worker_id="p1")),
        ("OpenSession", "expected_bytes", open_(expected_bytes=0)),
        ("OpenSession", "expected_bytes", open_(expected_bytes=(1 << 50) + 1)),
        ("OpenSession", "deadline_ms", open_(deadline_ms=600_001)),
        ("OpenSession", "caller.worker_id", open_(caller=None)),
        ("OpenSession", "caller.worker_id", open_(caller=caller("p 1", "c"))),
        ("OpenSession", "caller.credential", open_(caller=caller("p1", ""))),
        ("OpenSession", "caller.credential", open_(caller=caller("p1", "c" * 257))),
        ("ReportProgress", "session_id", report(session_id="")),
        ("ReportProgress", "session_id", report(session_id="s s")),
        ("ReportProgress", "caller.worker_id", report(caller=None)),
        ("ReportProgress", "bytes_done", report(bytes_done=GIB + 1)),
        ("ReportProgress", "state", report(state=k.SESSION_STATE_COMPLETE)),
        ("ReportProgress", "state", report(state=99)),
        ("ReportProgress", "reason", report(state=k.SESSION_STATE_FAILED)),
        ("ReportProgress", "reason", report(state=k.SESSION_STATE_FAILED, reason="x" * 257)),
        ("ReportProgress", "reason", report(state=k.SESSION_STATE_FAILED, reason="a\x00b")),
        ("CompleteSession", "session_id", k.CompleteSessionRequest(caller=good)),
        ("CompleteSession", "caller.worker_id", k.CompleteSessionRequest(session_id=sid)),
        ("AbortSession", "session_id", k.AbortSessionRequest(session_id="?", caller=SCHED)),
        ("AbortSession", "caller.worker_id", k.AbortSessionRequest(session_id=sid)),
        (
            "AbortSession",
            "reason",
            k.AbortSessionRequest(session_id=sid, caller=SCHED, reason="y" * 300),
        ),
        ("GetSession", "session_id", k.GetSessionRequest()),
        ("GetSession", "session_id", k.GetSessionRequest(session_id=sid, request_id="base")),
        ("GetSession", "session_id", k.GetSessionRequest(session_id="bad id")),
        ("GetSession", "request_id", k.GetSessionRequest(request_id="bad id")),
        ("ListSessions", "state", k.ListSessionsRequest(state=42)),  # type: ignore[arg-type]
        ("ListSessions", "worker_id", k.ListSessionsRequest(worker_id="w w")),
        ("ListSessions", "page_size", k.ListSessionsRequest(page_size=1001)),
        ("ListSessions", "page_token", k.ListSessionsRequest(page_token="t t")),
    ]
    return out


async def test_every_bad_field_is_named_and_nothing_is_written(
    broker: tuple[BrokerHandle, str, str],
) -> None:
    b, sid, cred = broker
    before = await b.stub.GetSession(k.GetSessionRequest(session_id=sid), timeout=5)
    seen = []
    for method, field, request in cases(sid, cred):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(b.stub, method)(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, field)
        assert named(err.value) == field, (method, field, err.value.details())
        seen.append((method, field))
    after = await b.stub.GetSession(k.GetSessionRequest(session_id=sid), timeout=5)
    assert after == before
    listed = await b.stub.ListSessions(k.ListSessionsRequest(), timeout=5)
    assert [s.session_id for s in listed.sessions] == [sid]
    methods = {m for m, _ in seen}
    assert methods == set(k.DESCRIPTOR.services_by_name["KvBrokerService"].methods_by_name) - {
        "WatchSession"
    }


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        pytest.param(k.WatchSessionRequest(), "session_id", id="neither-id"),
        pytest.param(k.WatchSessionRequest(session_id="a b"), "session_id", id="bad-session-id"),
        pytest.param(k.WatchSessionRequest(request_id="a b"), "request_id", id="bad-request-id"),
    ],
)
async def test_watch_rejects_bad_fields(
    broker: tuple[BrokerHandle, str, str], request_: k.WatchSessionRequest, field: str
) -> None:
    call = broker[0].stub.WatchSession(request_, timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named(err.value) == field


# -- random messages -------------------------------------------------------------------------

text = st.one_of(st.sampled_from(["", "p1", "d1", "base", "tok", "x" * 200]), st.text(max_size=20))
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
enum_val = st.integers(0, 9)
kvformats = st.builds(
    c.KvFormat,
    dtype=enum_val,
    layout=enum_val,
    block_size_tokens=u32,
    num_layers=u32,
    num_kv_heads=u32,
    head_dim=u32,
    tp_size=u32,
    attention_backend=text,
    model_revision=text,
)
callers = st.builds(k.SessionCaller, worker_id=text, credential=text, scheduler_token=text)
neg_requests = st.one_of(
    st.builds(k.NegotiateRequest, source_worker_id=text, destination_worker_id=text, kv_bytes=u64),
    st.builds(
        k.NegotiateRequest, source_format=kvformats, destination_format=kvformats, kv_bytes=u64
    ),
    st.builds(k.NegotiateRequest, source_worker_id=text, destination_format=kvformats),
)
calls = st.one_of(
    st.tuples(st.just("Negotiate"), neg_requests),
    st.tuples(st.just("GetCompatibilityMatrix"),
              st.builds(k.GetCompatibilityMatrixRequest, model_id=text)),
    st.tuples(st.just("OpenSession"), st.builds(
        k.OpenSessionRequest, request_id=text, source_worker_id=text,
        destination_worker_id=text, expected_bytes=u64, deadline_ms=u32, lease_ttl_ms=u32,
        caller=callers)),
    st.tuples(st.just("ReportProgress"), st.builds(
        k.ReportProgressRequest, session_id=text, caller=callers, bytes_done=u64,
        state=enum_val, reason=text)),
    st.tuples(st.just("CompleteSession"),
              st.builds(k.CompleteSessionRequest, session_id=text, caller=callers)),
    st.tuples(st.just("AbortSession"),
              st.builds(k.AbortSessionRequest, session_id=text, caller=callers, reason=text)),
    st.tuples(st.just("GetSession"),
              st.builds(k.GetSessionRequest, session_id=text, request_id=text)),
    st.tuples(st.just("ListSessions"), st.builds(
        k.ListSessionsRequest, state=enum_val, worker_id=text, page_size=u32, page_token=text)),
)  # fmt: skip


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(call=calls)
async def test_random_messages_never_internal(
    broker: tuple[BrokerHandle, str, str], call: tuple[str, Any]
) -> None:
    method, request = call
    try:
        await getattr(broker[0].stub, method)(request, timeout=5)
        code = grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
    assert code in ALLOWED, (method, code)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(req=st.builds(k.WatchSessionRequest, session_id=text, request_id=text, from_version=u64))
async def test_random_watch_requests_never_internal(
    broker: tuple[BrokerHandle, str, str], req: k.WatchSessionRequest
) -> None:
    call = broker[0].stub.WatchSession(req)
    try:
        await asyncio.wait_for(call.read(), 0.5)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in ALLOWED
    except TimeoutError:
        pass  # an open session with nothing newer than from_version: the stream waits
    finally:
        call.cancel()
