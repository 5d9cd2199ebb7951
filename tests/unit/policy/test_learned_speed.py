"""The planner plans a worker at its learned speed (``LearnedSpeed``), with no clamp, and
its plans carry the nominal terms the learner fits against."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from hpd_scheduler.policy import Fleet, LearnedSpeed, Planner, Stage, builtin_profile

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
