"""The fleet as an integer program (Mélange's formulation, with the prefill/decode split),
solved by HiGHS through ``highspy``.

Indices: buckets ``i`` (``hpd_plan.traffic``: a tier's requests in a prompt x output length
range, arrival rate ``lam_i``), groups ``j`` (``hpd_plan.capacity``: a GPU kind, worker size
and role: prefill, decode, or both at a prefill share ``rho_j``), kinds ``k``, tiers ``t``.
``(i, j)`` pairs exist where the group can serve the bucket; ``P_ij``, ``D_ij`` are the
worker-seconds of prefill and decode per request, ``m_ij`` the share of requests that miss
their SLO there whatever the size (``capacity.Cost``), ``h_r`` the headroom of role ``r``.

Variables: ``n_j`` integer workers of group j (``0 <= n_j <= U_j``); ``x_ij`` in [0, 1],
the share of bucket i's prefill (j a prefill group), decode (a decode group) or both (a
both-stage group) that group j serves.

Constraints:

* cover: for each bucket, ``sum_{j prefill or both} x_ij = 1`` and
  ``sum_{j decode or both} x_ij = 1`` (every request prefilled once and decoded once);
* capacity: ``sum_i lam_i P_ij x_ij <= h_prefill n_j`` (prefill groups),
  ``sum_i lam_i D_ij x_ij <= h_decode n_j`` (decode groups), and for both-stage groups
  ``sum_i lam_i P_ij x_ij <= h_both rho_j n_j`` and
  ``sum_i lam_i D_ij x_ij <= h_both (1 - rho_j) n_j``;
* availability: ``sum_{j of kind k} tp_j n_j <= available_k`` GPUs;
* misses: per tier t, ``sum_{i of t} share_i sum_j m_ij x_ij <= budget`` (a disaggregated
  request's prefill and decode misses add: a union bound).

Objective: minimise ``sum_j price_j n_j`` (USD per hour; ``price_j`` = price per GPU-hour x
``tp_j``), plus ``1e-6`` per worker so that of two fleets at the same price the one with
fewer workers wins.

**Next-best fleets**: a fleet is its count per pool (kind, tp, role), operating points
merged. Each found fleet ``N*`` is cut off with its supersets: binaries ``y_p`` for the
pools it uses, ``N_p + U_p y_p <= N*_p - 1 + U_p`` and ``sum_p y_p >= 1``, so the next
solve must use fewer workers of some pool than ``N*`` did, a different mix rather than the
same fleet plus a worker (more capacity is what the planner's headroom rounds add).

**Most traffic a catalogue carries** (when the program is infeasible): the cover rows'
right-hand side becomes a variable ``alpha`` in [0, 1] (the miss budget scales with it),
maximised, then the cheapest fleet at that ``alpha``.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .capacity import Cost, Group, Headroom
from .traffic import Bucket

__all__ = [
    "Candidate",
    "Model",
    "Problem",
    "SolverMissing",
    "best_candidates",
    "max_alpha",
    "solve",
]

Pool = tuple[str, int, str]
T = TypeVar("T")

INSTALL_HINT = "pip install 'hetero-pd[planner]'  (or: pip install highspy)"
WORKER_TIE_BREAK = 1e-6
SOLVE_SECONDS = 60.0


class SolverMissing(RuntimeError):
    """highspy is not installed (the ``planner`` extra)."""

    def __init__(self) -> None:
        super().__init__(f"the planner's solver, HiGHS (highspy), is not installed: {INSTALL_HINT}")


@dataclass(slots=True)
class Model:
    """A mixed-integer linear program: columns (cost, bounds, integrality) and rows
    (``lo <= sum coef x <= hi``), minimised (``maximize``: maximised)."""

    cost: list[float] = field(default_factory=list)
    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[tuple[float, float, dict[int, float]]] = field(default_factory=list)
    maximize: bool = False

    def var(self, lb: float, ub: float, cost: float = 0.0, integer: bool = False) -> int:
        """Add a column; its index."""
        self.cost.append(cost)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, coefs: Mapping[int, float], lo: float, hi: float) -> None:
        """Add ``lo <= sum coefs[c] x_c <= hi``."""
        self.rows.append((lo, hi, {c: v for c, v in coefs.items() if v != 0.0}))


def solve(model: Model, seconds: float = SOLVE_SECONDS) -> list[float] | None:
    """Solve with HiGHS (one thread, quiet); the column values, or None when infeasible.
    Raises :class:`SolverMissing` without highspy, RuntimeError on a solver failure."""
    try:
        import highspy
        import numpy as np
    except ImportError:
        raise SolverMissing() from None
    if not model.cost:
        return []  # nothing to decide (HiGHS calls an empty model a status of its own)
    h = _quiet(highspy.Highs)
    # no restart after the root: on these programs (with best_candidates' cuts above all) a
    # restart re-ran presolve and the root's cuts for no better bound (measured on an
    # 11-kind catalogue after one cut: 1.5 s -> 0.6 s, the same optimum)
    options = {
        "output_flag": False,
        "threads": 1,
        "time_limit": seconds,
        "mip_allow_restart": False,
    }
    for name, value in options.items():
        h.setOptionValue(name, value)
    n = len(model.cost)
    inf = highspy.kHighsInf
    h.addVars(n, np.array(model.lb, dtype=np.float64), np.array(model.ub, dtype=np.float64))
    h.changeColsCost(n, np.arange(n, dtype=np.int32), np.array(model.cost, dtype=np.float64))
    ints = [c for c in range(n) if model.integer[c]]
    if ints:
        kinds = np.full(len(ints), highspy.HighsVarType.kInteger.value, dtype=np.uint8)
        h.changeColsIntegrality(len(ints), np.array(ints, dtype=np.int32), kinds)
    for lo, hi, coefs in model.rows:
        idx = np.array(list(coefs), dtype=np.int32)
        val = np.array(list(coefs.values()), dtype=np.float64)
        h.addRow(-inf if lo == -math.inf else lo, inf if hi == math.inf else hi, len(idx), idx, val)
    if model.maximize:
        h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    h.run()
    status = h.getModelStatus()
    statuses = highspy.HighsModelStatus
    if status in (statuses.kInfeasible, statuses.kUnboundedOrInfeasible):
        return None  # (nothing here is unbounded: every column has finite bounds)
    solution = h.getSolution()
    if status != statuses.kOptimal and not solution.value_valid:
        raise RuntimeError(f"HiGHS: {h.modelStatusToString(status)}, no solution")
    return list(solution.col_value)  # optimal, or the best found in the time limit


def _quiet(make: Callable[[], T]) -> T:
    """``make()`` with the process's standard output closed for its duration: HiGHS prints
    its banner from C++ when a solver is made, before any option can silence it, and
    `hpd plan --json` promises one JSON object on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        return make()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


