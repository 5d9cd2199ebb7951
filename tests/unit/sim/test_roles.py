"""Deployment advice (hpd_sim.roles): the candidates are what they say, the advice follows
the simulated goodput on its sample, a tie keeps the deployment as declared, and the suite
draws that sample from traffic it does not measure on."""

from __future__ import annotations

import pytest

from hpd_scheduler.policy import Stage
from hpd_sim import load_cluster
from hpd_sim.cluster import ClusterSpec
from hpd_sim.engine import SimConfig
from hpd_sim.goodput import fluid_bound
from hpd_sim.roles import DEPLOYMENTS, Deployment, advise, deployment
from hpd_sim.runner import resolve_policy, run_policy
from hpd_sim.suite import ADVICE_MIN_REQUESTS, WORKLOADS, Workload, cluster_path, load_workload
from hpd_sim.traces import Trace, load_trace
from hpd_sim.workloads import synthetic_trace

TRACES = cluster_path("default").parent.parent / "traces"

LONG = next(w for w in WORKLOADS if w.name == "long_prompts")
AZURE = next(w for w in WORKLOADS if w.name == "azure_conv")


def test_each_candidate_runs_the_fleet_as_it_says() -> None:
    spec = load_cluster(cluster_path("prefill_heavy"))
    base = resolve_policy("ours")
    declared, both, colocated = (deployment(n) for n in ("as_declared", "both_stages", "colocated"))
    assert declared.cluster(spec) is spec and declared.profile(base) is base
    assert {p.stage for p in spec.pools} == {Stage.PREFILL, Stage.DECODE}
    for d in (both, colocated):
        assert all(p.stage is Stage.BOTH for p in d.cluster(spec).pools)
        assert [p.gpus for p in d.cluster(spec).pools] == [p.gpus for p in spec.pools]
    assert both.profile(base).pairing == "joint"
    assert colocated.profile(base).pairing == "colocated"
    assert colocated.profile(base).slo_objective == base.slo_objective
    # the same deployment routed by the weighted factors alone (the built-in profile)
    weights = deployment("colocated_weights")
    assert weights.cluster(spec).pools == colocated.cluster(spec).pools
    by_weights, builtin = weights.profile(base), resolve_policy("colocated")
    assert by_weights.name == builtin.name == "colocated" and by_weights.pairing == "colocated"
    assert by_weights.slo_objective is None
    assert by_weights.prefill.weights() == builtin.prefill.weights()
    assert by_weights.decode.weights() == builtin.decode.weights()
    with pytest.raises(ValueError, match="both_stages"):
        deployment("nope")


def _sample(cluster: str, w: Workload, seconds: float) -> tuple[ClusterSpec, Trace, float]:
    """A held-out sample as the suite draws it: ``seconds`` of arrivals at the cell's fluid
    bound (a shorter one ends before queues build, and every deployment looks unbounded),
    and the search's start at half the bound."""
    spec = load_cluster(cluster_path(cluster))
    bound = fluid_bound(spec, load_workload(w, 2000).requests, w.slo.tpot_ms).rps
    sample = load_workload(w, max(400, round(bound * seconds)), holdout=True)
    return spec, sample, 0.5 * bound / sample.mean_rate


def _config(w: Workload) -> SimConfig:
    return SimConfig(seed=0, tiers=((w.tier, 1.0),))


def _advice(cluster: str, w: Workload, seconds: float) -> tuple[str, dict[str, float | None]]:
    spec, sample, start = _sample(cluster, w, seconds)
    a = advise(spec, resolve_policy("ours"), sample, w.slo, _config(w), start, rel_tol=0.25)
    assert set(a.goodput_rps) == {d.name for d in DEPLOYMENTS}
    measured = {k: v for k, v in a.goodput_rps.items() if v is not None}
    assert a.goodput_rps[a.chosen.name] == max(measured.values())
    # a candidate left after one simulation failed above the goodput that was chosen
    for name, rps in a.failed_at_rps.items():
        assert a.goodput_rps[name] is None and rps > max(measured.values())
    return a.chosen.name, a.goodput_rps


