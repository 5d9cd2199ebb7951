"""The integer program on hand-built cases whose answer is known (costs set by hand, not
by the performance model)."""

from __future__ import annotations

import pytest

from hpd_plan.capacity import Headroom
from hpd_plan.milp import best_candidates, max_alpha
from hpd_plan.planner import _structural
from tests.unit.plan.cases import bucket, by_kind, kind, problem


def test_a_kind_twice_as_fast_at_one_and_a_half_times_the_price_wins() -> None:
    # 40 req/s: kind A needs 4 prefill + 8 decode workers ($12), B half as many ($9)
    p = problem([bucket(40.0)], {"A": (kind("A", 1.0), 0.1, 0.2), "B": (kind("B", 1.5), 0.05, 0.1)})
    best = best_candidates(p, k=1)[0]
    assert best.price_per_hour == pytest.approx(9.0)
    assert best.pools == {("B", 1, "prefill"): 2, ("B", 1, "decode"): 4}


def test_an_availability_limit_forces_a_mix() -> None:
    # only 4 B GPUs: they carry 8 of the 12 units of load, A workers the other 4: $6 + $4
    speeds = {"A": (kind("A", 1.0), 0.1, 0.2), "B": (kind("B", 1.5, available=4), 0.05, 0.1)}
    best = best_candidates(problem([bucket(40.0)], speeds), k=1)[0]
    assert best.price_per_hour == pytest.approx(10.0)
    assert by_kind(best.pools) == {"A": 4, "B": 4}


@pytest.mark.parametrize(("prompt_weight", "more"), [(4.0, "C"), (0.25, "M")])
def test_prefill_and_decode_heavy_traffic_pick_their_kind_per_role(
    prompt_weight: float, more: str
) -> None:
    """C computes fast (prefill), M reads memory fast (decode), at one price: each role
    goes to its kind, and the heavier side's kind gets more workers."""
    speeds = {
        "C": (kind("C", 1.0), 0.05 * prompt_weight, 0.4),
        "M": (kind("M", 1.0), 0.2 * prompt_weight, 0.1),
    }
    best = best_candidates(problem([bucket(20.0)], speeds), k=1)[0]
    roles = {role: k for (k, _, role) in best.pools}
    assert roles == {"prefill": "C", "decode": "M"}
    counts = by_kind(best.pools)
    assert counts[more] > counts["M" if more == "C" else "C"]


def test_headroom_scales_the_workers_needed() -> None:
    speeds = {"A": (kind("A", 1.0), 0.1, 0.1)}
    full = best_candidates(problem([bucket(8.0)], speeds), k=1)[0]
    half = best_candidates(problem([bucket(8.0)], speeds, Headroom(0.5, 0.5, 0.5)), k=1)[0]
    assert full.price_per_hour == pytest.approx(2.0)  # 0.8 + 0.8 of a worker
    assert half.price_per_hour == pytest.approx(4.0)


def test_both_stage_workers_at_an_operating_point() -> None:
    # one both-stage worker at rho 0.5 prefills 0.5 s/s and decodes 0.5 s/s: 5 req/s of
    # 0.1 + 0.1 s fit one worker, where disaggregated roles need two
    speeds = {"A": (kind("A", 1.0), 0.1, 0.1)}
    best = best_candidates(problem([bucket(5.0)], speeds, roles=("prefill", "decode", "both")), 1)[
        0
    ]
    assert best.pools == {("A", 1, "both"): 1}


def test_next_best_fleets_are_distinct_dearer_and_never_a_superset() -> None:
    speeds = {
        "A": (kind("A", 1.0), 0.1, 0.2),
        "B": (kind("B", 1.5), 0.05, 0.1),
        "C": (kind("C", 2.2), 0.04, 0.06),
    }
    cands = best_candidates(problem([bucket(40.0)], speeds), k=3)
    assert len(cands) == 3
    prices = [c.price_per_hour for c in cands]
    assert prices == sorted(prices)
    for i, later in enumerate(cands):
        for earlier in cands[:i]:
            assert later.pools != earlier.pools
            assert any(later.pools.get(pool, 0) < n for pool, n in earlier.pools.items())


def test_an_infeasible_catalogue_reports_the_share_it_can_carry() -> None:
    # 2 A GPUs carry 1 prefill + 1 decode worker: 5 of the 10 req/s (decode binds)
    speeds = {"A": (kind("A", 1.0, available=2), 0.1, 0.2)}
    p = problem([bucket(10.0)], speeds)
    assert best_candidates(p) == []
    most = max_alpha(p)
    assert most is not None
    assert most.alpha == pytest.approx(0.5)
    assert most.pools == {("A", 1, "prefill"): 1, ("A", 1, "decode"): 1}


def test_a_tier_that_misses_everywhere_is_named() -> None:
    speeds = {"A": (kind("A", 1.0), 0.1, 0.1)}
    p = problem([bucket(1.0, "gold")], speeds, miss={(0, "A"): 0.3})
    assert best_candidates(p) == []
    found = _structural(p)
    assert found is not None
    tier, reason, miss = found
    assert tier == "gold" and "tier gold" in reason and miss == pytest.approx(0.6)


def test_the_miss_budget_lets_a_cheap_kind_take_only_its_share() -> None:
    # C is free but misses every request of bucket 1 (a tenth of the tier): it may take
    # that bucket only up to the budget of 5 % of the tier's requests
    buckets = [bucket(9.0, share=0.9), bucket(1.0, share=0.1)]
    speeds = {"A": (kind("A", 1.0), 0.1, 0.1), "C": (kind("C", 0.0), 0.1, 0.1)}
    p = problem(buckets, speeds, miss={(1, "C"): 1.0, (0, "A"): 0.0})
    best = best_candidates(p, k=1)[0]
    on_c = sum(x for (i, j), x in best.shares.items() if i == 1 and p.groups[j].kind.name == "C")
    # prefill and decode misses add (a union bound): 0.1 x (share_p + share_d) <= 0.05
    assert 0.1 * on_c <= 0.05 + 1e-6
