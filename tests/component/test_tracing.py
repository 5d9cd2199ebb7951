"""One request's spans, received by a real OTLP receiver, form one trace: the gateway's
request span and its steps, the scheduler's Schedule span with the decision's attributes,
the broker's KV session spans; the engines get the trace's ``traceparent`` and the request
id; the route record stores the trace id.

The whole path runs in this process (``hpd_common.tracing`` is set up once for it, as
``--tracing`` does for a service): the control plane (``hpd up``'s wiring), the emulated
engines over HTTP (``hpd_fleet.engine_http``) and ``hpd gateway``'s whole assembly. The
receiver is an OTLP/gRPC ``TraceService`` on a port of its own, which the SDK's exporter
sends to as it would to a collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc
from opentelemetry.proto.common.v1 import common_pb2
from prometheus_client import CollectorRegistry

from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common import tracing
from hpd_common.clock import SystemClock
from hpd_fleet.demo_run import wait_fleet_seen
from hpd_fleet.engine import EmuTime
from hpd_fleet.engine_http import FleetHttp
from hpd_fleet.fleet import Fleet
from hpd_gateway.__main__ import GatewayServer, GatewaySettings
from hpd_scheduler.broker_client import GrpcKvBroker
from hpd_sim.cluster import parse_cluster
from hpd_tools.controlplane import ControlPlane, ControlPlaneSettings
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.servers import external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own servers"),
]

MODEL = "llama-3-8b"
SCHEDULER = "hetero_pd.v1.SchedulerService"
BROKER = "hetero_pd.v1.KvBrokerService"
SERVER, CLIENT, INTERNAL = 2, 3, 1  # OTLP's SpanKind numbers
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"  # a client that traces sends its context
CLIENT_SPAN = "b7ad6b7169203331"


# -- the OTLP receiver -------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """One span as the receiver got it (ids in hex, attributes as Python values)."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


