"""The scheduling-quality suite: goodput of every policy on a matrix of clusters x workloads,
so that a policy is judged on fleets and traffic it was not tuned on (``bench/goodput.py
--suite``).

**Clusters** (``data/clusters/default.yaml`` and ``data/clusters/suite/*.yaml``; each file
says what it stresses): the default two-zone cluster; homogeneous (4 + 4 H100); strongly
heterogeneous GPUs (H100, H200, A100-40G, A10G, L4 serving both stages); mixed KV formats
(half the decode capacity reachable by recompute only); a slow shared cross-zone link with
most decode capacity across it; prefill-heavy and decode-heavy GPU mixes.

**Workloads**: the Azure conversation trace and the Mooncake long-context trace (their
first ``n`` requests), and the synthetic generators of :mod:`.workloads` (long prompts,
short prompts, bursts). Each runs in the tier whose targets suit it, and the SLO is that
tier's (the planner plans against the same targets the run is scored on): interactive
(TTFT 1,000 ms, TPOT 50 ms) for chat-sized prompts, standard (3,000 ms, 100 ms) for
long-context ones.

**Policies**: ours (the default profile) and the baselines least_loaded, seed, colocated,
round_robin and random. The ``colocated`` baseline redeploys the fleet (every GPU serves both
stages); the same choice is open to a hetero-pd operator, so ours runs on the deployment
that :mod:`.roles` advises from a held-out sample of the cell's workload (the pools as
declared, every pool both stages, colocated, or colocated placed by the ``colocated``
profile's weights, where ours *is* that baseline; ``ours_deployment`` in the JSON), and its
goodput on the fleet as declared is reported beside it (``ours_as_declared``). Per cell,
goodput (the highest rate with >= 90 % of requests meeting both SLOs,
:func:`~.goodput.search_goodput`) of each, and ``ours_vs_best_baseline`` = ours /
the best baseline's. Every search in a cell starts from half the cell's fluid bound, so the
policies are bracketed from the same point, and its points stop once they cannot keep 90 %
(``run_policy(early_stop=True)``: the same goodput in less time).

Figures: ``min_ours_vs_best_baseline`` over all cells (and
``min_ours_as_declared_vs_best_baseline``, the same for ours on the declared fleet) and
``geomean_ours_vs_least_loaded_heterogeneous`` over the cells of every cluster but the
homogeneous one. Past capacity: the attainment of ours and of least-loaded at 1.5x each
one's own goodput rate (``attainment_past_capacity``; of the admitted requests alone,
``admitted_attainment_past_capacity``), and the number of cells where ours falls further than
least-loaded (``cells_with_a_steeper_cliff_than_least_loaded``); with ``same_rate``, also
least-loaded at ours's point and ours at least-loaded's, the same offered load
(``cells_where_ours_keeps_less_than_least_loaded_at_the_same_rate``, at ours's point;
``..._at_either_point``).
Cells run in parallel processes (one per core by default); each is
deterministic (seeded), so the matrix does not depend on the process count.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpd_scheduler.policy import Profile
from hpd_sim.traces import Trace, load_trace, reshape

from .cluster import ClusterSpec, default_cluster_path, load_cluster
from .engine import SimConfig
from .goodput import fluid_bound
from .metrics import Slo, Summary
from .roles import DEPLOYMENTS, advise
from .runner import resolve_policy, run_point, run_policy
from .workloads import synthetic_trace

__all__ = [
    "BASELINES",
    "CLUSTERS",
    "HOMOGENEOUS",
    "POLICIES",
    "WORKLOADS",
    "WORKLOAD_NAMES",
    "Cell",
    "Workload",
    "cluster_path",
    "load_workload",
    "render_matrix",
    "run_cell",
    "run_suite",
    "summarise",
]

CLUSTERS = (
    "default",
    "homogeneous",
    "hetero_gpus",
    "mixed_kv",
    "slow_link",
    "prefill_heavy",
    "decode_heavy",
)
HOMOGENEOUS = frozenset({"homogeneous"})
BASELINES = ("least_loaded", "seed", "colocated", "round_robin", "random")
POLICIES = ("ours", *BASELINES)
CLIFF_POLICIES = ("ours", "least_loaded")
ADVICE_MIN_REQUESTS = 2000
"""The least a held-out sample for deployment advice holds (more when the cell's trace is
longer). The goodput of one policy on two disjoint 400-request samples of the same workload
(the suite's shortest cells) differed by up to 30 % (two Mooncake slices on the homogeneous
cluster, the colocated profile: 6.33 and 8.99 req/s), more than the margins between the
deployments the advice chooses from; at 2,000 requests the same pair was 7.97 and 9.19, and on
the decode-heavy cluster's long prompts the candidates came in the same order on two seeds
(colocated by weights 6.85 / 6.60, ours colocated 5.87 / 5.75, as declared 5.75 / 5.62
req/s). Larger samples cost simulation time in every cell of the suite; 2,000 kept the quick
suite within its time (bench/README.md)."""
OVERLOAD = 1.5
"""Past capacity: the attainment of ``CLIFF_POLICIES`` at ``OVERLOAD`` x their own goodput
rate, which says how steep each one's cliff is (at goodput both keep 90 %). Each point is
at its own rate: where least-loaded's goodput is a small share of ours, its point may be
below what the fleet can serve at all (its goodput is then held down by requests it
misroutes, not by load), so ``same_rate`` also measures each at the other's point."""


