"""Admission under overload: past the fleet's capacity the default profile refuses the requests
it predicts would miss their TTFT by its admission factor, so the ones it admits keep their
SLO instead of every request queueing into a miss."""

from __future__ import annotations

from dataclasses import replace

from hpd_scheduler.policy import builtin_profile
from hpd_sim import SimConfig, attainment, load_cluster, simulate
from hpd_sim.goodput import fluid_bound
from hpd_sim.suite import WORKLOADS, cluster_path, load_workload
from hpd_sim.traces import reshape

DEFAULT = builtin_profile("default")
assert DEFAULT.slo_objective is not None
NO_ADMISSION = replace(DEFAULT, slo_objective=replace(DEFAULT.slo_objective, admit_ttft_factor=0.0))


def test_admission_keeps_admitted_requests_within_their_slo_at_three_times_the_bound() -> None:
    cluster = load_cluster(cluster_path("homogeneous"))
    w = next(x for x in WORKLOADS if x.name == "azure_conv")
    trace = load_workload(w, 1500)
    bound = fluid_bound(cluster, trace.requests, w.slo.tpot_ms).rps
    overloaded = reshape(trace, rate_scale=3.0 * bound / trace.mean_rate)
    config = SimConfig(seed=0, tiers=((w.tier, 1.0),))

    with_admission = simulate(cluster, DEFAULT, overloaded.requests, config).outcomes
    without = simulate(cluster, NO_ADMISSION, overloaded.requests, config).outcomes

    admitted = [o for o in with_admission if not o.rejected]
    refused = [o for o in with_admission if o.rejected]
    assert refused and {o.reject_reason for o in refused} == {"ttft_over_admission_limit"}
    assert len(admitted) >= 0.3 * len(with_admission)  # it still serves about its capacity
    assert attainment(admitted, w.slo) >= 0.9
    # without admission every request is served and most miss: the queue only grows
    assert not any(o.rejected for o in without)
    assert attainment(without, w.slo) < 0.5
    assert attainment(with_admission, w.slo) > attainment(without, w.slo)
