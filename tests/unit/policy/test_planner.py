"""Where the planner goes beyond the seeds, its cost model: KV bytes, recompute on the
receiving worker, load normalised by capacity, per-tier targets, the real link and the
joint choice of the pair."""

from __future__ import annotations

import random

import pytest
import yaml

from hpd_common.kvformat import KvDtype, KvLayout
from hpd_common.perfmodel import model_spec
from hpd_scheduler.policy import (
    DecisionKind,
    Fleet,
    Link,
    LinkModel,
    Locality,
    Mode,
    Planner,
    Role,
    Stage,
    WorkerState,
    apply_reservations,
    parse_profile,
)
from hpd_scheduler.policy.framework import Candidate
from hpd_scheduler.policy.plugins import (
    BlindLoadScorer,
    LinkTransferScorer,
    TierItlScorer,
    WorkLoadScorer,
)
from hpd_scheduler.policy.synthetic import synthetic_fleet

from .builders import (
    DEFAULT,
    DEFAULT_PATH,
    DISAGGREGATED,
    GIB,
    MODEL,
    NOW,
    ctx_for,
    plan,
    request,
    worker,
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
        # KV memory empty: with the builder's 10 GiB of other sequences resident an L4's
        # step is past the standard TPOT target and the TPOT admission refuses the request
        worker("d", rack="r1", gpu="L4", kv_free_gib=40.0),
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