@dataclass(frozen=True, slots=True)
class Workload:
    """A suite workload: where its requests come from and the tier they run in."""

    name: str
    source: str  # a trace file under data/traces, or "synthetic:<generator>"
    tier: str
    slo: Slo


_INTERACTIVE = Slo(ttft_ms=1000.0, tpot_ms=50.0)
_STANDARD = Slo(ttft_ms=3000.0, tpot_ms=100.0)

WORKLOADS = (
    Workload("azure_conv", "azure_llm_2023_conv.csv", "interactive", _INTERACTIVE),
    Workload("mooncake", "mooncake_synthetic.jsonl", "standard", _STANDARD),
    Workload("long_prompts", "synthetic:long_prompts", "standard", _STANDARD),
    Workload("short_prompts", "synthetic:short_prompts", "interactive", _INTERACTIVE),
    Workload("bursts", "synthetic:bursts", "interactive", _INTERACTIVE),
)


WORKLOAD_NAMES = tuple(w.name for w in WORKLOADS)


def cluster_path(name: str) -> Path:
    """The YAML of a suite cluster by name."""
    default = default_cluster_path()
    return default if name == "default" else default.parent / "suite" / f"{name}.yaml"


def load_workload(w: Workload, n: int, holdout: bool = False, measured: int | None = None) -> Trace:
    """The first ``n`` requests of a workload (a synthetic one generated with seed 0).

    ``holdout``: up to ``n`` requests the cell is not measured on, for deployment advice
    (:mod:`.roles`): another seed of a synthetic generator, or of a trace the requests
    right after the ``measured`` first ones (default ``n``), arrivals rebased to 0, as many as
    the trace has left (19,366 Azure requests, 3,993 Mooncake ones; the full suite's longest
    cells take 8,000 and 784). The next stretch of a trace, not a later one: a trace's
    traffic drifts (with Mooncake's last 3,593 requests as the sample, two of its cells were
    advised another deployment and lost a quarter of their goodput; the 2,000 right after
    the measured slice advise what its last 400 did), and an operator advises from the
    traffic just seen."""
    if w.source.startswith("synthetic:"):
        return synthetic_trace(w.source.partition(":")[2], n=n, seed=1 if holdout else 0)
    traces = default_cluster_path().parent.parent / "traces"
    trace = load_trace(traces / w.source)
    if not holdout:
        return reshape(trace, max_requests=n)
    first = n if measured is None else measured
    nxt = trace.requests[first : first + n]
    t0 = nxt[0].arrival_s if nxt else 0.0
    moved = tuple(replace(r, arrival_s=r.arrival_s - t0) for r in nxt)
    return Trace(f"{trace.name}-holdout", moved)


