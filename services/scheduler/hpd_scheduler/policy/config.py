"""Scheduler profiles: named compositions of plugins, loaded from YAML and validated up front.

A profile document::

    profile: default
    plugins:                      # instances: a unique name, a registered type, params
      - {name: gate, type: execution-gate-filter}
      - {name: compute, type: capacity-compute-scorer}
      - {name: best, type: max-score-picker}
    preselect: {key: capacity, top_k_prefill: 6, top_k_decode: 6, max_scan: 256}
    pairing: joint                # joint | independent | colocated
    picker: best                  # a picker instance
    classification: {long_prompt_tokens: 2048, long_decode_tokens: 256}
    side_weights: {prefill: [0.65, 0.35], decode: [0.35, 0.65], shared: [0.5, 0.5]}
    prefill: {filters: [gate], scorers: [{plugin: compute, weight: 0.30}]}
    decode:  {filters: [gate], scorers: [...]}
    ladder: [{action: throttle_admission, above: 0.80}, ...]
    tiers: {default: standard, classes: {standard: {ttft_ms: 3000, tpot_ms: 100, ...}}}

Any error raises :class:`ConfigError` with the dotted key path of the offending key: unknown
plugin type, duplicate instance name, a reference to an instance that does not exist or is of
the wrong kind, a weight <= 0, a missing picker, unknown keys, ill-typed values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .domain import ResourceNeed, Tier
from .errors import InvalidInputError
from .framework import Filter, OptionFilter, Picker, Scorer
from .serving import DEFAULT_LADDER, LadderStep

__all__ = [
    "DEFAULT_TIERS",
    "PAIRINGS",
    "PRESELECT_MODES",
    "Profile",
    "SideSpec",
    "SloObjective",
]

PRESELECT_MODES = ("capacity", "blind", "rotation", "random", "all")
PAIRINGS = ("joint", "independent", "colocated")

DEFAULT_TIERS: dict[str, Tier] = {
    "interactive": Tier(
        "interactive",
        ttft_ms=1000.0,
        tpot_ms=50.0,
        queue_budget_ms=300.0,
        priority=2,
        hard_ttft_ms=10_000.0,
    ),
    "standard": Tier("standard", ttft_ms=3000.0, tpot_ms=100.0, queue_budget_ms=1000.0, priority=1),
    "batch": Tier(
        "batch",
        ttft_ms=30_000.0,
        tpot_ms=200.0,
        queue_budget_ms=20_000.0,
        priority=0,
        may_throttle=True,
        may_shed=True,
    ),
}


@dataclass(frozen=True, slots=True)
class SideSpec:
    """Filters and weighted scorers of one role."""

    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]

    @property
    def total_weight(self) -> float:
        """Sum of the scorer weights (totals are divided by it, so they stay in [0, 1])."""
        return sum(w for _, w in self.scorers) or 1.0

    def weights(self) -> dict[str, float]:
        """Weight per scorer instance name."""
        return {s.name: w for s, w in self.scorers}


@dataclass(frozen=True, slots=True)
class SloObjective:
    """Rank pairs by the SLOs they are predicted to keep before the weighted score.

    With it, every joint option's TTFT estimate is the whole path (prefill queue wait in ms
    of that worker's own work + prefill + hand-off + the decode worker's admission wait,
    ``WorkerState.admission_wait_ms``) and its TPOT estimate is the decode worker's
    predicted step with the request admitted (``Candidate.step_ms``). An option *keeps*
    the TTFT target when ``ttft_est <= ttft_fraction x tier.ttft_ms`` and the TPOT target
    when ``tpot_est <= tpot_fraction x tier.tpot_ms``; its final score is
    ``(q + targets kept) / 3`` with ``q`` in [0, 1] (below), so an option predicted to keep
    both SLOs always beats one predicted to miss one, whatever their factor scores (the
    factors only order options of equal standing). Fractions below 1 keep a margin for what
    the estimates cannot see (arrivals bursting behind the request, sequences joining the
    batch later).
    ``slack_weight`` ``s`` blends the TTFT slack into the order within a standing:
    ``q = (1 - s) x weighted score + s x T / (T + ttft_est)``, ``T`` the tier's
    TTFT target, so of two options that both keep their SLOs the one leaving more headroom
    for the next burst is preferred (0: the weighted factors alone).
    ``conditional``: every decode worker also offers its own prefill (RECOMPUTE, or SAME_POOL
    on a worker serving both stages), not only where the seed rule would recompute, and the
    estimates above choose between it and a transfer; such an option's TPOT estimate adds
    the stall its prefill puts on a non-empty running batch, ``(queued local prefill +
    this prefill) / the traffic's mean output`` (``Fleet.ref_output_tokens``; the request's
    own expected output when unknown); a transfer whose prefill worker also decodes
    (it serves both stages) is judged by the same stall on that worker's running batch.
    ``admit_ttft_factor`` ``a`` (0: off, else at most 4): refuse a request (SATURATED,
    ``ttft_over_admission_limit``) when no option has ``ttft_est <= a x tier.ttft_ms``, where
    a request expecting ``k > 1`` times the traffic's mean output is judged with ``k`` times
    its decode admission wait (``Option.admit_extra_ms``: it would hold its slot ``k`` times
    as long, so past capacity the longest are refused first), except,
    for a prompt whose own work (prefill, hand-off) is past that limit on every option, an
    option whose own work is at least half its estimate (a prompt too long for the limit is
    served while it waits no longer than it works, so an idle fleet never refuses).
    ``admit_tpot_factor`` ``b`` (0: off, else at most 4): likewise refuse (SATURATED,
    ``tpot_over_admission_limit``) when no option left has ``tpot_est <= b x tier.tpot_ms``.
    The TPOT estimate sees the decode step stretched by the engine's reported prefill share
    (``WorkerState.tpot_ms``), so a worker whose batch is held up by the prefills routed to
    it stops taking more once its sequences would miss their target.
    Absent (the seed and the baselines): options are ranked by the weighted score alone."""

    ttft_fraction: float = 1.0
    tpot_fraction: float = 1.0
    slack_weight: float = 0.0
    conditional: bool = False
    admit_ttft_factor: float = 0.0
    admit_tpot_factor: float = 0.0


@dataclass(frozen=True)
class Profile:
    """A validated, ready-to-run scheduler profile."""

    name: str
    prefill: SideSpec
    decode: SideSpec
    picker: Picker[Any]
    preselect: str = "capacity"
    top_k_prefill: int = 6
    top_k_decode: int = 6
    max_scan: int = 256
    pairing: str = "joint"
    long_prompt_tokens: int = 2048
    long_decode_tokens: int = 256
    side_weights: Mapping[ResourceNeed, tuple[float, float]] = field(
        default_factory=lambda: {
            ResourceNeed.PREFILL: (0.65, 0.35),
            ResourceNeed.DECODE: (0.35, 0.65),
            ResourceNeed.SHARED: (0.5, 0.5),
        }
    )
    ladder: tuple[LadderStep, ...] = DEFAULT_LADDER
    tiers: Mapping[str, Tier] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_tier: str = "standard"
    chain_length: int = 3
    slo_objective: SloObjective | None = None
    # the stage after pairing (``admission.py``), in order; None: the built-in ones the
    # tiers and the SLO objective ask for (``admission.default_option_filters``)
    option_filters: tuple[OptionFilter, ...] | None = None

    def tier(self, name: str) -> Tier:
        """The tier called ``name`` ('' = the default tier); InvalidInputError if unknown."""
        tier = self.tiers.get(name or self.default_tier)
        if tier is None:
            raise InvalidInputError("tier", f"unknown tier {name!r}; known: {sorted(self.tiers)}")
        return tier

    def lowest_sheddable_tier(self) -> str | None:
        """Name of the lowest-priority tier that may be shed (None if none may)."""
        sheddable = [t for t in self.tiers.values() if t.may_shed]
        if not sheddable:
            return None
        return min(sheddable, key=lambda t: (t.priority, t.name)).name
