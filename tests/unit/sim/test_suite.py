"""The scheduling-quality suite: its workloads are what their docstring says, its clusters
load, and a cell's figures are computed from the policies' goodputs."""

from __future__ import annotations

import math
import statistics

import pytest

from hpd_sim import load_cluster
from hpd_sim.suite import (
    CLUSTERS,
    WORKLOADS,
    Cell,
    cluster_path,
    load_workload,
    render_matrix,
    run_cell,
    summarise,
)
from hpd_sim.workloads import SYNTHETIC, synthetic_trace


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_a_synthetic_workload_is_seeded_and_runs_at_one_request_a_second(name: str) -> None:
    a = synthetic_trace(name, n=3000, seed=1)
    assert a == synthetic_trace(name, n=3000, seed=1)
    assert a != synthetic_trace(name, n=3000, seed=2)
    assert len(a) == 3000 and a.requests[0].arrival_s == 0.0
    assert a.mean_rate == pytest.approx(1.0, rel=0.1)
    spec = SYNTHETIC[name]
    prompts = [r.prompt_tokens for r in a.requests]
    outputs = [r.output_tokens for r in a.requests]
    assert spec.prompt.lo <= min(prompts) and max(prompts) <= spec.prompt.hi
    assert spec.output.lo <= min(outputs) and max(outputs) <= spec.output.hi
    assert statistics.median(prompts) == pytest.approx(spec.prompt.median, rel=0.1)
    assert statistics.median(outputs) == pytest.approx(spec.output.median, rel=0.1)


