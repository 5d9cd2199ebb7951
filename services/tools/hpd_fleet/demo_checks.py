"""What a demo run checks its own report against (``hpd_fleet.demo_run``): the route records
the scheduler stored for the run's requests (:func:`reconcile`: one per request, and saying
what the replay saw), and the KV sessions of the workers the run's faults killed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_gateway.service import REPLAN_SUFFIX

from .fleet import Fleet
from .replay_common import DECISION_NAMES, RequestRecord

__all__ = ["killed_sessions", "list_route_records", "reconcile", "route_records"]


async def list_route_records(
    stub: s_grpc.SchedulerServiceStub, since_ms: int, prefix: str
) -> list[s.RouteRecord]:
    """Every route record created since ``since_ms`` whose request id starts with ``prefix``."""
    out: list[s.RouteRecord] = []
    token = ""
    while True:
        resp = await stub.ListRouteRecords(
            s.ListRouteRecordsRequest(since_unix_ms=since_ms, page_size=1000, page_token=token),
            timeout=10,
        )
        out += [r for r in resp.records if r.request_id.startswith(prefix)]
        token = resp.next_page_token
        if not token:
            return out


def reconcile(records: Sequence[RequestRecord], route: Sequence[s.RouteRecord]) -> dict[str, Any]:
    """Compare the gateway's records with the scheduler's route records, request by request.

    Expected: a request that was planned (completed or failed) has a PRIMARY or REROUTE
    record carrying an outcome with the same success; a request the scheduler refused
    (reason other than ``unavailable``) has a REJECT record; a request rejected as
    ``unavailable`` has none; and no route record names a request the gateway never sent.
    """
    by_id = {r.request_id: r for r in route}
    mismatches: list[str] = []
    for rec in records:
        # a plan whose fallback chain ran out is re-planned once by `hpd gateway` under
        # ``<id>:replan``: that record carries the request's final outcome
        rr = by_id.get(f"{rec.request_id}{REPLAN_SUFFIX}") or by_id.get(rec.request_id)
        decision = DECISION_NAMES.get(rr.decision, "") if rr is not None else ""
        if rec.status in ("completed", "failed"):
            if rr is None or decision not in ("primary", "reroute"):
                mismatches.append(f"{rec.request_id}: {rec.status} but record {decision or 'none'}")
            elif not rr.HasField("outcome"):
                mismatches.append(f"{rec.request_id}: {rec.status} but no outcome on the record")
            elif rr.outcome.success != (rec.status == "completed"):
                mismatches.append(f"{rec.request_id}: outcome success {rr.outcome.success}")
        elif rec.reason == "unavailable":
            if rr is not None and decision != "reject":
                mismatches.append(f"{rec.request_id}: unavailable but planned ({decision})")
        elif rr is None or decision != "reject":
            mismatches.append(f"{rec.request_id}: rejected but record {decision or 'none'}")
    known = {r.request_id for r in records}
    strays = [rid for rid in by_id if rid.removesuffix(REPLAN_SUFFIX) not in known]
    mismatches += [f"{rid}: route record without a request" for rid in strays]
    counts: dict[str, int] = {}
    for r in route:
        d = DECISION_NAMES.get(r.decision, "unspecified")
        counts[d] = counts.get(d, 0) + 1
    return {
        "route_records": len(route),
        "by_decision": counts,
        "with_outcome": sum(r.HasField("outcome") for r in route),
        "outcome_success": sum(r.HasField("outcome") and r.outcome.success for r in route),
        "mismatches": mismatches[:20],
        "agree": not mismatches,
    }


async def route_records(
    stub: s_grpc.SchedulerServiceStub, since_ms: int, prefix: str
) -> list[s.RouteRecord]:
    for attempt in range(20):
        try:
            return await list_route_records(stub, since_ms, prefix)
        except grpc.aio.AioRpcError:
            if attempt == 19:
                raise
            await asyncio.sleep(0.5)
    return []


async def killed_sessions(
    stub: kb_grpc.KvBrokerServiceStub, fleet: Fleet
) -> dict[str, list[kb.KvSession]]:
    out: dict[str, list[kb.KvSession]] = {}
    for w in fleet:
        if not w.killed:
            continue
        found: list[kb.KvSession] = []
        token = ""
        while True:
            resp = await stub.ListSessions(
                kb.ListSessionsRequest(worker_id=w.worker_id, page_size=1000, page_token=token),
                timeout=10,
            )
            found += list(resp.sessions)
            token = resp.next_page_token
            if not token:
                break
        out[w.worker_id] = found
    return out
