"""Serving actions: what the scheduler does when memory or queues run hot, and what it protects.

Seed 000 orders memory pressure before queue delay: memory pressure above 0.9 falls back to
the shared pool (protecting residency: requests already holding KV must not be evicted), else
a queue delay over the tier's budget routes elsewhere or throttles (protecting latency), else
the heterogeneous route stays (protecting throughput).

We extend the memory branch into one ladder, climbed in order as pressure rises:

=====================  =========  ==========================================================
step                   default    protects
=====================  =========  ==========================================================
throttle_admission     > 0.80     residency: tiers that may be throttled wait (retry later)
lower_batch_cap        > 0.85     latency: smaller decode batches keep ITL and KV in bounds
fallback_to_shared     > 0.90     residency: new work goes to a pool serving both stages
shed_lowest_tier       > 0.95     higher_tiers: the lowest tier that may be shed is refused
=====================  =========  ==========================================================

Every step reached is recorded; the action reported is the most severe one reached, so at the
seed's 0.92 the action is still ``fallback_to_shared`` / ``residency`` as the seed says.
Comparisons are strict (``>``): exactly at a threshold the step is not taken.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import InvalidInputError

__all__ = [
    "DEFAULT_LADDER",
    "SEED_LADDER",
    "Action",
    "LadderStep",
    "Protects",
    "ServingAction",
    "select_action",
]


class Action(enum.StrEnum):
    """Serving actions, the three of the seed and the ladder's extra steps."""

    KEEP_HETEROGENEOUS_ROUTE = "keep_heterogeneous_route"
    ROUTE_OR_THROTTLE = "route_or_throttle"
    THROTTLE_ADMISSION = "throttle_admission"
    LOWER_BATCH_CAP = "lower_batch_cap"
    FALLBACK_TO_SHARED = "fallback_to_shared"
    SHED_LOWEST_TIER = "shed_lowest_tier"
    # not a ladder step: what a rejected request's record names (nothing was routed)
    REJECT = "reject"


class Protects(enum.StrEnum):
    """What an action protects."""

    THROUGHPUT = "throughput"
    LATENCY = "latency"
    RESIDENCY = "residency"
    HIGHER_TIERS = "higher_tiers"
    # a reject because no worker could ever run the request protects nothing
    NOTHING = "nothing"


@dataclass(frozen=True, slots=True)
class LadderStep:
    """One rung: taken when memory pressure is strictly above ``above``."""

    action: Action
    above: float
    protects: Protects


DEFAULT_LADDER: tuple[LadderStep, ...] = (
    LadderStep(Action.THROTTLE_ADMISSION, 0.80, Protects.RESIDENCY),
    LadderStep(Action.LOWER_BATCH_CAP, 0.85, Protects.LATENCY),
    LadderStep(Action.FALLBACK_TO_SHARED, 0.90, Protects.RESIDENCY),
    LadderStep(Action.SHED_LOWEST_TIER, 0.95, Protects.HIGHER_TIERS),
)

SEED_LADDER: tuple[LadderStep, ...] = (
    LadderStep(Action.FALLBACK_TO_SHARED, 0.90, Protects.RESIDENCY),
)
"""The seed's single memory rule."""


@dataclass(frozen=True, slots=True)
class ServingAction:
    """The action taken, what it protects, and every ladder step reached (in order)."""

    action: Action
    protects: Protects
    steps: tuple[LadderStep, ...] = ()

    def took(self, action: Action) -> bool:
        """True when ``action`` is among the steps reached (or is the action itself)."""
        return self.action is action or any(s.action is action for s in self.steps)


def select_action(
    memory_pressure: float,
    queue_delay_ms: float,
    queue_budget_ms: float,
    ladder: tuple[LadderStep, ...] = DEFAULT_LADDER,
) -> ServingAction:
    """Memory ladder first, then queue delay against the budget, else keep the route.

    ``memory_pressure`` is used KV memory / total KV memory in [0, 1] (reservations count as
    used). ``ladder`` must be ordered by ascending threshold.
    """
    if not 0.0 <= memory_pressure <= 1.0 + 1e-9:
        raise InvalidInputError("memory_pressure", f"must be in [0, 1], got {memory_pressure}")
    if queue_delay_ms < 0:
        raise InvalidInputError("queue_delay_ms", f"must be >= 0, got {queue_delay_ms}")
    if not queue_budget_ms > 0:
        raise InvalidInputError("queue_budget_ms", f"must be > 0, got {queue_budget_ms}")
    reached = tuple(step for step in ladder if memory_pressure > step.above)
    if reached:
        top = reached[-1]
        return ServingAction(action=top.action, protects=top.protects, steps=reached)
    if queue_delay_ms > queue_budget_ms:
        return ServingAction(action=Action.ROUTE_OR_THROTTLE, protects=Protects.LATENCY)
    return ServingAction(action=Action.KEEP_HETEROGENEOUS_ROUTE, protects=Protects.THROUGHPUT)