def test_long_prompts_across_a_slow_link_are_advised_off_the_declared_split() -> None:
    """slow_link: the three prefill GPUs sit across a 10 Gb/s pipe from four of the five
    decode GPUs, so long prompts' KV queues on the pipe; serving both stages on every GPU
    keeps most prompts where they are decoded."""
    chosen, goodput = _advice("slow_link", LONG, 20.0)
    assert chosen != "as_declared"
    assert (goodput[chosen] or 0.0) > 1.2 * (goodput["as_declared"] or 0.0)


def test_chat_traffic_on_the_default_fleet_keeps_the_declared_split() -> None:
    """Chat prompts on the default cluster: prefill-only GPUs keep prefills off the decode
    batches, which is worth more than the extra decode GPUs."""
    chosen, goodput = _advice("default", AZURE, 20.0)
    assert chosen == "as_declared"
    assert goodput["both_stages"] is None


@pytest.mark.parametrize("cluster", ["prefill_heavy", "hetero_gpus"])
def test_the_advice_is_what_a_search_of_every_candidate_would_choose(cluster: str) -> None:
    spec, sample, start = _sample(cluster, LONG, 20.0)
    ours = resolve_policy("ours")
    a = advise(spec, ours, sample, LONG.slo, _config(LONG), start, rel_tol=0.1)
    full = {
        d.name: run_policy(
            d.cluster(spec), d.profile(ours), sample, LONG.slo, _config(LONG), search=True,
            start=start, rel_tol=0.1,
        ).goodput_rps or 0.0
        for d in DEPLOYMENTS
    }  # fmt: skip
    assert full[a.chosen.name] == max(full.values())
    assert a.goodput_rps[a.chosen.name] == pytest.approx(full[a.chosen.name], rel=0.1)


def test_a_tie_keeps_the_first_candidate() -> None:
    spec, sample, start = _sample("homogeneous", LONG, 10.0)
    twin = Deployment("twin", "the declared split again", every_pool_both=False, colocated=False)
    ours = resolve_policy("ours")
    a = advise(
        spec, ours, sample, LONG.slo, _config(LONG), start, rel_tol=0.25,
        candidates=(DEPLOYMENTS[0], twin),
    )  # fmt: skip
    assert a.chosen is DEPLOYMENTS[0]
    declared = a.goodput_rps["as_declared"] or 0.0
    assert declared > 0 and a.goodput_rps["twin"] is None
    assert a.failed_at_rps["twin"] == pytest.approx(1.25 * declared)
    with pytest.raises(ValueError, match="at least one"):
        advise(spec, ours, sample, LONG.slo, _config(LONG), candidates=())


@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.name)
def test_the_held_out_sample_is_not_the_measured_traffic(w: Workload) -> None:
    measured = load_workload(w, 400)
    held = load_workload(w, 400, holdout=True)
    assert len(held) == 400 and held.requests[0].arrival_s == 0.0 and held.mean_rate > 0
    assert [r.arrival_s for r in held.requests] == sorted(r.arrival_s for r in held.requests)
    if w.source.startswith("synthetic:"):  # another seed of the same generator
        assert held == synthetic_trace(w.source.partition(":")[2], n=400, seed=1)
        assert held.requests != measured.requests
        return
    # a trace's next 400 requests, right after the measured slice
    whole = load_trace(TRACES / w.source).requests
    assert len(whole) >= 800
    nxt = whole[400:800]
    assert [(r.prompt_tokens, r.output_tokens, r.hash_ids) for r in held.requests] == [
        (r.prompt_tokens, r.output_tokens, r.hash_ids) for r in nxt
    ]
    assert held.requests[-1].arrival_s == pytest.approx(nxt[-1].arrival_s - nxt[0].arrival_s)


@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.name)
def test_a_held_out_sample_longer_than_the_measured_slice_follows_it_to_the_trace_end(
    w: Workload,
) -> None:
    measured, n = 400, 10 * ADVICE_MIN_REQUESTS
    held = load_workload(w, n, holdout=True, measured=measured)
    if w.source.startswith("synthetic:"):  # a generator has no end
        assert len(held) == n
        return
    whole = load_trace(TRACES / w.source).requests
    assert len(held) == min(n, len(whole) - measured)
    assert [r.prompt_tokens for r in held.requests] == [
        r.prompt_tokens for r in whole[measured : measured + len(held)]
    ]
