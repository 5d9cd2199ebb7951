"""The planner plans a worker at its learned speed (``LearnedSpeed``), with no clamp, and
its plans carry the nominal terms the learner fits against."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from hpd_scheduler.policy import (
    Fleet,
    LearnedSpeed,
    LearnedStep,
    Link,
    LinkModel,
    Mode,
    Planner,
    Stage,
    builtin_profile,
)
from hpd_scheduler.policy.pairing import NO_LOCAL_LABEL, NO_LOCAL_VALUE

from .builders import NOW, request, worker

DEFAULT = builtin_profile("default")


def _fleet(slow: LearnedSpeed | None, fast: LearnedSpeed | None = None) -> Fleet:
    views = [
        replace(worker("p-fast", Stage.PREFILL, rack="r1"), learned=fast),
        replace(worker("p-slow", Stage.PREFILL, rack="r1"), learned=slow),
        replace(worker("d", Stage.DECODE, rack="r1"), learned=fast),
    ]
    return Fleet.build(views, NOW)


def test_a_worker_learned_slower_than_declared_is_planned_at_its_measured_speed() -> None:
    fleet = _fleet(LearnedSpeed(fixed_ms=30.0, scale=25.0, samples=8))
    ws, base = fleet.worker("p-slow"), fleet.worker("p-fast")
    assert ws is not None and base is not None
    # 25x the declared compute (the report's clamp stopped at 4x) plus 30 ms per request
    assert ws.prefill_ms(2000) == pytest.approx(base.prefill_ms(2000) * 25.0 + 30.0)
    for seed in range(5):
        d = Planner(DEFAULT).plan(
            request(2000, 64, "standard", rid=f"r{seed}"), fleet, NOW, random.Random(seed)
        )
        assert d.plan is not None
        assert d.plan.prefill_worker_id == "p-fast"


def test_a_queue_on_the_fast_worker_makes_the_slow_one_the_cheaper() -> None:
    slow = LearnedSpeed(fixed_ms=0.0, scale=4.0, samples=8)
    fleet = _fleet(slow)
    planner = Planner(DEFAULT)
    chosen = []
    for i in range(30):
        d = planner.plan(request(2000, 64, "standard", rid=f"q{i}"), fleet, NOW, random.Random(i))
        assert d.plan is not None
        chosen.append(d.plan.prefill_worker_id)
        fleet.reserve(d.plan.prefill_worker_id, 0, d.plan.prefill_tokens, 0)
    assert chosen[0] == "p-fast"
    # once the fast one's queue outweighs 4x the compute (the decode worker recomputes some)
    assert "p-slow" in chosen
    assert chosen.count("p-fast") > chosen.count("p-slow")


def test_a_plan_carries_the_nominal_terms_of_its_prefill() -> None:
    learned = LearnedSpeed(fixed_ms=40.0, scale=10.0, samples=8)
    fleet = _fleet(learned, fast=learned)
    ws = fleet.worker("p-fast")
    assert ws is not None
    fleet.reserve("p-fast", 0, 4000, 0)
    fleet.reserve("p-slow", 0, 4000, 0)
    fleet.reserve("d", 0, 4000, 0)
    d = Planner(DEFAULT).plan(request(1500, 64, "batch"), fleet, NOW, random.Random(0))
    assert d.plan is not None
    e = d.plan.estimates
    ahead = 4000 / fleet.ref_tokens
    assert e.prefill_ahead == pytest.approx(ahead)
    # the plan's wait and prefill are the learned model over those terms
    assert e.prefill_wait_ms + e.prefill_ms == pytest.approx(
        10.0 * e.prefill_nominal_ms + 40.0 * (1.0 + ahead), rel=1e-6
    )


@pytest.mark.parametrize("share", [0.0, 0.35, 1.0])
def test_a_queue_is_priced_at_its_learned_share_of_the_fixed_cost(share: float) -> None:
    """An engine that batches prefills: each request queued ahead adds ``share`` of a
    request's fixed cost; the plan's terms still recover the declared model's time."""
    learned = LearnedSpeed(fixed_ms=40.0, scale=10.0, samples=8, queue_share=share)
    fleet = _fleet(learned, fast=learned)
    for wid in ("p-fast", "p-slow", "d"):
        fleet.reserve(wid, 0, 4000, 0)
    ws = fleet.worker("p-fast")
    assert ws is not None
    ahead = 4000 / fleet.ref_tokens
    compute = 4000 / ws.cap.prefill_tps * 1000.0 * 10.0  # the queued tokens at the learned scale
    assert ws.prefill_wait_ms() == pytest.approx(compute + 40.0 * share * ahead, rel=1e-6)
    d = Planner(DEFAULT).plan(request(1500, 64, "batch"), fleet, NOW, random.Random(0))
    assert d.plan is not None
    e = d.plan.estimates
    assert e.prefill_wait_ms + e.prefill_ms == pytest.approx(
        10.0 * e.prefill_nominal_ms + 40.0 * (1.0 + share * ahead), rel=1e-6
    )


