"""Metric definitions, the goodput search and the fluid bound."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpd_sim import RequestOutcome, SimResult, Slo, load_cluster, percentile, summarize, tbt_ms
from hpd_sim.goodput import fluid_bound, search_goodput
from hpd_sim.traces import TraceRequest


@pytest.mark.parametrize(
    ("gaps", "expected"),
    [
        pytest.param([], 0.0, id="no-gaps"),
        pytest.param([7.0], 7.0, id="one-gap"),
        pytest.param([10.0] * 9 + [100.0], 100.0, id="ten-gaps-top-one"),
        pytest.param([10.0] * 18 + [50.0, 30.0], 40.0, id="twenty-gaps-top-two"),
        pytest.param([5.0] * 19, 5.0, id="nineteen-gaps-floor-to-one"),
    ],
)
def test_tbt_is_the_mean_of_the_longest_tenth_of_gaps(gaps: list[float], expected: float) -> None:
    assert tbt_ms(gaps) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        pytest.param(50, 3.0, id="p50"),
        pytest.param(90, 5.0, id="p90"),
        pytest.param(0, 1.0, id="p0"),
        pytest.param(100, 5.0, id="p100"),
    ],
)
def test_percentile_is_nearest_rank(p: float, expected: float) -> None:
    assert percentile([5.0, 1.0, 4.0, 2.0, 3.0], p) == expected


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))


def _outcome(
    ttft_ms: float, tpot_ms: float, out: int = 11, rejected: bool = False
) -> RequestOutcome:
    first = 1.0 + ttft_ms / 1e3
    return RequestOutcome(
        0,
        "standard",
        1.0,
        100,
        out,
        rejected=rejected,
        first_s=first,
        finish_s=first + tpot_ms * (out - 1) / 1e3,
    )


@pytest.mark.parametrize(
    ("outcome", "met"),
    [
        pytest.param(_outcome(900, 40), True, id="both-met"),
        pytest.param(_outcome(1100, 40), False, id="ttft-missed"),
        pytest.param(_outcome(900, 60), False, id="tpot-missed"),
        pytest.param(_outcome(10, 10, rejected=True), False, id="rejected-is-a-miss"),
        pytest.param(_outcome(900, 0, out=1), True, id="single-token"),
    ],
)
def test_slo_met_needs_ttft_and_tpot(outcome: RequestOutcome, met: bool) -> None:
    assert Slo(1000, 50).met(outcome) is met


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("ttft=1000", id="no-tpot"),
        pytest.param("ttft=1,tpot=x", id="not-a-number"),
        pytest.param("ttft=1,tpot=2,foo=3", id="unknown-term"),
        pytest.param("ttft=0,tpot=5", id="zero"),
    ],
)
def test_bad_slo_text_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Slo.parse(text)


def test_slo_parse() -> None:
    assert Slo.parse("ttft=800, tpot=40, tbt=120") == Slo(800.0, 40.0, 120.0)


@given(
    threshold=st.floats(min_value=0.05, max_value=500.0),
    start=st.floats(min_value=0.1, max_value=50.0),
)
def test_goodput_search_finds_the_threshold_of_a_monotone_curve(
    threshold: float, start: float
) -> None:
    calls: list[float] = []

    def curve(s: float) -> float:
        calls.append(s)
        return 0.99 if s <= threshold else 0.5

    found = search_goodput(curve, start=start, rel_tol=0.02)
    assert found.scale <= threshold
    assert found.scale >= threshold / 1.02 - 1e-12
    assert len(calls) == len(set(calls)) == len(found.points)


def test_goodput_search_reports_zero_when_nothing_passes() -> None:
    assert search_goodput(lambda s: 0.0, start=1.0).scale == 0.0


def test_goodput_search_on_a_smooth_curve() -> None:
    # attainment falls linearly from 1 at scale 2 to 0 at scale 12: 0.9 is crossed at 3
    found = search_goodput(lambda s: min(1.0, max(0.0, (12 - s) / 10)), rel_tol=0.01)
    assert found.scale == pytest.approx(3.0, rel=0.011)


def test_fluid_bound_is_the_smaller_stage_and_grows_with_the_tpot_slo() -> None:
    cluster = load_cluster()
    reqs = [TraceRequest(float(i), 1000 + 10 * i, 100 + i) for i in range(200)]
    tight = fluid_bound(cluster, reqs, tpot_ms=30.0)
    loose = fluid_bound(cluster, reqs, tpot_ms=80.0)
    assert tight.rps == pytest.approx(min(tight.prefill_rps, tight.decode_rps))
    assert loose.decode_rps > tight.decode_rps
    assert loose.prefill_rps == pytest.approx(tight.prefill_rps)
    colo = fluid_bound(cluster.colocated(), reqs, tpot_ms=80.0)
    assert colo.prefill_rps == colo.decode_rps == 0.0
    assert colo.both_rps > 0


def test_a_summary_judges_each_request_by_its_tiers_slo() -> None:
    # one request per tier, each 2 s to its first token: within the batch tier's 30 s,
    # past the interactive tier's 1 s (and past the default SLO a tier without one gets)
    outs = [
        RequestOutcome(i, tier, 0.0, 100, 2, first_s=2.0, finish_s=2.01)
        for i, tier in enumerate(("batch", "interactive", "standard"))
    ]
    result = SimResult("p", "c", 1.0, outs, 2.01, 0.0, 3, 3, 3)
    slos = {"batch": Slo(30_000.0, 200.0), "interactive": Slo(1000.0, 50.0)}
    s = summarize(result, Slo(1500.0, 100.0), slos)
    assert s.per_tier == {"batch": 1.0, "interactive": 0.0, "standard": 0.0}
    assert s.attainment == pytest.approx(1 / 3)