@dataclass
class Receiver(ts_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span exported to it."""

    spans: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(self, request: ts.ExportTraceServiceRequest, context: Any) -> Any:
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    got.append(Received(
                        str(res.get("service.name", "")), sp.name, sp.kind, sp.trace_id.hex(),
                        sp.span_id.hex(), sp.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in sp.attributes},
                    ))  # fmt: skip
        with self.lock:
            self.spans += got
        return ts.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Received]:
        with self.lock:
            return [x for x in self.spans if x.trace_id == trace_id]

    def find(self, name: str, **attributes: Any) -> list[Received]:
        with self.lock:
            return [
                x for x in self.spans
                if x.name == name and all(x.attributes.get(k) == v for k, v in attributes.items())
            ]  # fmt: skip


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """The receiver on a free port, and this process tracing to it (off again after)."""
    got = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    ts_grpc.add_TraceServiceServicer_to_server(got, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "hpd-test")
    assert tracing.configure(True, "hpd-under-test")
    try:
        yield got
    finally:
        tracing.shutdown()
        server.stop(grace=None)


# -- the stack -------------------------------------------------------------------------------


@dataclass
class Stack:
    plane: ControlPlane
    fleet: Fleet
    gateway: GatewayServer
    scheduler: s_grpc.SchedulerServiceStub
    engine_calls: list[tuple[str, str, str]]
    """(worker id, traceparent, X-Request-Id) of every completion an engine was asked for."""


def _cluster() -> Any:
    return parse_cluster({
        "name": "trace-test", "model": MODEL,
        "defaults": {"memory_fraction": 0.9, "max_batch_size": 64, "nic_gbps": 200},
        "pools": [
            {"id": "h100-p", "gpu": "H100-SXM", "count": 1, "tp": 1, "stage": "prefill",
             "zone": "a", "rack": "a1"},
            {"id": "a100-d", "gpu": "A100-80G", "count": 2, "tp": 1, "stage": "decode",
             "zone": "a", "rack": "a2"},
        ],
        "links": {"classes": {"same_zone": {"gbps": 200, "latency_ms": 0.2}}},
    })  # fmt: skip


def _record_headers(http: FleetHttp, calls: list[tuple[str, str, str]]) -> None:
    """Each emulated engine notes the trace context and request id of what it is asked."""
    for wid, srv in http.servers.items():
        inner: Callable[[web.Request], Awaitable[web.StreamResponse]] = srv.completions

        async def completions(
            request: web.Request, inner: Any = inner, wid: str = wid
        ) -> web.StreamResponse:
            calls.append(
                (
                    wid,
                    request.headers.get("traceparent", ""),
                    request.headers.get("x-request-id", ""),
                )
            )
            return await inner(request)  # type: ignore[no-any-return]

        srv.completions = completions  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def stack(
    redis: EmbeddedRedis, key_prefix: str, schedule_stream: bool, broker_over_grpc: bool
) -> AsyncIterator[Stack]:
    plane = ControlPlane(ControlPlaneSettings(redis_url=redis.url, key_prefix=key_prefix))
    await plane.start()
    if broker_over_grpc:  # as a scheduler in a process of its own reaches the broker
        svc: Any = plane.scheduler.component.service  # type: ignore[union-attr]
        svc.opener = GrpcKvBroker(
            plane.kvbroker_target, svc.settings.broker_token,
            timeout_s=svc.settings.broker_timeout_ms / 1000,
        )  # fmt: skip
    chans = [grpc.aio.insecure_channel(t) for t in
             (plane.registry_target, plane.kvbroker_target, plane.scheduler_target)]  # fmt: skip
    emu = EmuTime(1.0, time.monotonic, asyncio.sleep, start=time.monotonic())
    fleet = Fleet(_cluster(), chans[0], chans[1], emu, SystemClock(), random.Random(3))
    http = FleetHttp(fleet)
    calls: list[tuple[str, str, str]] = []
    _record_headers(http, calls)
    await http.start()
    await fleet.start()
    gw = GatewayServer(
        GatewaySettings(
            port=0, scheduler=plane.scheduler_target, broker=plane.kvbroker_target,
            registry=plane.registry_target, schedule_stream=schedule_stream, metrics_port=-1,
        ),
        metrics_registry=CollectorRegistry(),
    )  # fmt: skip
    try:
        await gw.start()
        deadline = time.monotonic() + 10
        while len(gw.control.fleet.workers) < len(fleet.workers):
            assert time.monotonic() < deadline, "the gateway never saw the fleet"
            await asyncio.sleep(0.05)
        await wait_fleet_seen(plane, list(fleet.workers), timeout_s=10)
        yield Stack(plane, fleet, gw, s_grpc.SchedulerServiceStub(chans[2]), calls)
    finally:
        await gw.stop()
        await fleet.stop()
        await http.stop()
        for ch in chans:
            await ch.close()
        await plane.stop()


async def _record(st: Stack, rid: str) -> s.RouteRecord:
    for _ in range(200):  # the outcome is reported after the answer
        with contextlib.suppress(grpc.aio.AioRpcError):
            got = await st.scheduler.GetRouteRecord(
                s.GetRouteRecordRequest(request_id=rid), timeout=2
            )
            if got.record.HasField("outcome"):
                return got.record  # type: ignore[no-any-return]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no outcome for {rid}")


async def _spans_of(got: Receiver, rid: str, names: set[str]) -> list[Received]:
    """The trace of the request ``rid`` once every span named in ``names`` has arrived."""
    deadline = time.monotonic() + 15
    while True:
        await asyncio.to_thread(tracing.flush, 2_000)
        roots = got.find("POST /v1/completions", **{"hpd.request_id": rid})
        spans = got.trace(roots[0].trace_id) if roots else []
        missing = names - {x.name for x in spans}
        if not missing:
            return spans
        assert time.monotonic() < deadline, f"spans never received: {sorted(missing)}"
        await asyncio.sleep(0.1)


def _ancestors(span: Received, by_id: dict[str, Received]) -> list[str]:
    names = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        names.append(span.name)
    return names


def _one(spans: list[Received], name: str, kind: int) -> Received:
    found = [x for x in spans if x.name == name and x.kind == kind]
    assert len(found) == 1, (name, kind, [(x.name, x.kind) for x in spans])
    return found[0]


# -- what one trace must show ----------------------------------------------------------------


def _one_tree(spans: list[Received], client_traces: bool) -> Received:
    """Every span's parent is in the trace but the gateway's request span's (the root,
    whose parent is the client's span when the client traced); the gateway's steps are its
    children. Returns the root."""
    by_id = {x.span_id: x for x in spans}
    assert len(by_id) == len(spans)
    [root] = [x for x in spans if x.parent_id not in by_id]
    assert (root.name, root.kind) == ("POST /v1/completions", SERVER)
    if client_traces:  # the gateway continued the client's trace
        assert (root.trace_id, root.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    else:
        assert root.parent_id == ""
    assert {x.service for x in spans} == {"hpd-test"}  # OTEL_SERVICE_NAME wins
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["hpd.mode"] == "transfer" and root.attributes["hpd.success"]
    for step in ("tokenize", "schedule", "prefill", "decode", "report"):
        assert by_id[next(x for x in spans if x.name == step).parent_id] is root, step
    return root


def _decision(spans: list[Received], name: str, rec: s.RouteRecord, workers: list[str]) -> None:
    """The scheduler continued the gateway's schedule span, with the decision's aggregate
    attributes."""
    decided = _one(spans, name, SERVER)
    assert "schedule" in _ancestors(decided, {x.span_id: x for x in spans})
    a = decided.attributes
    assert (a["hpd.decision"], a["hpd.mode"]) == ("primary", "transfer")
    assert a["hpd.prefill_worker_id"] == rec.plan.prefill_worker_id
    assert a["hpd.decode_worker_id"] == rec.plan.decode_worker_id
    assert a["hpd.kv_session_id"] == rec.plan.kv_session_id
    assert a["hpd.candidates.prefill"] >= 1 and a["hpd.candidates.decode"] == 2
    assert a["hpd.options"] >= 1 and a["hpd.request_id"] == rec.request_id
    # aggregates only: no attribute per candidate worker
    assert not [k for k in a for w in workers if w in k]


def _session(spans: list[Received], scheduler: str, rec: s.RouteRecord, over_grpc: bool) -> None:
    """The broker's session: opened under the scheduler's span (over gRPC, or in process),
    completed under the gateway's request span."""
    by_id = {x.span_id: x for x in spans}
    opened = _one(spans, f"{BROKER}/OpenSession", SERVER if over_grpc else INTERNAL)
    assert scheduler in _ancestors(opened, by_id)
    assert opened.attributes["hpd.session_id"] == rec.plan.kv_session_id
    if over_grpc:
        assert _one(spans, f"{BROKER}/OpenSession", CLIENT).span_id == opened.parent_id
    completed = _one(spans, f"{BROKER}/CompleteSession", SERVER)
    assert _ancestors(completed, by_id)[-1] == "POST /v1/completions"
    assert completed.attributes["hpd.session_id"] == rec.plan.kv_session_id


def _engines(spans: list[Received], calls: list[tuple[str, str, str]], rec: s.RouteRecord) -> None:
    """The prefill and the decode engine each got the request id and the trace, with its
    own client span as the parent."""
    trace_id = spans[0].trace_id
    prefill, decode = _one(spans, "prefill", CLIENT), _one(spans, "decode", CLIENT)
    assert len(calls) == 2  # the prefill and the decode, each with X-Request-Id: rid
    assert {(w, *tp.split("-")[1:3]) for w, tp, _ in calls} == {
        (rec.plan.prefill_worker_id, trace_id, prefill.span_id),
        (rec.plan.decode_worker_id, trace_id, decode.span_id),
    }
    assert all(int(tp.split("-")[3], 16) & 1 for _, tp, _ in calls)  # sampled


# -- the test ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule_stream", "broker_over_grpc", "client_traces"),
    [(True, True, True), (False, False, False)],
    ids=["stream-grpc_broker-client_trace", "unary-inprocess_broker-new_trace"],
)
async def test_one_request_is_one_trace_across_gateway_scheduler_and_broker(
    receiver: Receiver,
    redis_server: EmbeddedRedis,
    key_prefix: str,
    schedule_stream: bool,
    broker_over_grpc: bool,
    client_traces: bool,
) -> None:
    rid = f"trace-{key_prefix}"
    headers = {"x-request-id": rid}
    if client_traces:
        headers["traceparent"] = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    async with stack(redis_server, key_prefix, schedule_stream, broker_over_grpc) as st:
        body = {"model": MODEL, "prompt": list(range(1, 2001)), "max_tokens": 4, "stream": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(st.gateway.url + "/v1/completions", json=body, headers=headers) as resp,
        ):
            assert resp.status == 200, await resp.text()
            assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
        rec = await _record(st, rid)
        assert rec.plan.mode == s.EXECUTION_MODE_TRANSFER, rec.plan
        sched = f"{SCHEDULER}/ScheduleStream" if schedule_stream else f"{SCHEDULER}/Schedule"
        names = {
            "POST /v1/completions", "tokenize", "schedule", sched, f"{BROKER}/OpenSession",
            "prefill", "decode", "report", f"{BROKER}/CompleteSession",
            f"{SCHEDULER}/ReportOutcome",
        }  # fmt: skip
        spans = await _spans_of(receiver, rid, names)
        calls = [c for c in st.engine_calls if c[2] == rid]
        workers = list(st.fleet.workers)

    root = _one_tree(spans, client_traces)
    _decision(spans, sched, rec, workers)
    _session(spans, sched, rec, broker_over_grpc)
    _engines(spans, calls, rec)
    # and the route record keeps the trace id (`hpd routes` shows it)
    assert rec.trace_id == root.trace_id