@dataclass(slots=True)
class Cell:
    """One cluster x workload: goodput (req/s) per policy and the cell's fluid bound."""

    cluster: str
    workload: str
    requests: int
    fluid_bound_rps: float
    goodput_rps: dict[str, float]
    wall_s: float
    past_capacity: dict[str, float] = field(default_factory=dict)
    advice: dict[str, Any] = field(default_factory=dict)
    """Where ``ours`` ran: the deployment chosen on a held-out sample (:mod:`.roles`)."""
    admitted_past_capacity: dict[str, float] = field(default_factory=dict)
    """At the ``past_capacity`` points: the attainment of the admitted requests alone."""
    at_ours_overload: dict[str, float] = field(default_factory=dict)
    """With ``same_rate``: each cliff policy's attainment at ``OVERLOAD`` x ours's goodput
    rate (ours's own point; least-loaded at the same offered load)."""
    at_ll_overload: dict[str, float] = field(default_factory=dict)
    """With ``same_rate``: the same at ``OVERLOAD`` x least-loaded's goodput rate (its own
    point; ours at the same offered load)."""

    @property
    def best_baseline(self) -> str:
        return max(BASELINES, key=lambda p: self.goodput_rps.get(p, 0.0))

    def ratio(self, policy: str) -> float:
        """Ours over ``policy`` (inf when ``policy`` served nothing)."""
        return _ratio(self.goodput_rps.get("ours", 0.0), self.goodput_rps.get(policy, 0.0))

    def to_dict(self) -> dict[str, Any]:
        best = self.best_baseline
        return {
            "cluster": self.cluster,
            "workload": self.workload,
            "requests": self.requests,
            "fluid_bound_rps": self.fluid_bound_rps,
            "goodput_rps": self.goodput_rps,
            "best_baseline": best,
            "ours_vs_best_baseline": self.ratio(best),
            "ours_vs_least_loaded": self.ratio("least_loaded"),
            "attainment_past_capacity": self.past_capacity,
            "admitted_attainment_past_capacity": self.admitted_past_capacity,
            "attainment_at_ours_overload_rate": self.at_ours_overload or None,
            "attainment_at_least_loaded_overload_rate": self.at_ll_overload or None,
            "ours_deployment": self.advice,
            "ours_as_declared_vs_best_baseline": (
                _ratio(self.goodput_rps["ours_as_declared"], self.goodput_rps.get(best, 0.0))
                if "ours_as_declared" in self.goodput_rps
                else None
            ),
            "wall_s": self.wall_s,
        }

    def steeper_cliff(self) -> bool | None:
        """Ours keeps less attainment than least-loaded at ``OVERLOAD`` x each one's own
        goodput (None when either was not measured)."""
        return _ours_below(self.past_capacity)

    def less_at_the_same_rate(self) -> bool | None:
        """Ours keeps less attainment than least-loaded at ``OVERLOAD`` x ours's goodput rate
        (None when not measured: ``run_cell(same_rate=False)``)."""
        return _ours_below(self.at_ours_overload)

    def less_at_either_point(self) -> bool | None:
        """Ours keeps less than least-loaded at the same offered load at either one's
        ``OVERLOAD`` point (None when neither was measured)."""
        both = [_ours_below(self.at_ours_overload), _ours_below(self.at_ll_overload)]
        return None if both == [None, None] else any(both)


def _ours_below(attainment: dict[str, float]) -> bool | None:
    """Ours's figure below least-loaded's (None when either is missing)."""
    ours, ll = attainment.get("ours"), attainment.get("least_loaded")
    if ours is None or ll is None:
        return None
    return ours < ll


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return 1.0 if a <= 0 else math.inf


