"""Seed 000's pool-level mechanisms as typed functions (hand-off cost and choice, capability
gates, fallback routing over pools), kept exact so the seed's test cases hold as written.

The product applies the same rules per worker pair inside the planner
(``hpd_scheduler.policy``: ``pairing.py`` for the hand-off, the filters of ``plugins.py`` for
the capability gates, ``planner.py`` for fallbacks); this pool-level form is what the seed
specifies and only its tests call, so it lives beside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hpd_scheduler.policy.domain import DecisionKind, Mode
from hpd_scheduler.policy.errors import InvalidInputError

BYTES_PER_MB = 1_000_000
"""Decimal megabyte: link rates are decimal (Gb/s), so sizes are too (100 MB x 8 / 200 Gb/s =
4.0 ms exactly)."""


def transfer_ms(kv_bytes: float, link_gbps: float, latency_ms: float = 0.0) -> float:
    """Time to move ``kv_bytes`` over a ``link_gbps`` link: ``bytes x 8 / (Gb/s x 10^6)`` ms,
    plus the link's setup latency. Units are normalised here, once."""
    if not link_gbps > 0:
        raise InvalidInputError("link_gbps", f"must be > 0, got {link_gbps}")
    if kv_bytes < 0:
        raise InvalidInputError("kv_bytes", f"must be >= 0, got {kv_bytes}")
    if latency_ms < 0:
        raise InvalidInputError("latency_ms", f"must be >= 0, got {latency_ms}")
    return kv_bytes * 8.0 / (link_gbps * 1e6) + latency_ms


@dataclass(frozen=True, slots=True)
class HandoffChoice:
    """Transfer or recompute, with both costs in ms."""

    mode: Mode
    transfer_ms: float
    recompute_ms: float


def choose_handoff(
    kv_bytes: float,
    link_gbps: float,
    recompute_ms: float,
    latency_ms: float = 0.0,
    conversion_ms: float = 0.0,
) -> HandoffChoice:
    """Transfer when ``transfer_ms + conversion_ms <= recompute_ms`` (a tie transfers: it
    leaves the decode worker's compute free), recompute otherwise.

    Raises :class:`InvalidInputError` for a non-positive link, negative size or negative
    recompute time.
    """
    if recompute_ms < 0:
        raise InvalidInputError("recompute_ms", f"must be >= 0, got {recompute_ms}")
    if conversion_ms < 0:
        raise InvalidInputError("conversion_ms", f"must be >= 0, got {conversion_ms}")
    t = transfer_ms(kv_bytes, link_gbps, latency_ms) + conversion_ms
    mode = Mode.TRANSFER if t <= recompute_ms else Mode.RECOMPUTE
    return HandoffChoice(mode=mode, transfer_ms=t, recompute_ms=recompute_ms)


@dataclass(frozen=True, slots=True)
class StageNeed:
    """What a request asks of a pool at one stage: stage, model revision, the KV format of
    the state it brings (dtype, layout as opaque names) and the memory it needs."""

    stage: str
    model_revision: str
    kv_dtype: str
    kv_layout: str
    required_memory_bytes: float


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A pool as seed 000 describes it."""

    pool_id: str
    stages: frozenset[str]
    model_revision: str
    kv_dtype: str
    kv_layout: str
    available_memory_bytes: float
    healthy: bool


@dataclass(frozen=True, slots=True)
class Capability:
    """Two separate gates: can the pool run the request, and can it take the KV as is.

    ``can_accept_kv`` implies ``can_execute``; KV-incompatible but executable means the pool
    recomputes, it is never "unusable". ``reasons`` = execution reasons then KV reasons.
    """

    pool_id: str
    can_execute: bool
    can_accept_kv: bool
    execution_reasons: tuple[str, ...]
    kv_reasons: tuple[str, ...]

    @property
    def reasons(self) -> tuple[str, ...]:
        """All failing checks, execution ones first."""
        return self.execution_reasons + self.kv_reasons


def evaluate_capability(need: StageNeed, pool: PoolSpec) -> Capability:
    """Execution gate (health, stage, model revision, memory) then KV gate (dtype, layout).

    Reason codes: ``unhealthy``, ``unsupported_stage``, ``model_revision_mismatch``,
    ``insufficient_memory``; ``kv_dtype_mismatch``, ``kv_layout_mismatch``.
    """
    exec_reasons: list[str] = []
    if not pool.healthy:
        exec_reasons.append("unhealthy")
    if need.stage not in pool.stages:
        exec_reasons.append("unsupported_stage")
    if need.model_revision != pool.model_revision:
        exec_reasons.append("model_revision_mismatch")
    if pool.available_memory_bytes < need.required_memory_bytes:
        exec_reasons.append("insufficient_memory")
    kv_reasons: list[str] = []
    if need.kv_dtype != pool.kv_dtype:
        kv_reasons.append("kv_dtype_mismatch")
    if need.kv_layout != pool.kv_layout:
        kv_reasons.append("kv_layout_mismatch")
    can_execute = not exec_reasons
    return Capability(
        pool_id=pool.pool_id,
        can_execute=can_execute,
        can_accept_kv=can_execute and not kv_reasons,
        execution_reasons=tuple(exec_reasons),
        kv_reasons=tuple(kv_reasons),
    )


@dataclass(frozen=True, slots=True)
class PoolRoute:
    """Outcome of pool-level fallback routing. ``selected_pool`` and ``mode`` are None on
    reject; ``rejected_pools`` maps every pool passed over to its reasons, in order."""

    selected_pool: str | None
    mode: Mode | None
    decision: DecisionKind
    reasons: tuple[str, ...]
    rejected_pools: dict[str, tuple[str, ...]] = field(default_factory=dict)


def route_with_fallback(
    need: StageNeed,
    primary: PoolSpec,
    fallbacks: Sequence[PoolSpec],
    preferred: Mode,
) -> PoolRoute:
    """Primary pool, then the fallbacks in order; the first executable pool wins.

    On that pool a preferred TRANSFER becomes RECOMPUTE when the pool cannot accept the KV
    (the pool is kept, not dropped). Decision PRIMARY for the first pool, REROUTE for a
    fallback, REJECT with ``no_executable_pool`` when none can execute.
    """
    if preferred not in (Mode.TRANSFER, Mode.RECOMPUTE):
        raise InvalidInputError("preferred_handoff", "must be transfer or recompute")
    rejected: dict[str, tuple[str, ...]] = {}
    for index, pool in enumerate((primary, *fallbacks)):
        cap = evaluate_capability(need, pool)
        if not cap.can_execute:
            rejected[cap.pool_id] = cap.reasons
            continue
        mode = preferred
        if preferred is Mode.TRANSFER and not cap.can_accept_kv:
            mode = Mode.RECOMPUTE
        return PoolRoute(
            selected_pool=cap.pool_id,
            mode=mode,
            decision=DecisionKind.PRIMARY if index == 0 else DecisionKind.REROUTE,
            reasons=cap.reasons,
            rejected_pools=rejected,
        )
    return PoolRoute(
        selected_pool=None,
        mode=None,
        decision=DecisionKind.REJECT,
        reasons=("no_executable_pool",),
        rejected_pools=rejected,
    )