def test_bursts_come_in_bursts() -> None:
    """Arrivals per 10 s window: the on windows hold about 3x the mean, the off ones none."""
    t = synthetic_trace("bursts", n=3000)
    counts = [0] * (int(t.requests[-1].arrival_s // 10) + 1)
    for r in t.requests:
        counts[int(r.arrival_s // 10)] += 1
    assert counts.count(0) >= len(counts) // 2
    busy = [c for c in counts if c]
    assert statistics.mean(busy) == pytest.approx(30, rel=0.2)


def test_an_unknown_workload_is_named() -> None:
    with pytest.raises(ValueError, match="long_prompts"):
        synthetic_trace("nope")


@pytest.mark.parametrize("name", CLUSTERS)
def test_every_suite_cluster_loads(name: str) -> None:
    c = load_cluster(cluster_path(name))
    assert c.name == name and c.gpus >= 7


@pytest.mark.parametrize("w", WORKLOADS, ids=lambda w: w.name)
def test_every_suite_workload_loads(w: object) -> None:
    t = load_workload(w, 50)  # type: ignore[arg-type]
    assert len(t) == 50


def _cell(cluster: str, **goodput: float) -> Cell:
    return Cell(cluster, "w", 100, 10.0, dict(goodput), 0.0)


def test_a_cell_compares_ours_with_its_best_baseline() -> None:
    c = _cell("mixed_kv", ours=9.0, least_loaded=6.0, seed=3.0, colocated=10.0, round_robin=0.0)
    assert c.best_baseline == "colocated"
    assert c.to_dict()["ours_vs_best_baseline"] == pytest.approx(0.9)
    assert c.ratio("least_loaded") == pytest.approx(1.5)
    assert math.isinf(c.ratio("round_robin"))


def test_the_summary_takes_the_worst_cell_and_leaves_the_homogeneous_cluster_out() -> None:
    cells = [
        _cell("homogeneous", ours=1.0, least_loaded=4.0),
        _cell("mixed_kv", ours=4.0, least_loaded=1.0),
        _cell("slow_link", ours=2.0, least_loaded=2.0),
    ]
    s = summarise(cells)
    assert s["min_ours_vs_best_baseline"] == pytest.approx(0.25)
    assert s["min_cell"] == "homogeneous/w"
    assert s["cells_below_best_baseline"] == 1
    assert s["geomean_ours_vs_least_loaded_heterogeneous"] == pytest.approx(2.0)


def test_a_cell_runs_every_policy_it_is_given() -> None:
    cell = run_cell(
        "mixed_kv", "long_prompts", 40.0, 400, 0.25, ("ours", "least_loaded"), declared=True,
        same_rate=True,
    )  # fmt: skip
    assert cell.requests == 400
    assert set(cell.goodput_rps) == {"ours", "ours_as_declared", "least_loaded"}
    assert all(v > 0 for v in cell.goodput_rps.values())
    # ours ran where the advice on a held-out sample said, and no worse there than it was
    # on that sample's other candidates
    advice = cell.advice
    assert advice["deployment"] in advice["sample_goodput_rps"]
    best = max(g for g in advice["sample_goodput_rps"].values() if g is not None)
    assert advice["sample_goodput_rps"][advice["deployment"]] == best
    if advice["deployment"] == "as_declared":
        assert cell.goodput_rps["ours"] == cell.goodput_rps["ours_as_declared"]
    # past capacity both were measured, and both fell below the 90 % they kept at goodput
    assert set(cell.past_capacity) == {"ours", "least_loaded"}
    assert all(0.0 <= v < 0.9 for v in cell.past_capacity.values())
    assert cell.steeper_cliff() is not None
    # the admitted requests' share is at least all requests' (refused ones only leave it)
    assert set(cell.admitted_past_capacity) == {"ours", "least_loaded"}
    for p, at in cell.past_capacity.items():
        assert at <= cell.admitted_past_capacity[p] <= 1.0
    # at the same rate ours's figure is its own point's, and least-loaded's was measured there
    assert cell.at_ours_overload["ours"] == cell.past_capacity["ours"]
    assert 0.0 <= cell.at_ours_overload["least_loaded"] <= 1.0
    assert cell.less_at_the_same_rate() is not None
    # and ours was measured at least-loaded's own point, least-loaded's figure its own there
    assert cell.at_ll_overload["least_loaded"] == cell.past_capacity["least_loaded"]
    assert 0.0 <= cell.at_ll_overload["ours"] <= 1.0
    assert cell.less_at_either_point() is not None
    assert cell.to_dict()["attainment_at_least_loaded_overload_rate"] == cell.at_ll_overload


def test_ours_on_the_declared_fleet_is_summarised_over_every_cell_or_not_at_all() -> None:
    kept = _cell("default", ours=2.0, ours_as_declared=2.0, least_loaded=1.0)
    changed = _cell("homogeneous", ours=4.0, ours_as_declared=1.0, least_loaded=2.0)
    assert summarise([kept, changed])["min_ours_as_declared_vs_best_baseline"] == 0.5
    unmeasured = _cell("homogeneous", ours=4.0, least_loaded=2.0)
    assert unmeasured.to_dict()["ours_as_declared_vs_best_baseline"] is None
    assert summarise([kept, unmeasured])["min_ours_as_declared_vs_best_baseline"] is None
    row = render_matrix([unmeasured]).splitlines()[-1].split()
    assert row[2:4] == ["4.00", "2.00"] and row[8] == "-"  # ours, least-loaded, as declared


def test_a_cliff_is_steeper_when_ours_keeps_less_past_capacity() -> None:
    c = _cell("default", ours=2.0, least_loaded=1.0)
    assert c.steeper_cliff() is None
    c.past_capacity = {"ours": 0.5, "least_loaded": 0.6}
    assert c.steeper_cliff() is True
    assert summarise([c])["cells_with_a_steeper_cliff_than_least_loaded"] == 1


def test_the_same_rate_comparison_is_counted_only_where_it_was_measured() -> None:
    c = _cell("default", ours=2.0, least_loaded=1.0)
    c.past_capacity = {"ours": 0.6, "least_loaded": 0.8}  # steeper at each one's own point
    c.admitted_past_capacity = {"ours": 0.95, "least_loaded": 0.8}
    s = summarise([c])
    assert s["cells_where_ours_keeps_less_than_least_loaded_at_the_same_rate"] is None
    assert c.to_dict()["attainment_at_ours_overload_rate"] is None
    assert s["median_ours_admitted_attainment_past_capacity"] == 0.95
    c.at_ours_overload = {"ours": 0.6, "least_loaded": 0.3}  # least-loaded at ours's rate
    assert c.less_at_the_same_rate() is False
    other = _cell("mixed_kv", ours=2.0, least_loaded=1.0)
    other.at_ours_overload = {"ours": 0.5, "least_loaded": 0.7}
    s = summarise([c, other])
    assert s["cells_with_a_steeper_cliff_than_least_loaded"] == 1
    assert s["cells_where_ours_keeps_less_than_least_loaded_at_the_same_rate"] == 1
    assert s["cells_where_ours_keeps_less_than_least_loaded_at_either_point"] == 1


def test_either_point_counts_a_cell_where_ours_keeps_less_at_least_loadeds_point() -> None:
    """Ahead at ours's point but behind at least-loaded's: the cell counts at either point,
    not at the same rate; a cell measured at neither counts at neither."""
    c = _cell("default", ours=2.0, least_loaded=1.0)
    assert c.less_at_either_point() is None
    c.at_ours_overload = {"ours": 0.6, "least_loaded": 0.3}
    assert c.less_at_either_point() is False
    c.at_ll_overload = {"ours": 0.7, "least_loaded": 0.8}
    assert c.less_at_the_same_rate() is False
    assert c.less_at_either_point() is True
    s = summarise([c, _cell("mixed_kv", ours=2.0, least_loaded=1.0)])
    assert s["cells_where_ours_keeps_less_than_least_loaded_at_the_same_rate"] == 0
    assert s["cells_where_ours_keeps_less_than_least_loaded_at_either_point"] == 1
    assert (
        summarise([_cell("default", ours=1.0, least_loaded=1.0)])[
            "cells_where_ours_keeps_less_than_least_loaded_at_either_point"
        ]
        is None
    )