def _cell_size(
    cluster: str, workload: str, seconds: float, max_requests: int
) -> tuple[ClusterSpec, Workload, float, int]:
    """A cell's cluster, workload, fluid bound (req/s) and trace length (:func:`run_cell`)."""
    spec = load_cluster(cluster_path(cluster))
    w = next(x for x in WORKLOADS if x.name == workload)
    bound = fluid_bound(spec, load_workload(w, 2000).requests, w.slo.tpot_ms).rps
    return spec, w, bound, max(400, min(max_requests, round(bound * seconds)))


def run_cell(
    cluster: str,
    workload: str,
    seconds: float,
    max_requests: int,
    rel_tol: float,
    policies: Sequence[str] = POLICIES,
    declared: bool = False,
    same_rate: bool = False,
) -> Cell:
    """Goodput of each policy on one cell (module docstring). The cell's trace is as long
    as ``seconds`` of arrivals at the fluid bound's rate (at least 400 requests, at most
    ``max_requests``): a goodput measured on a trace that ends before the queues of an
    overloaded fleet have built up would be a transient, not a rate the fleet sustains.

    ``ours`` runs on the deployment :func:`.roles.advise` chooses from a held-out sample of
    the workload (at least as long as the measured trace, since a shorter one ends before
    queues build and flatters whichever deployment has the most batch slots, and at least
    :data:`ADVICE_MIN_REQUESTS`; :func:`load_workload` with ``holdout``). Its goodput on
    the fleet as declared, ``ours_as_declared``, is the same run when the advice keeps the
    declared split, and is searched too with ``declared`` (one more search: the quick suite
    leaves it out to stay within its time). ``same_rate``: least-loaded is also run at
    ``OVERLOAD`` x ours's goodput rate and ours at ``OVERLOAD`` x least-loaded's
    (``Cell.at_ours_overload``, ``Cell.at_ll_overload``; two more points, left out of the
    timed quick suite)."""
    t0 = time.perf_counter()
    spec, w, bound, n = _cell_size(cluster, workload, seconds, max_requests)
    trace = load_workload(w, n)
    config = SimConfig(seed=0, tiers=((w.tier, 1.0),))

    def start_of(t: Trace) -> float:
        return max(0.5 * bound / t.mean_rate, 1.0 / 64) if t.mean_rate > 0 else 1.0

    start = start_of(trace)
    goodput: dict[str, float] = {}
    past: dict[str, float] = {}
    admitted: dict[str, float] = {}
    cliff: dict[str, tuple[float, ClusterSpec, Profile]] = {}  # goodput scale, where it ran
    advice: dict[str, Any] = {}
    for policy in policies:
        profile, fleet = resolve_policy(policy), spec
        if policy == "ours":
            held = load_workload(w, max(n, ADVICE_MIN_REQUESTS), holdout=True, measured=n)
            chosen = advise(spec, profile, held, w.slo, config, start_of(held), rel_tol)
            advice = chosen.to_dict()
            if declared and chosen.chosen.name != DEPLOYMENTS[0].name:
                as_declared = run_policy(
                    spec, profile, trace, w.slo, config, search=True, start=start,
                    rel_tol=rel_tol, early_stop=True,
                )  # fmt: skip
                goodput["ours_as_declared"] = as_declared.goodput_rps or 0.0
            profile, fleet = chosen.chosen.profile(profile), chosen.chosen.cluster(spec)
        run = run_policy(
            fleet, profile, trace, w.slo, config, search=True, start=start, rel_tol=rel_tol,
            early_stop=True,
        )  # fmt: skip
        goodput[policy] = run.goodput_rps or 0.0
        if policy == "ours" and advice["deployment"] == DEPLOYMENTS[0].name:
            goodput["ours_as_declared"] = goodput[policy]
        if policy in CLIFF_POLICIES and run.goodput_scale:
            at = run_point(fleet, profile, trace, OVERLOAD * run.goodput_scale, w.slo, config)
            past[policy] = at.attainment
            admitted[policy] = _admitted_attainment(at)
            cliff[policy] = (run.goodput_scale, fleet, profile)
    same, at_ll = (
        _at_each_others_point(cliff, past, trace, w.slo, config) if same_rate else ({}, {})
    )
    return Cell(
        cluster, workload, len(trace), bound, goodput, time.perf_counter() - t0, past, advice,
        admitted, same, at_ll,
    )  # fmt: skip