@dataclass(frozen=True, slots=True)
class Problem:
    """One sizing problem: the buckets, the groups, their costs ``{(i, j): Cost}``, the
    headroom, the per-tier miss budget (share of a tier's requests) and the GPUs each kind
    may use (None: no limit)."""

    buckets: Sequence[Bucket]
    groups: Sequence[Group]
    costs: Mapping[tuple[int, int], Cost]
    headroom: Headroom
    miss_budget: float
    available: Mapping[str, int | None]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A fleet the program found: workers per group and per pool, its price, the load
    shares ``x_ij`` and the traffic share it carries (``alpha``, 1 unless maximised)."""

    counts: tuple[int, ...]
    pools: Mapping[Pool, int]
    price_per_hour: float
    shares: Mapping[tuple[int, int], float]
    alpha: float = 1.0
    alone: str = ""
    """The kind when found by the program on that kind alone (``planner``), else ''."""


def _loads(p: Problem, i: int, j: int) -> tuple[float, float]:
    """(prefill, decode) worker-seconds per second bucket i puts on group j at x_ij = 1."""
    c = p.costs[(i, j)]
    lam = p.buckets[i].rate_rps
    return lam * c.prefill_s, lam * c.decode_s


def _bound(p: Problem, j: int) -> int:
    """``U_j``: GPUs available / tp, or the workers group j needs to carry every bucket
    it can serve alone (a minimal fleet never needs more)."""
    g = p.groups[j]
    avail = p.available.get(g.kind.name)
    if avail is not None:
        return avail // g.tp
    h = p.headroom.of(g.role)
    share_p = g.rho if g.role == "both" else 1.0
    share_d = 1.0 - g.rho if g.role == "both" else 1.0
    need = 0.0
    for i in range(len(p.buckets)):
        if (i, j) in p.costs:
            lp, ld = _loads(p, i, j)
            need += max(lp / (h * share_p) if lp else 0.0, ld / (h * share_d) if ld else 0.0)
    return math.ceil(need) + 1


def build(
    p: Problem, alpha_mode: bool = False
) -> tuple[Model, list[int], dict[tuple[int, int], int], int]:
    """The program of the module docstring: (model, n_j columns, x_ij columns, the alpha
    column or -1)."""
    m = Model(maximize=alpha_mode)
    bounds = [_bound(p, j) for j in range(len(p.groups))]
    price = 0.0 if alpha_mode else 1.0
    n = [
        m.var(0, bounds[j], price * (g.price_per_hour + WORKER_TIE_BREAK), integer=True)
        for j, g in enumerate(p.groups)
    ]
    x = {key: m.var(0.0, 1.0) for key in sorted(p.costs)}
    alpha = m.var(0.0, 1.0, 1.0) if alpha_mode else -1
    for i in range(len(p.buckets)):
        for sides in (("prefill", "both"), ("decode", "both")):
            row = {
                x[(i, j)]: 1.0 for j, g in enumerate(p.groups) if g.role in sides and (i, j) in x
            }
            if alpha_mode:
                row[alpha] = -1.0
                m.row(row, 0.0, 0.0)
            else:
                m.row(row, 1.0, 1.0)
    for j, g in enumerate(p.groups):
        h = p.headroom.of(g.role)
        parts: tuple[tuple[int, float], ...] = (
            (0, 1.0),
        )  # (side 0 prefill / 1 decode, time share)
        if g.role == "decode":
            parts = ((1, 1.0),)
        elif g.role == "both":
            parts = ((0, g.rho), (1, 1.0 - g.rho))
        for side, share in parts:
            row = {x[(i, j)]: _loads(p, i, j)[side] for i in range(len(p.buckets)) if (i, j) in x}
            row[n[j]] = -h * share
            m.row(row, -math.inf, 0.0)
    for kind, avail in p.available.items():
        if avail is not None:
            row = {n[j]: float(g.tp) for j, g in enumerate(p.groups) if g.kind.name == kind}
            m.row(row, -math.inf, float(avail))
    for tier in sorted({b.tier for b in p.buckets}):
        row = {}
        for (i, j), col in x.items():
            b = p.buckets[i]
            if b.tier == tier:
                row[col] = b.tier_share * p.costs[(i, j)].miss
        if alpha_mode:
            row[alpha] = -p.miss_budget
            m.row(row, -math.inf, 0.0)
        else:
            m.row(row, -math.inf, p.miss_budget)
    return m, n, x, alpha


def _candidate(
    p: Problem, values: Sequence[float], n: Sequence[int], x: Mapping[tuple[int, int], int]
) -> Candidate:
    counts = tuple(round(values[c]) for c in n)
    pools: dict[Pool, int] = {}
    for j, g in enumerate(p.groups):
        if counts[j]:
            pools[g.pool] = pools.get(g.pool, 0) + counts[j]
    price = sum(c * g.price_per_hour for c, g in zip(counts, p.groups, strict=True))
    shares = {key: values[col] for key, col in x.items() if values[col] > 1e-9}
    return Candidate(counts, pools, price, shares)


def _cut(m: Model, p: Problem, n: Sequence[int], bounds: Sequence[int], cand: Candidate) -> None:
    """Cut off ``cand`` and every fleet with at least its workers in each pool (module
    docstring)."""
    ys: list[int] = []
    for pool, have in cand.pools.items():
        cols = [n[j] for j, g in enumerate(p.groups) if g.pool == pool]
        big = float(sum(bounds[j] for j, g in enumerate(p.groups) if g.pool == pool))
        y = m.var(0.0, 1.0, 0.0, integer=True)
        ys.append(y)
        row = dict.fromkeys(cols, 1.0)
        row[y] = big
        m.row(row, -math.inf, have - 1 + big)
    m.row(dict.fromkeys(ys, 1.0), 1.0, math.inf)


def best_candidates(p: Problem, k: int = 3) -> list[Candidate]:
    """Up to ``k`` cheapest distinct fleets, cheapest first (empty when infeasible)."""
    m, n, x, _ = build(p)
    bounds = [round(m.ub[c]) for c in n]
    out: list[Candidate] = []
    for _ in range(k):
        values = solve(m)
        if values is None:
            break
        cand = _candidate(p, values, n, x)
        out.append(cand)
        _cut(m, p, n, bounds, cand)
    return out


def max_alpha(p: Problem) -> Candidate | None:
    """The largest share ``alpha`` of the traffic some fleet within the catalogue carries
    at the headroom and miss budget, and the cheapest such fleet (None if ``alpha`` is 0)."""
    m, n, x, alpha = build(p, alpha_mode=True)
    values = solve(m)
    if values is None or values[alpha] <= 1e-9:
        return None
    best = values[alpha]
    m.maximize = False
    for j, g in enumerate(p.groups):
        m.cost[n[j]] = g.price_per_hour + WORKER_TIE_BREAK
    m.cost[alpha] = 0.0
    m.lb[alpha] = best * (1.0 - 1e-6)
    values = solve(m)
    if values is None:  # numerically at the edge: keep the first solution
        m.lb[alpha] = 0.0
        values = solve(m) or []
    cand = _candidate(p, values, n, x)
    return Candidate(cand.counts, cand.pools, cand.price_per_hour, cand.shares, best)
