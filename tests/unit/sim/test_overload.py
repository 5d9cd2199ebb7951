"""Admission under overload: past the fleet's capacity the default profile refuses the requests
it predicts would miss their TTFT or TPOT by its admission factors, so the ones it admits keep
their SLO instead of every request queueing into a miss."""

from __future__ import annotations

from dataclasses import replace

from hpd_scheduler.policy import Profile, builtin_profile
from hpd_sim import RequestOutcome, SimConfig, attainment, load_cluster, simulate
from hpd_sim.goodput import fluid_bound
from hpd_sim.suite import WORKLOADS, Workload, cluster_path, load_workload
from hpd_sim.traces import reshape

DEFAULT = builtin_profile("default")
assert DEFAULT.slo_objective is not None
NO_ADMISSION = replace(
    DEFAULT,
    slo_objective=replace(DEFAULT.slo_objective, admit_ttft_factor=0.0, admit_tpot_factor=0.0),
)
NO_TPOT_ADMISSION = replace(
    DEFAULT, slo_objective=replace(DEFAULT.slo_objective, admit_tpot_factor=0.0)
)


def _overloaded(
    cluster_name: str, workload: str, times_bound: float, profile: Profile
) -> tuple[list[RequestOutcome], Workload]:
    """The outcomes of ``profile`` on a suite cell's first 1,500 requests at ``times_bound``
    x the cluster's fluid bound."""
    cluster = load_cluster(cluster_path(cluster_name))
    w = next(x for x in WORKLOADS if x.name == workload)
    trace = load_workload(w, 1500)
    bound = fluid_bound(cluster, trace.requests, w.slo.tpot_ms).rps
    overloaded = reshape(trace, rate_scale=times_bound * bound / trace.mean_rate)
    config = SimConfig(seed=0, tiers=((w.tier, 1.0),))
    return simulate(cluster, profile, overloaded.requests, config).outcomes, w


def test_admission_keeps_admitted_requests_within_their_slo_at_three_times_the_bound() -> None:
    with_admission, w = _overloaded("homogeneous", "azure_conv", 3.0, DEFAULT)
    without, _ = _overloaded("homogeneous", "azure_conv", 3.0, NO_ADMISSION)

    admitted = [o for o in with_admission if not o.rejected]
    refused = [o for o in with_admission if o.rejected]
    reasons = {o.reject_reason for o in refused}
    assert "ttft_over_admission_limit" in reasons
    assert reasons <= {"ttft_over_admission_limit", "tpot_over_admission_limit"}
    assert len(admitted) >= 0.3 * len(with_admission)  # it still serves about its capacity
    assert attainment(admitted, w.slo) >= 0.9
    # without admission every request is served and most miss: the queue only grows (the
    # tier's hard TTFT limit, which is not admission, still drops the odd plan past it:
    # 38 of 1,500 measured)
    assert {o.reject_reason for o in without if o.rejected} <= {"exceeds_hard_ttft"}
    assert sum(1 for o in without if o.rejected) < 0.05 * len(without)
    assert attainment(without, w.slo) < 0.5
    assert attainment(with_admission, w.slo) > attainment(without, w.slo)


def test_tpot_admission_keeps_recompute_only_pools_within_tpot_past_capacity() -> None:
    """The mixed-KV cluster's fp8 decode pools are reachable only by recompute: every request
    sent there prefills on the decode worker and holds up its running batch. Past capacity,
    with only the TTFT admission, those pools kept taking recomputes until most of their
    sequences missed TPOT; the TPOT estimate sees the engines' reported prefill share and the
    TPOT admission refuses once no pool would keep the target, so more requests keep their
    SLO, of those admitted and of all."""
    with_tpot, w = _overloaded("mixed_kv", "bursts", 2.0, DEFAULT)
    ttft_only, _ = _overloaded("mixed_kv", "bursts", 2.0, NO_TPOT_ADMISSION)

    def recomputed_missing_tpot(outcomes: list[RequestOutcome]) -> float:
        local = [o for o in outcomes if o.mode == "recompute"]
        return sum(1 for o in local if o.tpot_ms > w.slo.tpot_ms) / max(1, len(local))

    assert any(o.reject_reason == "tpot_over_admission_limit" for o in with_tpot)
    assert not any(o.reject_reason == "tpot_over_admission_limit" for o in ttft_only)
    assert recomputed_missing_tpot(ttft_only) > 0.5
    # measured: 0.76 of the recomputed requests missed TPOT with the TTFT admission alone,
    # 0.37 with both
    assert recomputed_missing_tpot(with_tpot) < 0.6 * recomputed_missing_tpot(ttft_only)
    admitted = [o for o in with_tpot if not o.rejected]
    assert attainment(admitted, w.slo) > attainment([o for o in ttft_only if not o.rejected], w.slo)
    assert attainment(with_tpot, w.slo) > attainment(ttft_only, w.slo)