def _at_each_others_point(
    cliff: dict[str, tuple[float, ClusterSpec, Profile]],
    past: dict[str, float],
    trace: Trace,
    slo: Slo,
    config: SimConfig,
) -> tuple[dict[str, float], dict[str, float]]:
    """Each cliff policy at the other's point past capacity, the same offered load: (at
    ours's point, at least-loaded's), both policies' attainment in each (both empty unless
    both points were found)."""
    if "ours" not in cliff or "least_loaded" not in cliff:
        return {}, {}
    (o_scale, o_fleet, o_prof), (l_scale, l_fleet, l_prof) = cliff["ours"], cliff["least_loaded"]
    ll_there = run_point(l_fleet, l_prof, trace, OVERLOAD * o_scale, slo, config).attainment
    ours_there = run_point(o_fleet, o_prof, trace, OVERLOAD * l_scale, slo, config).attainment
    return (
        {"ours": past["ours"], "least_loaded": ll_there},
        {"ours": ours_there, "least_loaded": past["least_loaded"]},
    )


def _admitted_attainment(at: Summary) -> float:
    """The share of the admitted requests (refused ones left out) that kept their SLOs."""
    admitted = at.requests - at.rejected
    return at.attainment * at.requests / admitted if admitted > 0 else 0.0


def run_suite(
    clusters: Sequence[str] = CLUSTERS,
    workloads: Sequence[str] = WORKLOAD_NAMES,
    seconds: float = 120.0,
    max_requests: int = 8000,
    rel_tol: float = 0.04,
    processes: int | None = None,
    policies: Sequence[str] = POLICIES,
    progress: Callable[[int, int, Cell], None] | None = None,
    declared: bool = False,
    same_rate: bool = False,
) -> list[Cell]:
    """Every cell of ``clusters`` x ``workloads``, in ``processes`` processes (default: one
    per core), the longest traces first so that no process is left with a long cell at the
    end; cells come back in matrix order."""
    jobs = [(c, w) for c in clusters for w in workloads]
    procs = max(1, min(processes or os.cpu_count() or 1, len(jobs)))
    done: dict[tuple[str, str], Cell] = {}
    args = (seconds, max_requests, rel_tol, policies, declared, same_rate)
    if procs == 1:
        for c, w in jobs:
            done[(c, w)] = cell = run_cell(c, w, *args)
            if progress:
                progress(len(done), len(jobs), cell)
    else:
        size = {j: _cell_size(*j, seconds, max_requests)[3] for j in jobs}
        with ProcessPoolExecutor(max_workers=procs) as pool:
            futures = [
                pool.submit(run_cell, c, w, *args) for c, w in sorted(jobs, key=lambda j: -size[j])
            ]
            for fut in as_completed(futures):
                cell = fut.result()
                done[(cell.cluster, cell.workload)] = cell
                if progress:
                    progress(len(done), len(jobs), cell)
    return [done[j] for j in jobs]


