"""The RPCs `hpd fuzz` drives (``hpd_fleet.fuzz``): for each RPC of the registry, scheduler
and KV broker, how to build a *valid* request from the fuzzer's live seeds (registered
workers and their credentials, a planned request, an open KV session) and how to call it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import scheduler_pb2 as s

if TYPE_CHECKING:
    from hpd_fleet.fuzz import Fuzzer

__all__ = ["MODEL", "RpcTable", "load_report", "rpc_table", "worker_capability"]

RpcTable = dict[str, tuple[Callable[[], Message], Callable[[Message], Any]]]
"""RPC name -> (a valid request's builder, the call)."""


# size: one entry per RPC of every service, a table read as one list
def rpc_table(fz: Fuzzer) -> RpcTable:
    """Per RPC: how to build a valid request from the fuzzer's live seeds, and how to call it."""
    sd = fz.seeds

    def worker_cred(wid: str) -> tuple[str, str]:
        return wid, sd.credentials.get(wid, "")

    def fresh_id(kind: str) -> str:
        fz.n += 1
        return f"{fz.run_id}-{kind}-{fz.n}"

    def unary(stub_call: Callable[..., Any]) -> Callable[[Message], Any]:
        return lambda req: stub_call(req, timeout=5)

    def first_of_stream(stub_call: Callable[..., Any]) -> Callable[[Message], Any]:
        def call(req: Message) -> Any:
            stream = stub_call(req, timeout=2)
            try:
                return next(iter(stream), None)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return None  # a quiet stream is not a fault
                raise
            finally:
                stream.cancel()

        return call

    def heartbeat_stream(req: Message) -> Any:
        stream = fz.reg.StreamHeartbeats(iter([req]), timeout=2)
        try:
            return next(iter(stream), None)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return None
            raise
        finally:
            stream.cancel()

    def schedule_stream(req: Message) -> Any:
        stream = fz.sched.ScheduleStream(iter([req]), timeout=5)
        try:
            return next(iter(stream), None)
        finally:
            stream.cancel()

    p, d = sd.prefill, sd.decode
    return {
        "RegisterWorker": (
            lambda: r.RegisterWorkerRequest(
                capability=worker_capability(fresh_id("w"), c.STAGE_DECODE), lease_ttl_ms=5_000
            ),
            unary(fz.reg.RegisterWorker),
        ),
        "Heartbeat": (
            lambda: r.HeartbeatRequest(
                worker_id=p, credential=worker_cred(p)[1], load=load_report()
            ),
            unary(fz.reg.Heartbeat),
        ),
        "StreamHeartbeats": (
            lambda: r.StreamHeartbeatsRequest(
                worker_id=d, credential=worker_cred(d)[1], load=load_report()
            ),
            heartbeat_stream,
        ),
        "DeregisterWorker": (
            lambda: r.DeregisterWorkerRequest(worker_id=fresh_id("gone"), credential="x"),
            unary(fz.reg.DeregisterWorker),
        ),
        "DrainWorker": (
            lambda: r.DrainWorkerRequest(worker_id=fresh_id("nobody"), reason="fuzz"),
            unary(fz.reg.DrainWorker),
        ),
        "CordonWorker": (
            lambda: r.CordonWorkerRequest(worker_id=fresh_id("nobody"), reason="fuzz"),
            unary(fz.reg.CordonWorker),
        ),
        "UncordonWorker": (
            lambda: r.UncordonWorkerRequest(worker_id=p),
            unary(fz.reg.UncordonWorker),
        ),
        "GetWorker": (lambda: r.GetWorkerRequest(worker_id=p), unary(fz.reg.GetWorker)),
        "ListWorkers": (
            lambda: r.ListWorkersRequest(model_id=MODEL, page_size=10),
            unary(fz.reg.ListWorkers),
        ),
        "ListPools": (lambda: r.ListPoolsRequest(model_id=MODEL), unary(fz.reg.ListPools)),
        "WatchWorkers": (
            lambda: r.WatchWorkersRequest(model_id=MODEL),
            first_of_stream(fz.reg.WatchWorkers),
        ),
        "ReportKvEvents": (
            lambda: r.ReportKvEventsRequest(
                worker_id=p,
                credential=worker_cred(p)[1],
                block_tokens=128,
                events=[
                    r.KvCacheEvent(stored=r.KvBlocks(block_hashes=[1, 2, 3])),
                    r.KvCacheEvent(removed=r.KvBlocks(block_hashes=[3])),
                ],
            ),
            unary(fz.reg.ReportKvEvents),
        ),
        "SendDirective": (
            lambda: r.SendDirectiveRequest(
                worker_id=p,
                directive=c.Directive(
                    kind=c.DIRECTIVE_KIND_SET_MAX_BATCH_SIZE,
                    max_batch_size=64,
                    reason="fuzz",
                    issuer="fuzz",
                ),
            ),
            unary(fz.reg.SendDirective),
        ),
        "Schedule": (
            lambda: fz._schedule_request(fresh_id("req")),
            unary(fz.sched.Schedule),
        ),
        "ScheduleStream": (
            lambda: fz._schedule_request(fresh_id("req")),
            schedule_stream,
        ),
        "ReportOutcome": (
            lambda: s.ReportOutcomeRequest(
                request_id=sd.request_id,
                success=True,
                ttft_ms=100,
                tpot_ms=20,
                output_tokens=10,
            ),
            unary(fz.sched.ReportOutcome),
        ),
        "GetRouteRecord": (
            lambda: s.GetRouteRecordRequest(request_id=sd.request_id),
            unary(fz.sched.GetRouteRecord),
        ),
        "ListRouteRecords": (
            lambda: s.ListRouteRecordsRequest(page_size=5),
            unary(fz.sched.ListRouteRecords),
        ),
        "GetPolicy": (lambda: s.GetPolicyRequest(), unary(fz.sched.GetPolicy)),
        "ReloadPolicy": (
            lambda: s.ReloadPolicyRequest(builtin_profile="default", dry_run=True),
            unary(fz.sched.ReloadPolicy),
        ),
        "GetRecommendations": (
            lambda: s.GetRecommendationsRequest(),
            unary(fz.sched.GetRecommendations),
        ),
        "Negotiate": (
            lambda: kb.NegotiateRequest(
                source_worker_id=p, destination_worker_id=d, kv_bytes=1 << 20
            ),
            unary(fz.broker.Negotiate),
        ),
        "GetCompatibilityMatrix": (
            lambda: kb.GetCompatibilityMatrixRequest(model_id=MODEL),
            unary(fz.broker.GetCompatibilityMatrix),
        ),
        "OpenSession": (fz._open_request, unary(fz.broker.OpenSession)),
        "ReportProgress": (
            lambda: kb.ReportProgressRequest(
                session_id=sd.session_id,
                caller=fz._caller(),
                bytes_done=1024,
                state=kb.SESSION_STATE_TRANSFERRING,
            ),
            unary(fz.broker.ReportProgress),
        ),
        "CompleteSession": (
            lambda: kb.CompleteSessionRequest(session_id=sd.session_id, caller=fz._caller()),
            unary(fz.broker.CompleteSession),
        ),
        "AbortSession": (
            lambda: kb.AbortSessionRequest(
                session_id=sd.session_id, caller=fz._caller(), reason="fuzz"
            ),
            unary(fz.broker.AbortSession),
        ),
        "GetSession": (
            lambda: kb.GetSessionRequest(session_id=sd.session_id),
            unary(fz.broker.GetSession),
        ),
        "WatchSession": (
            lambda: kb.WatchSessionRequest(session_id=sd.session_id),
            first_of_stream(fz.broker.WatchSession),
        ),
        "ListSessions": (
            lambda: kb.ListSessionsRequest(page_size=5),
            unary(fz.broker.ListSessions),
        ),
    }


MODEL = "fuzz-model"


def worker_capability(worker_id: str, stage: Any) -> c.WorkerCapability:
    kv = c.KvFormat(
        dtype=c.KV_DTYPE_BF16, layout=c.KV_LAYOUT_PAGED_NHD, block_size_tokens=16, num_layers=32,
        num_kv_heads=8, head_dim=128, tp_size=1, attention_backend="flash_attn",
        model_revision="rev-fuzz",
    )  # fmt: skip
    return c.WorkerCapability(
        worker_id=worker_id, pool_id=f"fuzz-{worker_id}", endpoint=f"{worker_id}.fuzz:8000",
        stages=[stage], model_id=MODEL, model_revision="rev-fuzz", engine="vllm",
        engine_version="0.0.0", gpu_type="H100-SXM", gpu_count=1, tp_size=1, pp_size=1,
        kv_memory_total_bytes=40 * 2**30, max_batch_size=256, kv_format=kv,
        network=c.NetworkLocation(zone="fz", rack="r", host=worker_id, nic_gbps=200),
    )  # fmt: skip


def load_report() -> c.LoadReport:
    return c.LoadReport(
        gpu_util=0.3, memory_util=0.3, kv_blocks_free=900, kv_blocks_total=1000, queue_depth=1,
        queue_max=64, batch_size=2, itl_p50_ms=20, itl_p99_ms=30,
    )  # fmt: skip
