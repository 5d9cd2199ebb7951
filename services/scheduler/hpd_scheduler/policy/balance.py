"""Seed 001 load balancing and adaptive batching, as pure recommendations.

The scheduler service evaluates these periodically over its fleet view and sends the results
as directives; the functions themselves only compute.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import InvalidInputError

__all__ = [
    "BatchChange",
    "BatchRecommendation",
    "Move",
    "RebalancePlan",
    "adapt_batch_size",
    "detect_imbalance",
    "rebalance_plan",
]

_EPS = 1e-9
"""Float tolerance for strict threshold comparisons, so ``0.6 - 0.3`` counts as exactly 0.3."""


def detect_imbalance(loads: list[float], spread: float = 0.3, overload: float = 0.9) -> bool:
    """Imbalanced when ``max - min > spread`` or ``max > overload`` (both strict, seed rule);
    fewer than two loads are never imbalanced. Loads are utilisations in [0, 1], ideally
    capacity-normalised (see :func:`rebalance_plan`)."""
    if len(loads) < 2:
        return False
    hi, lo = max(loads), min(loads)
    return hi - lo > spread + _EPS or hi > overload + _EPS


@dataclass(frozen=True, slots=True)
class Move:
    """Shed ``fraction`` of ``src``'s current work to ``dst``.

    ``work`` is the same amount in absolute units (load x capacity, e.g. tokens/s or
    requests), ``requests`` the number of queued requests that carries (rounded up, >= 1).
    """

    src: str
    dst: str
    fraction: float
    work: float
    requests: int


@dataclass(frozen=True, slots=True)
class RebalancePlan:
    """The moves that bring every worker toward the capacity-weighted mean load."""

    imbalanced: bool
    mean_load: float
    moves: tuple[Move, ...]


def rebalance_plan(
    loads: Mapping[str, float],
    capacities: Mapping[str, float] | None = None,
    queued: Mapping[str, int] | None = None,
    spread: float = 0.3,
    overload: float = 0.9,
) -> RebalancePlan:
    """Water-filling rebalance.

    Target load ``L* = sum(L_i C_i) / sum(C_i)`` (capacity ``C_i`` defaults to 1: the seed's
    equal nodes). Donors (``L_i > L*``) hold excess ``(L_i - L*) C_i``, receivers
    (``L_j < L*``) room ``(L* - L_j) C_j``; the busiest donor sends to the idlest receiver
    ``min(excess, room)``, repeatedly. ``fraction = work / (L_i C_i)`` of the donor's work;
    ``requests = ceil(fraction x queued_i)`` when queue depths are given. Nothing moves unless
    :func:`detect_imbalance` holds.
    """
    caps = {w: (capacities or {}).get(w, 1.0) for w in loads}
    for w, c in caps.items():
        if not c > 0:
            raise InvalidInputError(f"capacities.{w}", f"must be > 0, got {c}")
    imbalanced = detect_imbalance(list(loads.values()), spread, overload)
    total_cap = sum(caps.values())
    mean = sum(loads[w] * caps[w] for w in loads) / total_cap if total_cap else 0.0
    if not imbalanced:
        return RebalancePlan(imbalanced=False, mean_load=mean, moves=())
    excess = {w: (loads[w] - mean) * caps[w] for w in loads if loads[w] > mean + _EPS}
    room = {w: (mean - loads[w]) * caps[w] for w in loads if loads[w] < mean - _EPS}
    moves: list[Move] = []
    donors = sorted(excess, key=lambda w: (-loads[w], w))
    receivers = sorted(room, key=lambda w: (loads[w], w))
    di = ri = 0
    while di < len(donors) and ri < len(receivers):
        src, dst = donors[di], receivers[ri]
        amount = min(excess[src], room[dst])
        if amount > _EPS:
            held = loads[src] * caps[src]
            fraction = amount / held if held > 0 else 0.0
            q = (queued or {}).get(src, 0)
            requests = max(1, -int(-fraction * q // 1)) if q > 0 else 0
            moves.append(Move(src, dst, fraction, amount, requests))
        excess[src] -= amount
        room[dst] -= amount
        if excess[src] <= _EPS:
            di += 1
        if room[dst] <= _EPS:
            ri += 1
    return RebalancePlan(imbalanced=True, mean_load=mean, moves=tuple(moves))


class BatchChange(enum.StrEnum):
    """Direction of a batch-size recommendation."""

    DECREASE = "decrease"
    INCREASE = "increase"
    KEEP = "keep"


@dataclass(frozen=True, slots=True)
class BatchRecommendation:
    """New max batch size for one worker, and why."""

    max_batch_size: int
    change: BatchChange
    reason: str


def adapt_batch_size(
    current_max: int,
    hard_max: int,
    itl_p99_ms: float,
    target_itl_ms: float,
    queue_depth: int,
    high: float = 1.2,
    low: float = 0.8,
    min_queue: int = 10,
) -> BatchRecommendation:
    """Seed adaptive batching with a per-tier target:

    ``itl_p99 > high x target`` -> ``int(current x 0.9)`` (at least 1);
    ``itl_p99 < low x target`` and ``queue > min_queue`` -> ``min(int(current x 1.1), hard_max)``;
    otherwise keep. Strict comparisons: exactly 1.2x, exactly 0.8x and a queue of exactly 10
    keep the size.
    """
    if current_max < 1:
        raise InvalidInputError("current_max", f"must be >= 1, got {current_max}")
    if hard_max < 1:
        raise InvalidInputError("hard_max", f"must be >= 1, got {hard_max}")
    if not target_itl_ms > 0:
        raise InvalidInputError("target_itl_ms", f"must be > 0, got {target_itl_ms}")
    if itl_p99_ms > target_itl_ms * high + _EPS:
        new = max(1, int(current_max * 0.9))
        return BatchRecommendation(new, BatchChange.DECREASE, "itl_p99_above_target")
    if itl_p99_ms < target_itl_ms * low - _EPS and queue_depth > min_queue:
        new = min(int(current_max * 1.1), hard_max)
        if new > current_max:
            return BatchRecommendation(new, BatchChange.INCREASE, "itl_headroom_with_backlog")
        return BatchRecommendation(current_max, BatchChange.KEEP, "at_hard_max")
    return BatchRecommendation(current_max, BatchChange.KEEP, "within_band")
