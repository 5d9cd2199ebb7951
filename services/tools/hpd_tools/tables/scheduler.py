"""`hpd routes`: recent route records of a running scheduler, as `kubectl get` prints.

TRACE is the OpenTelemetry trace the request was planned in (its id to look up in the
tracing backend; '-' when the scheduler or the caller does not trace)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.channels import CallIdentity, sync_channel
from hpd_tools.tables import age, render

HEADERS = [
    "REQUEST", "AGE", "MODEL", "TIER", "DECISION", "MODE", "PREFILL", "DECODE",
    "EST-TTFT", "ACTION", "OUTCOME", "TRACE",
]  # fmt: skip


def _enum(value: int, enum: object, prefix: str) -> str:
    name: str = enum.Name(value)  # type: ignore[attr-defined]
    return name.removeprefix(prefix).lower() if value else "-"


def rows(records: Sequence[s.RouteRecord], now_ms: int) -> list[list[str]]:
    out = []
    for rec in records:
        plan = rec.plan if rec.HasField("plan") else None
        outcome = "-"
        if rec.HasField("outcome"):
            o = rec.outcome
            outcome = f"ok ttft={o.ttft_ms:.0f}ms" if o.success else f"error:{o.error_class}"
        elif rec.decision == s.ROUTE_DECISION_REJECT:
            outcome = rec.reject_class or "rejected"
        out.append([
            rec.request_id, age(rec.created_at_unix_ms, now_ms), rec.model_id, rec.tier,
            _enum(rec.decision, s.RouteDecision, "ROUTE_DECISION_"),
            _enum(plan.mode, s.ExecutionMode, "EXECUTION_MODE_") if plan else "-",
            plan.prefill_worker_id if plan else "-", plan.decode_worker_id if plan else "-",
            f"{plan.estimates.ttft_ms:.0f}ms" if plan else "-",
            rec.serving_action.action or "-", outcome, rec.trace_id or "-",
        ])  # fmt: skip
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpd routes", description="Recent route records, newest first."
    )
    p.add_argument(
        "--scheduler",
        default=os.environ.get("HPD_SCHEDULER", "127.0.0.1:50052"),
        help="scheduler address host:port (env HPD_SCHEDULER)",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="RPC deadline in seconds")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--limit", type=int, default=20, help="how many records (1..1000)")
    p.add_argument("--tier", default="", help="only this tier")
    p.add_argument("--worker", default="", help="only plans using this worker")
    p.add_argument("--model", default="", help="only this model")
    p.add_argument("--since", type=float, default=0.0, help="only the last N seconds")
    p.add_argument("--request", default="", help="one request's full record (JSON)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with sync_channel(args.scheduler, CallIdentity.from_env()) as channel:
            stub = s_grpc.SchedulerServiceStub(channel)
            if args.request:
                got = stub.GetRouteRecord(
                    s.GetRouteRecordRequest(request_id=args.request), timeout=args.timeout
                )
                print(
                    json.dumps(
                        MessageToDict(got.record, preserving_proto_field_name=True), indent=2
                    )
                )
                return 0
            now_ms = int(time.time() * 1000)
            resp = stub.ListRouteRecords(
                s.ListRouteRecordsRequest(
                    since_unix_ms=int(now_ms - args.since * 1000) if args.since else 0,
                    tier=args.tier,
                    worker_id=args.worker,
                    model_id=args.model,
                    page_size=max(1, min(1000, args.limit)),
                ),
                timeout=args.timeout,
            )
            if args.output == "json":
                print(
                    json.dumps(
                        [MessageToDict(x, preserving_proto_field_name=True) for x in resp.records],
                        indent=2,
                    )
                )
            else:
                print(render(HEADERS, rows(resp.records, now_ms)))
    except grpc.RpcError as exc:
        print(f"hpd routes: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
