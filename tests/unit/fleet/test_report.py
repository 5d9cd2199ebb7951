"""The demo report and the route-record cross-check, on hand-made records."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest

from hetero_pd.v1 import scheduler_pb2 as s
from hpd_fleet.demo_checks import reconcile
from hpd_fleet.replay_common import RequestRecord, reject_reason
from hpd_fleet.report import build_report, format_report
from hpd_sim.metrics import Slo


def rec(i: int, tier: str = "standard", status: str = "completed", **kw: Any) -> RequestRecord:
    base: dict[str, Any] = {"ttft_ms": 100.0 + i, "tpot_ms": 20.0, "mode_used": "transfer"}
    if status != "completed":
        base = {"reason": kw.pop("reason", "saturated")}
    base.update(kw)
    return RequestRecord(f"r-{i:03d}", i, tier, 0.0, 100, 10, status, **base)


SLOS = {"standard": Slo(150.0, 50.0), "interactive": Slo(105.0, 50.0)}


def test_attainment_counts_rejections_as_misses_and_percentiles_are_nearest_rank() -> None:
    records = [rec(i) for i in range(10)] + [rec(10, status="rejected")]
    report = build_report(records, SLOS, replay_s=5.0, price_per_hour=10.0)
    std = report["tiers"]["standard"]
    assert std["completed"] == 10 and std["rejected"] == 1
    assert std["slo_attainment"] == pytest.approx(10 / 11, abs=1e-4)
    assert std["ttft_ms"] == {"p50": 104.0, "p90": 108.0, "p99": 109.0}
    assert std["goodput_rps"] == pytest.approx(2.0)
    assert report["overall"]["goodput_per_dollar_hour"] == pytest.approx(0.2)
    assert report["accounting"]["accounted"]
    assert "all accounted for" in format_report(report)


@pytest.mark.parametrize(
    ("records", "accounted"),
    [
        pytest.param([rec(0), rec(1, status="failed", reason="x")], True, id="ok"),
        pytest.param([rec(0), rec(0)], False, id="twice"),
        pytest.param([rec(0), rec(1, status="rejected", reason="")], False, id="no-reason"),
        pytest.param([rec(0, status="lost", reason="?")], False, id="unknown-status"),
    ],
)
def test_accounting_needs_one_end_and_a_reason_per_request(
    records: list[RequestRecord], accounted: bool
) -> None:
    assert build_report(records, SLOS, 1.0)["accounting"]["accounted"] is accounted


def test_tier_slo_decides_per_tier() -> None:
    records = [rec(0, tier="interactive"), rec(9, tier="interactive")]  # TTFT 100, 109
    assert build_report(records, SLOS, 1.0)["tiers"]["interactive"]["slo_attainment"] == 0.5


def route(rid: str, decision: Any, success: bool | None = None) -> s.RouteRecord:
    r = s.RouteRecord(request_id=rid, decision=decision)
    if success is not None:
        r.outcome.success = success
    return r


P, J = s.ROUTE_DECISION_PRIMARY, s.ROUTE_DECISION_REJECT


@pytest.mark.parametrize(
    ("records", "routes", "agree"),
    [
        pytest.param(
            [rec(0), rec(1, status="rejected"), rec(2, status="rejected", reason="unavailable")],
            [route("r-000", P, True), route("r-001", J)],
            True,
            id="agree",
        ),
        pytest.param([rec(0)], [route("r-000", P)], False, id="no-outcome"),
        pytest.param([rec(0)], [route("r-000", P, False)], False, id="outcome-differs"),
        pytest.param([rec(0, status="rejected")], [], False, id="reject-unrecorded"),
        pytest.param([], [route("r-009", P, True)], False, id="stray-record"),
    ],
)
def test_reconcile(records: list[RequestRecord], routes: list[s.RouteRecord], agree: bool) -> None:
    check = reconcile(records, routes)
    assert check["agree"] is agree
    assert check["route_records"] == len(routes)


@pytest.mark.parametrize(
    ("code", "details", "reason"),
    [
        pytest.param(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed: tier batch", "shed", id="shed"),
        pytest.param(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "odd text", "resource_exhausted", id="raw"
        ),
        pytest.param(
            grpc.StatusCode.FAILED_PRECONDITION, "no worker", "no_capable_worker", id="fp"
        ),
        pytest.param(grpc.StatusCode.UNAVAILABLE, "redis", "unavailable", id="unavailable"),
    ],
)
def test_reject_reason(code: grpc.StatusCode, details: str, reason: str) -> None:
    err = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
    assert reject_reason(err) == reason


def test_record_to_dict_is_json_ready() -> None:
    d = rec(0, status="rejected").to_dict()
    assert d["ttft_ms"] is None and d["status"] == "rejected" and d["ladder_steps"] == []
    assert not any(isinstance(v, float) and math.isnan(v) for v in d.values())


def test_the_closing_paragraph_says_whether_the_admitted_requests_kept_their_targets() -> None:
    kept = [rec(i) for i in range(10)] + [rec(10, status="rejected")]
    report = build_report(kept, SLOS, 5.0)
    assert report["tiers"]["standard"]["admitted_attainment"] == 1.0
    text = format_report(report).replace("\n", " ")
    assert "kept their tier's targets (standard 100 % of them did)" in text
    # half of the admitted ones missed TTFT: the paragraph says so, naming the tier
    missed = [rec(i) for i in range(5)] + [rec(i, ttft_ms=900.0) for i in range(5, 10)]
    report = build_report(missed, SLOS, 5.0)
    assert report["tiers"]["standard"]["admitted_attainment"] == 0.5
    text = format_report(report).replace("\n", " ")
    assert "did not all keep their targets" in text
    assert "kept their tier's targets" not in text


def test_a_completed_request_without_its_plan_is_reported_as_such() -> None:
    report = build_report([rec(0), rec(1, mode_used="")], SLOS, 1.0)
    text = format_report(report).replace("\n", " ")
    assert "1 completed without their route record in reach" in text
    assert " ; " not in text