def summarise(cells: Sequence[Cell]) -> dict[str, Any]:
    """The suite's figures: the per-cell minimum of ours over the best baseline, and the
    geometric mean of ours over least-loaded across the heterogeneous clusters' cells."""
    mins = [c.ratio(c.best_baseline) for c in cells]
    declared = [c.to_dict()["ours_as_declared_vs_best_baseline"] for c in cells]
    chosen = [c.advice.get("deployment") for c in cells if c.advice]
    het = [c.ratio("least_loaded") for c in cells if c.cluster not in HOMOGENEOUS]
    het = [r for r in het if math.isfinite(r) and r > 0]
    worst = min(cells, key=lambda c: c.ratio(c.best_baseline)) if cells else None
    cliffs = [c.steeper_cliff() for c in cells]
    kept = sorted(
        c.admitted_past_capacity["ours"] for c in cells if "ours" in c.admitted_past_capacity
    )
    return {
        "cells_with_a_steeper_cliff_than_least_loaded": sum(1 for x in cliffs if x),
        "cells_with_cliff_measured": sum(1 for x in cliffs if x is not None),
        # at ours's own point past capacity, and at either's (run_cell(same_rate=True) only)
        "cells_where_ours_keeps_less_than_least_loaded_at_the_same_rate": _count_measured(
            [c.less_at_the_same_rate() for c in cells]
        ),
        "cells_where_ours_keeps_less_than_least_loaded_at_either_point": _count_measured(
            [c.less_at_either_point() for c in cells]
        ),
        "median_ours_admitted_attainment_past_capacity": (kept[len(kept) // 2] if kept else None),
        "min_ours_vs_best_baseline": min(mins) if mins else None,
        "min_cell": f"{worst.cluster}/{worst.workload}" if worst else None,
        "cells_below_best_baseline": sum(1 for r in mins if r < 1.0),
        # over every cell or none: a minimum over the cells that kept the declared split
        # would leave out the very cells where it was worse
        "min_ours_as_declared_vs_best_baseline": (
            min(declared) if declared and None not in declared else None
        ),
        "ours_deployments_chosen": {d: chosen.count(d) for d in dict.fromkeys(chosen) if d},
        "geomean_ours_vs_least_loaded_heterogeneous": (
            math.exp(sum(math.log(r) for r in het) / len(het)) if het else None
        ),
        "geomean_ours_vs_best_baseline": (
            math.exp(sum(math.log(r) for r in mins if 0 < r < math.inf) / len(mins))
            if mins
            else None
        ),
    }


def _count_measured(flags: Sequence[bool | None]) -> int | None:
    """How many are true, or None when none was measured."""
    return sum(1 for x in flags if x) if any(x is not None for x in flags) else None


def render_matrix(cells: Sequence[Cell]) -> str:
    """A text table: one row per cell, goodput per policy and ours / best baseline."""
    cols = (*POLICIES, "ours_as_declared")
    head = f"{'cluster':<14} {'workload':<14}" + "".join(f"{p[:16]:>17}" for p in cols)
    lines = [head + f"{'ours/best':>11}  {'best':<13} ours ran", "-" * (len(head) + 40)]
    for c in cells:
        row = f"{c.cluster:<14} {c.workload:<14}"
        row += "".join(
            f"{c.goodput_rps[p]:17.2f}" if p in c.goodput_rps else f"{'-':>17}" for p in cols
        )
        best = c.best_baseline
        where = c.advice.get("deployment", "as_declared")
        lines.append(row + f"{c.ratio(best):11.2f}  {best:<13} {where}")
    return "\n".join(lines)


def plot_heatmap(cells: Sequence[Cell], path: Path) -> bool:
    """Ours / best baseline per cell as a heat map (green >= 1, red < 1); False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import TwoSlopeNorm
    except ImportError:
        return False
    clusters = list(dict.fromkeys(c.cluster for c in cells))
    workloads = list(dict.fromkeys(c.workload for c in cells))
    grid = [[math.nan] * len(workloads) for _ in clusters]
    for c in cells:
        grid[clusters.index(c.cluster)][workloads.index(c.workload)] = c.ratio(c.best_baseline)
    fig, ax = plt.subplots(figsize=(1.5 * len(workloads) + 3.0, 0.55 * len(clusters) + 1.8))
    finite = [v for row in grid for v in row if math.isfinite(v)]
    lo, hi = min([*finite, 0.9]), max([*finite, 1.1])
    norm = TwoSlopeNorm(vcenter=1.0, vmin=lo, vmax=hi)
    im = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
    ax.set_xticks(range(len(workloads)), workloads, rotation=30, ha="right")
    ax.set_yticks(range(len(clusters)), clusters)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title("Goodput: ours / best baseline (>= 1: ours is at least as good)")
    fig.colorbar(im, ax=ax, label="ours / best baseline (goodput ratio)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
