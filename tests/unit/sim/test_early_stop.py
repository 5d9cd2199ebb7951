"""A run that only has to decide whether the attainment reaches a share stops as soon as it
cannot, and decides exactly as the whole run does; the goodput search that uses it finds the
same goodput."""

from __future__ import annotations

import math
import random

import pytest

from hpd_scheduler.policy import builtin_profile
from hpd_sim import RequestOutcome, SimConfig, Slo, load_cluster, simulate
from hpd_sim.metrics import TierSlos
from hpd_sim.runner import run_point, run_policy
from hpd_sim.traces import Trace, TraceRequest

SLO = Slo(ttft_ms=1000.0, tpot_ms=50.0)
CONFIG = SimConfig(seed=0, tiers=(("interactive", 1.0),))


def _trace(rate: float, n: int, seed: int) -> Trace:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, rng.randint(200, 3000), rng.randint(20, 300)))
    return Trace("poisson", tuple(out))


@pytest.mark.parametrize("policy", ["default", "least_loaded", "colocated"])
@pytest.mark.parametrize("scale", [0.5, 2.0, 4.0, 8.0])
def test_a_run_that_may_stop_early_decides_as_the_whole_run(policy: str, scale: float) -> None:
    trace, cluster = _trace(10.0, 600, seed=3), load_cluster()
    prof = builtin_profile(policy)
    whole = run_point(cluster, prof, trace, scale, SLO, CONFIG)
    early = run_point(cluster, prof, trace, scale, SLO, CONFIG, stop_below=0.9)
    assert not whole.stopped_early
    assert (early.attainment >= 0.9) == (whole.attainment >= 0.9)
    if whole.attainment >= 0.9:  # nothing to stop for: the same run
        assert not early.stopped_early
        assert early.attainment == whole.attainment
    else:
        assert early.stopped_early
        assert early.attainment <= whole.attainment < 0.9


def test_an_overloaded_run_stops_well_before_its_last_request() -> None:
    trace = _trace(200.0, 800, seed=4)  # twenty times what the fleet serves
    res = simulate(
        load_cluster(), builtin_profile("least_loaded"), trace.requests, judge=SLO,
        stop_below=0.9,
    )  # fmt: skip
    unfinished = sum(1 for o in res.outcomes if math.isnan(o.finish_s) and not o.rejected)
    assert res.stopped_early
    assert unfinished > len(trace.requests) // 4


@pytest.mark.parametrize("policy", ["default", "round_robin"])
def test_the_search_finds_the_same_goodput_with_early_stops(policy: str) -> None:
    trace, cluster = _trace(10.0, 500, seed=7), load_cluster()
    args = (cluster, policy, trace, SLO, CONFIG)
    whole = run_policy(*args, search=True, start=1.0, rel_tol=0.05)
    early = run_policy(*args, search=True, start=1.0, rel_tol=0.05, early_stop=True)
    assert early.goodput_rps == whole.goodput_rps
    assert [p.rate_scale for p in early.points] == [p.rate_scale for p in whole.points]
    assert any(p.stopped_early for p in early.points)


def test_an_unfinished_request_is_no_hit() -> None:
    o = RequestOutcome(0, "interactive", 1.0, 100, 10)
    assert not SLO.met(o)
    o.first_s = 1.2
    assert not SLO.met(o)  # no last token yet
    assert not SLO.ttft_missed(o)
    o.finish_s = 1.3
    assert SLO.met(o)


def test_requests_are_judged_by_their_tiers_targets() -> None:
    judge = TierSlos(SLO, {"batch": Slo(ttft_ms=30_000.0, tpot_ms=200.0)})
    slow = RequestOutcome(0, "batch", 0.0, 100, 2, first_s=5.0, finish_s=5.1)
    assert judge.met(slow) and not judge.ttft_missed(slow)
    slow.tier = "interactive"
    assert not judge.met(slow) and judge.ttft_missed(slow)
