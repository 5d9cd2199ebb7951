"""The planning loop's rules and the reasons it gives: the side that missed loses headroom,
learned figures slow a kind, and each pool says why it is of its kind."""

from __future__ import annotations

import pytest

from hpd_common import perfmodel
from hpd_plan.capacity import CostModel, Headroom, groups
from hpd_plan.catalogue import parse_catalogue
from hpd_plan.milp import best_candidates
from hpd_plan.planner import TIGHTEN, _tighten
from hpd_plan.report import why
from hpd_plan.traffic import buckets, mix_trace, parse_tiers, tier_specs
from hpd_plan.verify import TierResult, Verdict
from hpd_scheduler.policy import builtin_profile
from tests.unit.plan.cases import bucket, kind, problem

H = Headroom(0.8, 0.8, 0.8)


def verdict(ttft: float, tpot: float) -> Verdict:
    return Verdict({"standard": TierResult(min(ttft, tpot), ttft, tpot, 100)}, False, False, 0.0)


@pytest.mark.parametrize(
    ("ttft", "tpot", "prefill", "decode"),
    [
        (0.80, 0.99, 0.8 * TIGHTEN, 0.8),  # TTFT missed: prefill capacity was short
        (0.99, 0.80, 0.8, 0.8 * TIGHTEN),  # TPOT missed: decode capacity was short
        (0.91, 0.92, 0.8 * TIGHTEN, 0.8),  # each side holds alone: the lower one
    ],
)
def test_the_side_that_missed_loses_headroom(
    ttft: float, tpot: float, prefill: float, decode: float
) -> None:
    h = _tighten(H, verdict(ttft, tpot), 0.9)
    assert h.prefill == pytest.approx(prefill) and h.decode == pytest.approx(decode)
    assert h.both == pytest.approx(0.8 * TIGHTEN)


def test_learned_figures_make_a_kind_dearer() -> None:
    llama = perfmodel.model_spec("llama-3-8b")
    plain = parse_catalogue([{"name": "A100-80G"}], llama)
    slow = parse_catalogue(
        [{"name": "A100-80G", "learned": {"prefill_scale": 2.0, "decode_scale": 1.5}}], llama
    )
    tiers = tier_specs(parse_tiers("standard"), builtin_profile("default"), {})
    (b,) = buckets(mix_trace(1.0, ((2000, 200, 1.0),), 50), tiers)
    cm = CostModel(llama)
    fast_p, fast_d = (cm.cost(g, b, H) for g in groups(plain)[:2])
    slow_p, slow_d = (cm.cost(g, b, H) for g in groups(slow)[:2])
    assert fast_p and slow_p and fast_d and slow_d
    assert slow_p.prefill_s == pytest.approx(2.0 * fast_p.prefill_s)
    assert slow_d.decode_s > 1.4 * fast_d.decode_s


def test_each_pool_says_why_it_is_of_its_kind() -> None:
    speeds = {"A": (kind("A", 1.0), 0.1, 0.2), "B": (kind("B", 1.5, available=4), 0.05, 0.1)}
    p = problem([bucket(40.0)], speeds)
    best = best_candidates(p, k=1)[0]
    reasons = {pool: why(p, best, pool) for pool in best.pools}
    for (k, _, role), text in reasons.items():
        if k == "B":
            assert text.startswith(f"lowest $ per {role}")
        else:
            assert "B is 25% cheaper" in text and "its 4 available GPU(s) are in use" in text