def test_a_learned_share_outside_its_bounds_is_refused() -> None:
    with pytest.raises(Exception, match="queue_share"):
        LearnedSpeed(fixed_ms=1.0, scale=1.0, samples=1, queue_share=1.5)


def test_a_worker_not_yet_measured_is_probed_one_request_at_a_time() -> None:
    """Planned at its peers' speed (the prior: 0 samples of its own) a worker takes one
    prefill at a time until it has a fit of its own; a measured worker is not held."""
    measured = LearnedSpeed(fixed_ms=30.0, scale=5.0, samples=8)
    prior = LearnedSpeed(fixed_ms=30.0, scale=5.0, samples=0)
    fleet = _fleet(prior, fast=measured)
    planner = Planner(DEFAULT)
    chosen = []
    for i in range(12):
        d = planner.plan(request(2000, 64, "standard", rid=f"b{i}"), fleet, NOW, random.Random(i))
        assert d.plan is not None
        chosen.append(d.plan.prefill_worker_id)
        fleet.reserve(d.plan.prefill_worker_id, 0, d.plan.prefill_tokens, 1)
    assert chosen.count("p-slow") == 1, chosen  # one probe in flight, the rest held
    # once measured (as fast as its peer here) it takes its share of the burst
    again = _fleet(measured, fast=measured)
    got = []
    for i in range(12):
        d = planner.plan(request(2000, 64, "standard", rid=f"m{i}"), again, NOW, random.Random(i))
        assert d.plan is not None
        got.append(d.plan.prefill_worker_id)
        again.reserve(d.plan.prefill_worker_id, 0, d.plan.prefill_tokens, 1)
    assert got.count("p-slow") >= 3, got


def test_a_decode_step_learned_to_grow_with_the_batch_prices_tpot_and_admission() -> None:
    """A decode engine whose step grows by 2 ms a sequence: its TPOT estimate carries it
    (the report's clamped correction would not), the plan carries the step's terms, and
    past the tier's TPOT limit the request goes to a decode worker that keeps it."""
    step = LearnedStep(scale=2.0, seq_ms=2.0, samples=9)
    views = [
        worker("p", Stage.PREFILL, rack="r1"),
        replace(worker("d-busy", Stage.DECODE, rack="r1"), learned_step=step),
        replace(worker("d-free", Stage.DECODE, rack="r1"), learned_step=step),
    ]
    fleet = Fleet.build(views, NOW)
    busy = fleet.worker("d-busy")
    assert busy is not None
    nominal = busy.cap.decode_step_ms(busy.ctx_tokens)
    assert busy.step_ms() == pytest.approx(2.0 * nominal + 2.0 * busy.step_sequences())
    for _ in range(40):  # 40 sequences reserved on d-busy: an 80 ms step
        fleet.reserve("d-busy", 0, 0, 1)
    d = Planner(DEFAULT).plan(request(500, 64, "interactive"), fleet, NOW, random.Random(0))
    assert d.plan is not None
    assert d.plan.decode_worker_id == "d-free"  # the interactive tier's 50 ms TPOT
    e = d.plan.estimates
    assert e.decode_others == pytest.approx(0.0)
    free = fleet.worker("d-free")
    assert free is not None
    assert 2.0 * e.decode_nominal_ms + 2.0 * (1 + e.decode_others) == pytest.approx(
        e.decode_step_ms, rel=1e-6
    )
    assert e.tpot_ms >= e.decode_step_ms


def test_a_decode_worker_labelled_never_to_prefill_gets_transfers_however_slow() -> None:
    """``local-prefill=never``: measured, the link is slower than the decode worker
    recomputing (a 200 ms hand-off), so the planner would recompute; the operator's label
    keeps the decode engine's batches free of prefills, and the plan transfers. Where no KV
    can reach it the label gives way: it recomputes rather than refuse."""
    slow_link = Link(gbps=100.0, latency_ms=200.0)
    views = [
        worker("p", Stage.PREFILL, pool="pp", rack="r1"),
        worker("d", Stage.DECODE, pool="dp", rack="r1"),
    ]
    links = LinkModel(pool_overrides={("pp", "dp"): slow_link})
    free = Planner(DEFAULT).plan(
        request(1000, 64, "standard"), Fleet.build(views, NOW, links=links), NOW,
        random.Random(0),
    )  # fmt: skip
    assert free.plan is not None and free.plan.mode is Mode.RECOMPUTE
    labelled = [views[0], worker("d", Stage.DECODE, pool="dp", rack="r1",
                                 labels={NO_LOCAL_LABEL: NO_LOCAL_VALUE})]  # fmt: skip
    kept = Planner(DEFAULT).plan(
        request(1000, 64, "standard"), Fleet.build(labelled, NOW, links=links), NOW,
        random.Random(0),
    )  # fmt: skip
    assert kept.plan is not None and kept.plan.mode is Mode.TRANSFER
    # no prefill worker at all: it serves the request itself
    alone = Planner(DEFAULT).plan(
        request(1000, 64, "standard"), Fleet.build(labelled[1:], NOW), NOW, random.Random(0)
    )
    assert alone.plan is not None and alone.plan.mode is Mode.RECOMPUTE
