"""Where the planner goes beyond the seeds, what it hands out: fallback chains, rejects and
reroutes, the memory ladder, staleness and the decision record."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest

from hpd_scheduler.policy import (
    Action,
    DecisionKind,
    Fleet,
    Health,
    InvalidInputError,
    Mode,
    Protects,
    RejectClass,
    Role,
    Stage,
    WorkerView,
    apply_reservations,
    release_reservations,
)
from hpd_scheduler.policy.capacity import resolve_model
from hpd_scheduler.policy.decision import decode_explanation
from hpd_scheduler.policy.framework import Candidate
from hpd_scheduler.policy.plugins import (
    StalenessScorer,
)

from .builders import DEFAULT, MODEL, NOW, ctx_for, plan, request, worker

# -- fallback chain, rejects, reroutes -------------------------------------------------------


def test_fallback_chain_is_ordered_with_budgets() -> None:
    views = [
        worker("p", Stage.PREFILL, rack="r1", pool="pp"),
        worker("d1", rack="r1", pool="dp1"),
        worker("d2", rack="r1", pool="dp2", queue=3),
        worker("b", Stage.BOTH, rack="r1", pool="shared", queue=5),
    ]
    decision, _ = plan(views, request(prompt=4000, tier="interactive"))
    assert decision.plan is not None and decision.plan.mode is Mode.TRANSFER
    chain = decision.fallbacks
    assert chain[0].reason == "kv_transfer_failed"
    assert chain[0].mode is Mode.RECOMPUTE
    assert chain[0].decode_worker_id == decision.plan.decode_worker_id
    assert chain[0].remaining_budget_ms == pytest.approx(1000.0 - chain[0].est_ttft_ms)
    assert chain[0].est_ttft_ms > decision.plan.estimates.ttft_ms
    others = {s.decode_worker_id for s in chain[1:]}
    assert decision.plan.decode_worker_id not in others
    assert len(chain) <= DEFAULT.chain_length
    assert {s.reason for s in chain[1:]} <= {"next_pool", "next_best_pair", "shared_pool"}


def test_unknown_model_rejects_as_no_capable_worker() -> None:
    decision, _ = plan([worker("d")], request().__class__("r", "other-model", 10, 10))
    assert decision.kind is DecisionKind.REJECT
    assert decision.reject_class == RejectClass.NO_CAPABLE_WORKER
    assert decision.route_record()["selected_pool"] == "none"
    assert decision.reject_reasons[0] == "no_worker_for_model"
    assert (decision.action.action, decision.action.protects) == ("reject", "nothing")


@pytest.mark.parametrize(
    ("gpu", "figures"),
    [
        pytest.param("H100-SXM", {"peak_tflops": 1e-308}, id="subnormal-tflops"),
        pytest.param("H100-SXM", {"hbm_gbps": 1e-308}, id="subnormal-hbm"),
        pytest.param("MADE-UP", {"peak_tflops": 1e-308, "hbm_gbps": 1e-308}, id="unknown-gpu"),
    ],
)
def test_a_worker_with_figures_that_make_no_sense_is_left_out_not_fatal(
    gpu: str, figures: dict[str, Any]
) -> None:
    """One such registration must not stop scheduling for its model."""
    views = [
        worker("p", Stage.PREFILL),
        worker("bad-p", Stage.PREFILL, gpu=gpu, **figures),
        worker("bad-d", gpu=gpu, **figures),
        worker("d"),
    ]
    decision, fleet = plan(views)
    assert decision.plan is not None
    assert {decision.plan.prefill_worker_id, decision.plan.decode_worker_id} <= {"p", "d"}
    drops = fleet.index(MODEL, Role.DECODE).static_drops  # type: ignore[union-attr]
    assert ("bad-d", "pool-bad-d", "implausible_capacity") in drops, drops


@pytest.mark.parametrize("value", [5e-324, 1e-308, 1e-30, 1e30, 1e308, math.inf, math.nan])
@pytest.mark.parametrize("field", ["peak_tflops", "hbm_gbps"])
def test_no_figure_a_worker_reports_makes_the_planner_raise(field: str, value: float) -> None:
    figure: dict[str, Any] = {field: value}
    views = [worker("p", Stage.PREFILL), worker("d"), worker("odd", Stage.BOTH, **figure)]
    decision, _ = plan(views)
    assert decision.plan is not None


def test_a_model_with_prefill_workers_only_says_decode_is_missing() -> None:
    decision, _ = plan([worker("p", Stage.PREFILL)], request())
    assert decision.reject_class == RejectClass.NO_CAPABLE_WORKER
    assert decision.reject_reasons[0] == "no_decode_worker_for_model"


def test_all_decode_workers_full_rejects_as_saturated() -> None:
    views = [
        worker("p", Stage.PREFILL),
        worker("d1", kv_free_gib=0.1),
        worker("d2", kv_free_gib=0.1),
    ]
    decision, _ = plan(views, request(prompt=4000, output=500))
    assert decision.kind is DecisionKind.REJECT
    assert decision.reject_class == RejectClass.SATURATED
    assert decision.reject_reasons == ("no_executable_pool",)
    reasons = {(w, r) for w, _, r in decision.record.rejected_workers}
    assert {("d1", "insufficient_memory"), ("d2", "insufficient_memory")} <= reasons


def test_unhealthy_preferred_pool_reroutes() -> None:
    views = [
        worker("p", Stage.PREFILL),
        worker("a1", pool="decode-a", health=Health.UNHEALTHY),
        worker("b1", pool="decode-b"),
    ]
    decision, _ = plan(views, request(preferred_pool="decode-a"))
    assert decision.kind is DecisionKind.REROUTE
    assert decision.plan is not None and decision.plan.decode_pool_id == "decode-b"
    assert decision.record.rejected_pools["decode-a"] == ("unhealthy",)


def test_healthy_preferred_pool_is_primary() -> None:
    views = [
        worker("p", Stage.PREFILL),
        worker("a1", pool="decode-a", queue=30),
        worker("b1", pool="decode-b"),
    ]
    decision, _ = plan(views, request(preferred_pool="decode-a"))
    assert decision.kind is DecisionKind.PRIMARY
    assert decision.plan is not None and decision.plan.decode_pool_id == "decode-a"


def test_hard_ttft_limit_rejects_only_when_no_option_meets_it() -> None:
    views = [worker("d", gpu="L4", kv_total_gib=40, kv_free_gib=39)]
    slow = request(prompt=100_000, output=10, tier="interactive")
    decision, _ = plan(views, slow)
    assert decision.kind is DecisionKind.REJECT
    assert decision.reject_reasons == ("exceeds_hard_ttft",)
    decision, _ = plan(views, replace(slow, tier="standard"))  # no hard limit
    assert decision.plan is not None


# -- serving ladder -------------------------------------------------------------------------


def pressured(free_gib: float) -> list[WorkerView]:
    return [
        worker("p", Stage.PREFILL, rack="r1"),
        worker("d1", kv_total_gib=40, kv_free_gib=free_gib, rack="r1"),
        worker("d2", kv_total_gib=40, kv_free_gib=free_gib, rack="r1"),
        worker("b", Stage.BOTH, kv_total_gib=40, kv_free_gib=free_gib, rack="r1", queue=4),
    ]


@pytest.mark.parametrize(
    ("free", "tier", "kind", "cls", "action"),
    [
        pytest.param(
            30.0,
            "batch",
            DecisionKind.PRIMARY,
            None,
            Action.KEEP_HETEROGENEOUS_ROUTE,
            id="low-pressure-keeps-route",
        ),
        pytest.param(
            7.0,
            "standard",
            DecisionKind.PRIMARY,
            None,
            Action.THROTTLE_ADMISSION,
            id="0.825-throttles-only-throttleable-tiers",
        ),
        pytest.param(
            7.0,
            "batch",
            DecisionKind.REJECT,
            RejectClass.THROTTLED,
            Action.THROTTLE_ADMISSION,
            id="0.825-throttles-batch",
        ),
        pytest.param(
            3.0,
            "standard",
            DecisionKind.REROUTE,
            None,
            Action.FALLBACK_TO_SHARED,
            id="0.925-falls-back-to-shared",
        ),
        pytest.param(
            1.0,
            "batch",
            DecisionKind.REJECT,
            RejectClass.SHED,
            Action.SHED_LOWEST_TIER,
            id="0.975-sheds-lowest-tier",
        ),
        pytest.param(
            1.0,
            "interactive",
            DecisionKind.REROUTE,
            None,
            Action.SHED_LOWEST_TIER,
            id="0.975-keeps-higher-tiers",
        ),
    ],
)
def test_memory_pressure_ladder(
    free: float, tier: str, kind: DecisionKind, cls: str | None, action: Action
) -> None:
    decision, _ = plan(pressured(free), request(prompt=100, output=100, tier=tier))
    assert decision.kind is kind
    assert decision.reject_class == cls
    assert decision.action.action is action
    if decision.kind is DecisionKind.REROUTE:
        assert decision.plan is not None and decision.plan.mode is Mode.SAME_POOL
        assert decision.action.took(Action.FALLBACK_TO_SHARED)
    steps = [s.action for s in decision.action.steps]
    assert steps == sorted(steps, key=[s.action for s in DEFAULT.ladder].index)


def test_ladder_records_what_each_step_protects() -> None:
    decision, _ = plan(pressured(3.0), request(prompt=100, output=100))
    protects = {s.action: s.protects for s in decision.action.steps}
    assert protects == {
        Action.THROTTLE_ADMISSION: Protects.RESIDENCY,
        Action.LOWER_BATCH_CAP: Protects.LATENCY,
        Action.FALLBACK_TO_SHARED: Protects.RESIDENCY,
    }
    assert decision.to_dict()["serving_action"]["protects"] == "residency"


# -- staleness ------------------------------------------------------------------------------


def test_stale_report_lowers_the_score() -> None:
    views = [
        worker("p", Stage.PREFILL, rack="r1"),
        worker("fresh", rack="r1", reported_at=NOW - 1.0),
        worker("stale", rack="r1", reported_at=NOW - 8.0),
    ]
    decision, fleet = plan(views)
    assert decision.plan is not None and decision.plan.decode_worker_id == "fresh"
    scores = {c.ws.worker_id: c.factors["freshness"] for c in decision.record.decode_candidates}
    assert scores["fresh"] == 1.0 and scores["stale"] == pytest.approx(0.25)
    ctx = ctx_for(fleet)
    stale_ws = fleet.worker("stale")
    assert stale_ws is not None
    assert StalenessScorer("s").score(Candidate(stale_ws, Role.DECODE, ctx.request, 1024), ctx) < 1


def test_very_old_report_drops_the_worker() -> None:
    views = [worker("p", Stage.PREFILL), worker("old", reported_at=NOW - 60.0), worker("ok")]
    decision, _ = plan(views)
    assert decision.plan is not None and decision.plan.decode_worker_id == "ok"
    assert ("old", "pool-old", "stale_load_report") in decision.record.rejected_workers


# -- the record -----------------------------------------------------------------------------


def test_decision_record_is_complete_and_json_ready() -> None:
    views = [
        worker("p", Stage.PREFILL, rack="r1"),
        worker("d", rack="r1"),
        worker("sick", health=Health.DRAINING, pool="pool-sick"),
    ]
    decision, _ = plan(views)
    data = decision.to_dict()
    assert json.loads(json.dumps(data)) == data
    rec = data["record"]
    assert rec["weights"]["decode"] == DEFAULT.decode.weights()
    assert rec["weights"]["prefill"] == DEFAULT.prefill.weights()
    (dc,) = rec["candidates"]["decode"]
    assert set(dc["factors"]) == {n for n, w in DEFAULT.decode.weights().items() if n != "network"}
    assert all(0.0 <= v <= 1.0 for v in dc["factors"].values())
    best = rec["options"][0]
    assert {"prefill.network", "decode.network"} <= set(best["factors"])
    assert best["decode_worker_id"] == data["plan"]["decode_worker_id"]
    assert {"worker_id": "sick", "pool_id": "pool-sick", "reason": "draining"} in rec[
        "rejected_workers"
    ]
    assert rec["rejected_pools"] == {"pool-sick": ["draining"]}
    assert decision.route_record() == {
        "resource_need": "prefill",
        "selected_pool": "pool-d",
        "execution_mode": data["plan"]["mode"],
        "route_decision": "primary",
        "service_action": "keep_heterogeneous_route",
        "protect": "throughput",
    }


def test_stored_record_decodes_to_the_same_explanation() -> None:
    """The compact stored form (numbers packed as float64, factor names once) reads back as
    exactly the plain record, values rounded as the record rounds them; a plain document
    stored before the compact form existed reads back unchanged."""
    views = [
        worker("p", Stage.PREFILL, rack="r1"),
        worker("p2", Stage.PREFILL, rack="r2"),
        worker("d", rack="r1"),
        worker("d2", Stage.BOTH, rack="r2"),
        worker("sick", health=Health.DRAINING, pool="pool-sick"),
    ]
    decision, _ = plan(views)
    record = decision.record
    text = record.encode(max_options=3)
    assert len(text) < len(json.dumps(record.to_dict(max_options=3)))
    back = decode_explanation(json.loads(text))
    assert back == record.to_dict(max_options=3)
    assert len(back["options"]) == 3
    scores = [o["score"] for o in back["options"]]
    assert scores == sorted(scores, reverse=True)
    exact = max(record.options, key=lambda o: o.score)
    assert back["options"][0]["score"] == round(exact.score, 6)
    assert back["options"][0]["ttft_ms"] == round(exact.ttft_ms, 3)
    # field by field against the planner's own objects (not only against to_dict, which
    # goes through the same compact form)
    assert back["memory_pressure"] == round(record.memory_pressure, 6)
    assert back["weights"]["sides"] == list(record.side_weights)
    for side, cands in (
        ("prefill", record.prefill_candidates),
        ("decode", record.decode_candidates),
    ):
        assert len(back["candidates"][side]) == len(cands) > 0
        for got, c in zip(back["candidates"][side], cands, strict=True):
            assert got["worker_id"] == c.ws.worker_id and got["pool_id"] == c.ws.pool_id
            assert got["wait_ms"] == round(c.wait_ms, 3)
            assert got["prefill_ms"] == round(c.run_ms, 3)
            assert got["step_ms"] == round(c.step_ms, 3)
            assert got["score"] == round(c.score, 6)
            assert got["factors"] == {k: round(v, 6) for k, v in c.factors.items()}
    top = back["options"][0]
    assert top["prefill_worker_id"] == exact.p.ws.worker_id
    assert top["decode_worker_id"] == exact.d.ws.worker_id
    assert top["mode"] == exact.mode.value
    want_xfer = round(exact.transfer_ms, 3) if exact.mode.value == "transfer" else None
    assert top["transfer_ms"] == want_xfer
    plain = {"profile": "default", "options": []}
    assert decode_explanation(plain) is plain


def test_a_record_with_a_non_finite_value_is_refused() -> None:
    decision, _ = plan([worker("p", Stage.PREFILL), worker("d")])
    decision.record.memory_pressure = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        decision.record.encode()


def test_release_undoes_reservations() -> None:
    views = [worker("p", Stage.PREFILL, rack="r1"), worker("d", rack="r1")]
    decision, fleet = plan(views)
    before = fleet.memory_pressure(MODEL)
    apply_reservations(fleet, decision)
    assert fleet.memory_pressure(MODEL) > before
    release_reservations(fleet, decision)
    assert fleet.memory_pressure(MODEL) == pytest.approx(before)


def test_fallback_to_shared_finds_a_shared_worker_outside_the_top_k() -> None:
    views = [worker("p", Stage.PREFILL, rack="r1")]
    views += [worker(f"d{i}", kv_total_gib=40, kv_free_gib=3.0, rack="r1") for i in range(12)]
    views += [worker("b", Stage.BOTH, kv_total_gib=40, kv_free_gib=3.0, rack="r1", queue=40)]
    decision, _ = plan(views, request(prompt=100, output=100))
    assert decision.action.took(Action.FALLBACK_TO_SHARED)
    assert decision.kind is DecisionKind.REROUTE
    assert decision.plan is not None and decision.plan.decode_worker_id == "b"
    assert decision.plan.mode is Mode.SAME_POOL


def test_a_model_outside_the_table_is_priced_by_the_size_its_agent_read() -> None:
    """A model the performance model does not know: with the agent's ``model-params`` and
    ``model-attention-width`` labels (from its config.json) its compute is priced by its
    own size; without them by the 8 B last resort (a small model priced that way looked
    orders of magnitude slower than its engine, and admission refused its requests)."""

    def unknown(wid: str, **labels: str) -> WorkerView:
        return worker(wid, labels=labels, model_id="tiny-x")

    sized = unknown("t", **{"model-params": "557056", "model-attention-width": "128"})
    spec = resolve_model(sized)
    assert spec.params_b == pytest.approx(557056 / 1e9) and spec.hidden_size == 128
    assert resolve_model(unknown("u")).params_b == 8.0
    for bad in ("", "-5", "lots", "0"):
        assert resolve_model(unknown("v", **{"model-params": bad})).params_b == 8.0
    fleet = Fleet.build([sized, unknown("u")], NOW)
    fast, slow = fleet.worker("t"), fleet.worker("u")
    assert fast is not None and slow is not None
    assert slow.prefill_ms(512) > 1000 * fast.prefill_ms(512)


def test_workers_the_caller_saw_fail_are_in_no_step_of_the_plan() -> None:
    """A re-plan names the workers its failed chain ran on: no step, primary or fallback,
    runs on them while the view still lists them, and the record says why."""
    views = [worker("p1", Stage.PREFILL), worker("p2", Stage.PREFILL)]
    views += [worker(f"d{i}") for i in range(4)]
    first, _ = plan(views)
    assert first.plan is not None
    used = {first.plan.decode_worker_id, first.plan.prefill_worker_id}
    again, _ = plan(views, request(avoid_workers=tuple(sorted(used))))
    assert again.plan is not None
    steps = [(again.plan.decode_worker_id, again.plan.prefill_worker_id)]
    steps += [(f.decode_worker_id, f.prefill_worker_id) for f in again.fallbacks]
    assert not used & {w for pair in steps for w in pair}, (used, steps)
    dropped = {w for w, _, r in again.record.rejected_workers if r == "failed_for_this_request"}
    assert used == dropped
    # every worker avoided: refused, never planned on a worker that just failed
    everyone = tuple(v.worker_id for v in views)
    refused, _ = plan(views, request(avoid_workers=everyone))
    assert refused.plan is None


def test_too_many_avoided_workers_are_refused_by_name() -> None:
    with pytest.raises(InvalidInputError, match="avoid_workers"):
        request(avoid_workers=tuple(f"w{i}" for i in range(17))).validate()
