"""The traffic's buckets and tiers, and the cost model's figures per kind and role."""

from __future__ import annotations

import pytest

from hpd_common import perfmodel
from hpd_plan.capacity import CostModel, Group, Headroom, groups, mm1_wait_factor
from hpd_plan.catalogue import parse_catalogue
from hpd_plan.traffic import (
    buckets,
    mix_trace,
    parse_mix,
    parse_tiers,
    prefix_hits,
    tier_specs,
)
from hpd_scheduler.policy import builtin_profile
from hpd_sim.metrics import Slo
from hpd_sim.traces import Trace, TraceRequest

LLAMA8 = perfmodel.model_spec("llama-3-8b")
H = Headroom(0.8, 0.8, 0.8)


def test_tiers_take_the_policys_targets_unless_overridden() -> None:
    prof = builtin_profile("default")
    tiers = tier_specs(parse_tiers("interactive=1,standard=3"), prof, {"standard": Slo(2000, 80)})
    assert [(t.name, t.share) for t in tiers] == [("interactive", 0.25), ("standard", 0.75)]
    assert tiers[0].slo == Slo(1000.0, 50.0) and tiers[1].slo == Slo(2000, 80)
    with pytest.raises(ValueError, match="gold"):
        tier_specs(parse_tiers("gold"), prof, {})
    assert tier_specs(parse_tiers("gold"), prof, {"*": Slo(1, 2)})[0].slo == Slo(1, 2)


def test_a_mix_of_exact_sizes_gives_one_bucket_per_size_and_tier() -> None:
    mix = parse_mix("1000:100=3,8000:400")
    trace = mix_trace(4.0, mix, 2000, seed=1)
    assert trace == mix_trace(4.0, mix, 2000, seed=1)
    tiers = tier_specs(parse_tiers("interactive,standard"), builtin_profile("default"), {})
    bs = buckets(trace, tiers)
    assert sorted({(b.prompt_hi, b.output_hi) for b in bs}) == [(1000, 100), (8000, 400)]
    assert len(bs) == 4
    assert sum(b.rate_rps for b in bs) == pytest.approx(trace.mean_rate)
    big = next(b for b in bs if b.prompt_hi == 8000)
    assert big.tier_share == pytest.approx(0.25, abs=0.03)
    assert big.decode_ctx == pytest.approx(8000 + 200)


def test_prefix_hits_count_the_longest_prefix_seen_before() -> None:
    reqs = [
        TraceRequest(0.0, 1500, 5, (1, 2, 3)),
        TraceRequest(1.0, 1500, 5, (1, 2, 9)),
        TraceRequest(2.0, 600, 5, (1, 2)),
        TraceRequest(3.0, 700, 5, (7, 1)),
    ]
    assert prefix_hits(reqs, 512) == [0, 1024, 599, 0]


def test_bucket_edges_follow_the_trace_percentiles() -> None:
    rows = tuple(TraceRequest(float(i), 100 + i, 10 + i % 50) for i in range(1000))
    tiers = tier_specs(parse_tiers("standard"), builtin_profile("default"), {})
    bs = buckets(Trace("t", rows), tiers)
    assert sorted({b.prompt_hi for b in bs}) == [600, 900, 1050, 1099]
    assert sum(b.tier_share for b in bs) == pytest.approx(1.0)


def _costs(
    kinds: list[str], prompt: int, output: int
) -> dict[tuple[str, str], tuple[float, float]]:
    cat = parse_catalogue([{"name": k} for k in kinds], LLAMA8)
    tiers = tier_specs(parse_tiers("standard"), builtin_profile("default"), {})
    (b,) = buckets(mix_trace(1.0, ((prompt, output, 1.0),), 50), tiers)
    cm = CostModel(LLAMA8)
    out = {}
    for g in groups(cat):
        c = cm.cost(g, b, H)
        if c is not None and g.role != "both":
            out[(g.kind.name, g.role)] = (c.prefill_s + c.decode_s) * g.price_per_hour, c.miss
    return out


def test_compute_rich_kinds_prefill_and_bandwidth_rich_ones_decode_cheaper() -> None:
    """L40S: 362 TFLOP/s, 864 GB/s at $1.86; H20: 148 TFLOP/s, 4,000 GB/s at $1.80."""
    c = _costs(["L40S", "H20"], 4000, 400)
    assert c[("L40S", "prefill")][0] < c[("H20", "prefill")][0]
    assert c[("H20", "decode")][0] < c[("L40S", "decode")][0]


def test_a_kind_too_slow_for_the_tpot_misses_and_is_left_out() -> None:
    """One decode step of Llama-3-8B on an L4 reads 16 GB at 300 GB/s x 0.7: ~76 ms, over
    the interactive tier's 50 ms TPOT."""
    cat = parse_catalogue([{"name": "L4"}, {"name": "A100-80G"}], LLAMA8)
    tiers = tier_specs(parse_tiers("interactive"), builtin_profile("default"), {})
    bs = buckets(mix_trace(1.0, ((500, 200, 1.0),), 50), tiers)
    gs = groups(cat)
    cm = CostModel(LLAMA8)
    l4 = next(g for g in gs if g.kind.name == "L4" and g.role == "decode")
    cost = cm.cost(l4, bs[0], H)
    assert cost is not None and cost.miss == 1.0
    table = cm.table(gs, bs, H, slack=0.05)
    assert all(not (gs[j].kind.name == "L4" and gs[j].role != "prefill") for _, j in table)


def test_the_decode_point_respects_the_step_budget_and_memory() -> None:
    cat = parse_catalogue([{"name": "A100-80G"}], LLAMA8)
    k = cat.kinds[0]
    tiers = tier_specs(parse_tiers("standard"), builtin_profile("default"), {})
    (b,) = buckets(mix_trace(1.0, ((20000, 500, 1.0),), 20), tiers)
    cm = CostModel(LLAMA8)
    batch, step = cm.decode_point(k, 1, b, 100.0)
    assert step <= 100.0 and batch * b.seq_tokens <= cm.kv_tokens(k, 1)
    assert cm.decode_point(k, 1, b, 1e9)[0] == int(cm.kv_tokens(k, 1) // b.seq_tokens)
    assert Group(k, 2, "both", 0.4).label == "A100-80G tp2 both@0.4"


def test_the_wait_factor_is_the_md1_mean_wait() -> None:
    assert mm1_wait_factor(0.8) == pytest.approx(2.0)
    assert mm1_wait_factor(0.9) == pytest.approx(4.5)
    assert mm1_wait_factor(0.0) == 0.0
