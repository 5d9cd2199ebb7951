"""Where the planner goes beyond the seeds: capacity normalisation, per-tier targets, the
real link, joint pairing, fallback chains, the memory ladder, staleness, the record."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from typing import Any

import pytest
import yaml

from hpd_common.kvformat import KvDtype, KvLayout
from hpd_common.perfmodel import model_spec
from hpd_scheduler.policy import (
    Action,
    Decision,
    DecisionKind,
    Fleet,
    Health,
    Link,
    LinkModel,
    Locality,
    Mode,
    Planner,
    Profile,
    Protects,
    RejectClass,
    Request,
    Role,
    Stage,
    WorkerState,
    WorkerView,
    apply_reservations,
    builtin_profile,
    parse_profile,
    release_reservations,
)
from hpd_scheduler.policy.capacity import resolve_model
from hpd_scheduler.policy.decision import decode_explanation
from hpd_scheduler.policy.domain import ResourceNeed
from hpd_scheduler.policy.framework import Candidate, RequestContext
from hpd_scheduler.policy.plugins import (
    BlindLoadScorer,
    LinkTransferScorer,
    StalenessScorer,
    TierItlScorer,
    WorkLoadScorer,
)
from hpd_scheduler.policy.synthetic import synthetic_fleet

from .builders import GIB, MODEL, NOW, request, worker

DEFAULT = builtin_profile("default")
# the default profile with every decode worker's own prefill offered only where the seed rule
# would (no pair can transfer faster): for tests about the choice among prefill workers,
# which an idle decode worker prefilling for itself would otherwise pre-empt
DISAGGREGATED = replace(
    DEFAULT,
    slo_objective=replace(DEFAULT.slo_objective, conditional=False),  # type: ignore[type-var]
)


def plan(
    views: list[WorkerView],
    req: Request | None = None,
    profile: Profile = DEFAULT,
    links: LinkModel | None = None,
) -> tuple[Decision, Fleet]:
    fleet = Fleet.build(views, NOW, links=links)
    return Planner(profile).plan(req or request(), fleet, NOW, random.Random(7)), fleet


def ctx_for(fleet: Fleet, tier: str = "standard", req: Request | None = None) -> RequestContext:
    r = req or request(tier=tier)
    return RequestContext(
        r,
        DEFAULT.tier(tier),
        ResourceNeed.SHARED,
        NOW,
        fleet,
        fleet.index(MODEL, Role.PREFILL),
        fleet.index(MODEL, Role.DECODE),
    )


# -- KV bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "dtype", "per_token"),
    [
        pytest.param("llama-3-8b", KvDtype.BF16, 128 * 1024, id="llama3-8b-bf16-128KiB"),
        pytest.param("llama-3-70b", KvDtype.BF16, 320 * 1024, id="llama3-70b-bf16-320KiB"),
        pytest.param("llama-3-8b", KvDtype.FP8_E4M3, 64 * 1024, id="llama3-8b-fp8-halves"),
        pytest.param("llama-3-70b", KvDtype.FP8_E4M3, 160 * 1024, id="llama3-70b-fp8-halves"),
    ],
)
def test_kv_bytes_per_token_from_format(model: str, dtype: KvDtype, per_token: int) -> None:
    assert model_spec(model).kv_format(dtype=dtype).bytes_per_token() == per_token


def test_plan_kv_bytes_follow_the_source_format() -> None:
    decision, _ = plan(
        [worker("p", Stage.PREFILL, rack="r1"), worker("d", rack="r1")],
        request(prompt=3000, output=100),
    )
    assert decision.plan is not None
    assert decision.plan.estimates.kv_bytes == 3000 * 128 * 1024
    assert decision.plan.decode_kv_bytes == 3100 * 128 * 1024


# -- recompute from the receiving worker's own throughput ------------------------------------


def test_recompute_uses_the_receiving_workers_gpu_and_observations() -> None:
    fleet = Fleet.build(
        [
            worker("h100", gpu="H100-SXM"),
            worker("l40s", gpu="L40S"),
            worker("h100-slow", gpu="H100-SXM", prefill_tps=1.0),  # reports far below nominal
        ],
        NOW,
    )
    h100, l40s, slow = (fleet.worker(w) for w in ("h100", "l40s", "h100-slow"))
    assert h100 and l40s and slow
    # roofline: the prefill is compute bound, so the time scales with peak TFLOPs
    ratio = l40s.prefill_ms(4096) / h100.prefill_ms(4096)
    assert ratio == pytest.approx(989.5 / 362.05, rel=0.02)
    # observed throughput corrects the nominal figure (clamped at 4x)
    assert slow.prefill_ms(4096) == pytest.approx(4.0 * h100.prefill_ms(4096), rel=1e-6)


def test_stale_observations_count_less() -> None:
    fresh = Fleet.build([worker("w", prefill_tps=1.0, reported_at=NOW)], NOW).worker("w")
    old = Fleet.build([worker("w", prefill_tps=1.0, reported_at=NOW - 6.0)], NOW).worker("w")
    none = Fleet.build([worker("w", prefill_tps=1.0, reported_at=NOW - 60.0)], NOW).worker("w")
    assert fresh and old and none
    assert fresh.prefill_ms(1000) > old.prefill_ms(1000) > none.prefill_ms(1000)


# -- load normalised by capacity -------------------------------------------------------------


def test_fast_gpu_at_queue_8_beats_slow_gpu_at_queue_6() -> None:
    views = [
        worker("h100", Stage.PREFILL, gpu="H100-SXM", queue=8, rack="r1"),
        worker("l4", Stage.PREFILL, gpu="L4", queue=6, rack="r1"),
        worker("dec", Stage.DECODE, gpu="H200", rack="r1"),
    ]
    fleet = Fleet.build(views, NOW)
    ctx = ctx_for(fleet)
    h100 = Candidate(fleet.worker("h100"), Role.PREFILL, ctx.request, 1024)  # type: ignore[arg-type]
    l4 = Candidate(fleet.worker("l4"), Role.PREFILL, ctx.request, 1024)  # type: ignore[arg-type]
    ours = WorkLoadScorer("load")
    blind = BlindLoadScorer("blind")
    assert ours.score(h100, ctx) > ours.score(l4, ctx)
    assert blind.score(h100, ctx) < blind.score(l4, ctx)
    decision = Planner(DISAGGREGATED).plan(ctx.request, fleet, NOW, random.Random(0))
    assert decision.plan is not None
    assert decision.plan.prefill_worker_id == "h100"


# -- per-tier targets -------------------------------------------------------------------------


def test_itl_factor_uses_the_tiers_target() -> None:
    fleet = Fleet.build([worker("d", gpu="L40S", batch=64, kv_free_gib=10.0)], NOW)
    ws = fleet.worker("d")
    assert ws is not None
    scorer = TierItlScorer("itl")
    values = {}
    for tier in ("interactive", "standard", "batch"):
        ctx = ctx_for(fleet, tier)
        values[tier] = scorer.score(Candidate(ws, Role.DECODE, ctx.request, 1024), ctx)
    assert values["interactive"] < values["standard"] <= values["batch"]


# -- the real link ----------------------------------------------------------------------------


def test_network_factor_from_the_pairs_link() -> None:
    views = [
        worker("near", Stage.PREFILL, zone="z1", rack="r1"),
        worker("far", Stage.PREFILL, zone="z2", rack="r9"),
        worker("dec", zone="z1", rack="r1"),
    ]
    fleet = Fleet.build(views, NOW)
    near, far, dec = (fleet.worker(w) for w in ("near", "far", "dec"))
    assert near and far and dec
    kv = 3000 * 128 * 1024
    t_near = fleet.link(near, dec).transfer_ms(kv)
    t_far = fleet.link(far, dec).transfer_ms(kv)
    assert t_near < t_far
    assert fleet.links.between(near.view, dec.view)[0] is Locality.SAME_RACK
    assert fleet.links.between(far.view, dec.view)[0] is Locality.CROSS_ZONE
    scorer = LinkTransferScorer("net")
    ctx = ctx_for(fleet)
    c = Candidate(dec, Role.DECODE, ctx.request, 1024)
    assert scorer.score_pair(c, t_near, ctx) > scorer.score_pair(c, t_far, ctx)
    decision = Planner(DEFAULT).plan(ctx.request, fleet, NOW, random.Random(0))
    assert decision.plan is not None and decision.plan.prefill_worker_id == "near"


def test_slow_link_means_recompute() -> None:
    links = LinkModel(pool_overrides={("pp", "dp"): Link(gbps=0.5, latency_ms=5.0)})
    decision, _ = plan(
        [worker("p", Stage.PREFILL, pool="pp"), worker("d", pool="dp")],
        request(prompt=4000),
        links=links,
    )
    assert decision.plan is not None
    assert decision.plan.mode is Mode.RECOMPUTE
    assert decision.plan.prefill_worker_id == "d" == decision.plan.decode_worker_id


def test_fast_link_means_transfer() -> None:
    decision, _ = plan(
        [worker("p", Stage.PREFILL, rack="r1"), worker("d", gpu="L40S", rack="r1")],
        request(prompt=4000),
    )
    assert decision.plan is not None
    assert decision.plan.mode is Mode.TRANSFER
    est = decision.plan.estimates
    assert est.transfer_ms is not None and est.transfer_ms < est.recompute_ms


def test_kv_incompatible_but_executable_means_recompute_not_drop() -> None:
    # bf16 -> fp8 is a lossy narrowing the default KV policy refuses
    views = [worker("p", Stage.PREFILL, rack="r1"), worker("d", dtype=KvDtype.FP8_E4M3, rack="r1")]
    decision, _ = plan(views, request(prompt=4000))
    assert decision.kind is DecisionKind.PRIMARY
    assert decision.plan is not None and decision.plan.mode is Mode.RECOMPUTE
    assert decision.plan.decode_worker_id == "d"


@pytest.mark.parametrize(
    ("p_role", "d_role", "mode"),
    [
        ("producer", "consumer", Mode.TRANSFER),
        ("producer", "both", Mode.TRANSFER),
        (None, None, Mode.TRANSFER),  # no labels: no constraint
        ("producer", "producer", Mode.SAME_POOL),  # a producer engine cannot take KV in
        ("consumer", "both", Mode.SAME_POOL),  # nor can a consumer send it
        ("producer", "none", Mode.SAME_POOL),  # an engine without a connector takes none
        ("none", "both", Mode.SAME_POOL),  # and sends none
    ],
)
def test_transfers_go_only_the_way_the_connectors_move_kv(
    p_role: str | None, d_role: str | None, mode: Mode
) -> None:
    def labels(role: str | None) -> dict[str, str]:
        return {"kv-role": role} if role else {}

    views = [
        worker("p", Stage.PREFILL, rack="r1", labels=labels(p_role)),
        worker("d", Stage.BOTH, gpu="L40S", rack="r1", labels=labels(d_role)),
    ]
    decision, _ = plan(views, request(prompt=4000))
    assert decision.plan is not None and decision.plan.mode is mode
    assert decision.plan.decode_worker_id == "d"
    chain = [(s.mode, s.prefill_worker_id) for s in decision.fallbacks]
    if mode is not Mode.TRANSFER:
        assert all(m is not Mode.TRANSFER for m, _ in chain), chain


def test_layout_conversion_is_costed() -> None:
    views = [
        worker("p", Stage.PREFILL, rack="r1", layout=KvLayout.PAGED_HND),
        worker("d", rack="r1", gpu="L4"),
    ]
    decision, _ = plan(views, request(prompt=4000))
    assert decision.plan is not None and decision.plan.mode is Mode.TRANSFER
    assert decision.plan.estimates.conversion_ms > 0


# -- joint pair choice -----------------------------------------------------------------------


def test_joint_pairing_beats_choosing_one_side_at_a_time() -> None:
    # "fast" is the better prefill worker alone, but every decode worker is across a slow
    # cross-zone link from it; "ok" is slightly slower and next to the decode worker.
    views = [
        worker("fast", Stage.PREFILL, zone="z2", rack="r9", pool="pf"),
        worker("ok", Stage.PREFILL, zone="z1", rack="r1", queue=1, pool="po"),
        worker("dec", zone="z1", rack="r1", gpu="L40S", pool="pd"),
    ]
    links = LinkModel(pool_overrides={("pf", "pd"): Link(gbps=2.0, latency_ms=10.0)})
    req = request(prompt=6000)
    joint, _ = plan(views, req, links=links)
    doc = yaml.safe_load((DEFAULT_PATH).read_text())
    doc["pairing"] = "independent"
    independent_profile = parse_profile(doc)
    independent, _ = plan(views, req, profile=independent_profile, links=links)
    assert joint.plan is not None and independent.plan is not None
    assert joint.plan.prefill_worker_id == "ok"
    assert joint.plan.mode is Mode.TRANSFER
    assert joint.plan.estimates.ttft_ms < independent.plan.estimates.ttft_ms


def test_work_per_request_is_bounded() -> None:
    counts = {}
    for n in (256, 4096):
        fleet = Fleet.build(synthetic_fleet(n, random.Random(3)), NOW)
        index = fleet.index(MODEL, Role.DECODE)
        assert index is not None
        calls = 0

        def keep(ws: WorkerState) -> None:
            nonlocal calls
            calls += 1
            return None

        kept, dropped, truncated = fleet.top_k(index, "capacity", 5, keep, 256)
        assert len(kept) == 5 and not dropped and not truncated
        keys = [r[0] for r in fleet.sorted_workers(index, "capacity")]
        assert keys == sorted(keys)
        counts[n] = calls
    assert counts[256] == counts[4096] == 5


def test_reservations_keep_the_threshold_scan_exact() -> None:
    fleet = Fleet.build([worker(f"d{i}") for i in range(6)], NOW)
    index = fleet.index(MODEL, Role.DECODE)
    assert index is not None
    first, _, _ = fleet.top_k(index, "capacity", 1, lambda ws: None, 64)
    fleet.reserve(first[0].worker_id, kv_bytes=20 * GIB, requests=10)
    second, _, _ = fleet.top_k(index, "capacity", 1, lambda ws: None, 64)
    assert second[0].worker_id != first[0].worker_id
    fleet.release(first[0].worker_id, kv_bytes=20 * GIB, requests=10)
    third, _, _ = fleet.top_k(index, "capacity", 1, lambda ws: None, 64)
    assert third[0].worker_id == first[0].worker_id


def test_burst_spreads_over_equal_decode_workers() -> None:
    fleet = Fleet.build(
        [worker("p", Stage.PREFILL, rack="r1")] + [worker(f"d{i}", rack="r1") for i in range(8)],
        NOW,
    )
    planner = Planner(DEFAULT)
    used = set()
    for i in range(100):
        d = planner.plan(
            request(prompt=1000, output=500, rid=f"r{i}"), fleet, NOW, random.Random(i)
        )
        assert d.plan is not None
        used.add(d.plan.decode_worker_id)
        apply_reservations(fleet, d)
    assert used == {f"d{i}" for i in range(8)}


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


DEFAULT_PATH = (
    __import__("pathlib").Path(__import__("hpd_scheduler.policy", fromlist=["x"]).__file__).parent
    / "profiles"
    / "default.yaml"
)


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
        return replace(worker(wid, labels=labels), model_id="tiny-x")

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
