"""What a decision returns: the plan, the fallback chain, the serving action and the record.

The record holds references to the candidates actually scored (top-k of each side, so a
bounded number) and is turned into plain JSON-ready data only when :meth:`Decision.to_dict`
is called: the hot path pays nothing for explainability it does not serialise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .domain import DecisionKind, Mode, ResourceNeed
from .framework import Candidate, Option
from .serving import ServingAction

__all__ = [
    "Decision",
    "DecisionRecord",
    "Estimates",
    "FallbackStep",
    "RejectClass",
    "RoutePlan",
]


class RejectClass:
    """Why a request was refused, for the status code at the edge.

    ``no_capable_worker`` -> FAILED_PRECONDITION (nothing could ever serve it);
    ``saturated``, ``throttled``, ``shed`` -> RESOURCE_EXHAUSTED (capable workers exist).
    """

    NO_CAPABLE_WORKER = "no_capable_worker"
    SATURATED = "saturated"
    THROTTLED = "throttled"
    SHED = "shed"


@dataclass(frozen=True, slots=True)
class Estimates:
    """Hand-off and latency estimates of the chosen route, ms unless stated.

    ``kv_bytes``: bytes crossing the link (TRANSFER) or built on the decode worker;
    ``transfer_ms``: link time incl. latency and conversion (None unless TRANSFER);
    ``recompute_ms``: the decode worker's own prefill time for the prompt;
    ``ttft_ms``: prefill wait + prefill + hand-off; ``tpot_ms``: predicted decode step.
    """

    kv_bytes: int
    transfer_ms: float | None
    recompute_ms: float
    conversion_ms: float
    prefill_wait_ms: float
    prefill_ms: float
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The chosen route. For RECOMPUTE and SAME_POOL the prefill worker is the decode
    worker. ``decode_kv_bytes`` is what to reserve on the decode worker (prompt + output)."""

    resource_need: ResourceNeed
    mode: Mode
    prefill_worker_id: str
    prefill_pool_id: str
    prefill_endpoint: str
    decode_worker_id: str
    decode_pool_id: str
    decode_endpoint: str
    decode_kv_bytes: int
    prefill_tokens: int
    estimates: Estimates


@dataclass(frozen=True, slots=True)
class FallbackStep:
    """One alternative in the ordered fallback chain.

    ``reason``: ``kv_transfer_failed`` (recompute on the decode worker after a failed
    transfer), ``next_best_pair``, ``next_pool``, ``shared_pool``.
    ``remaining_budget_ms`` = tier TTFT target - the alternative's estimated TTFT (counting
    the time lost on the failed primary for ``kv_transfer_failed``); negative means the
    alternative is late but still executable.
    """

    mode: Mode
    prefill_worker_id: str
    decode_worker_id: str
    decode_pool_id: str
    reason: str
    est_ttft_ms: float
    remaining_budget_ms: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "prefill_worker_id": self.prefill_worker_id,
            "decode_worker_id": self.decode_worker_id,
            "decode_pool_id": self.decode_pool_id,
            "reason": self.reason,
            "est_ttft_ms": round(self.est_ttft_ms, 3),
            "remaining_budget_ms": round(self.remaining_budget_ms, 3),
        }


@dataclass(slots=True)
class DecisionRecord:
    """Everything needed to explain a decision afterwards (serialised lazily)."""

    profile: str
    tier: str
    memory_pressure: float
    prefill_weights: dict[str, float]
    decode_weights: dict[str, float]
    side_weights: tuple[float, float]
    prefill_candidates: list[Candidate] = field(default_factory=list)
    decode_candidates: list[Candidate] = field(default_factory=list)
    options: list[Option] = field(default_factory=list)
    rejected_workers: list[tuple[str, str, str]] = field(default_factory=list)
    rejected_pools: dict[str, tuple[str, ...]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    explain: Callable[[Option], dict[str, float]] | None = None

    def to_dict(self, max_options: int = 16) -> dict[str, Any]:
        """Plain data: every candidate's per-factor scores, the weights, the options scored
        (best first, at most ``max_options``), rejected workers and pools with reasons."""
        explain = self.explain
        options: list[dict[str, Any]] = []
        for o in sorted(self.options, key=_option_order)[:max_options]:
            factors = {**o.factors, **explain(o)} if explain is not None else o.factors
            transfer = o.mode is Mode.TRANSFER
            options.append(
                {
                    "prefill_worker_id": o.p.ws.worker_id,
                    "decode_worker_id": o.d.ws.worker_id,
                    "mode": o.mode.value,
                    "score": round(o.score, 6),
                    "ttft_ms": round(o.ttft_ms, 3),
                    "transfer_ms": round(o.transfer_ms, 3) if transfer else None,
                    "factors": {k: round(v, 6) for k, v in factors.items()},
                    "kv_reasons": list(o.kv_reasons),
                }
            )
        return {
            "profile": self.profile,
            "tier": self.tier,
            "memory_pressure": round(self.memory_pressure, 6),
            "weights": {
                "prefill": dict(self.prefill_weights),
                "decode": dict(self.decode_weights),
                "sides": list(self.side_weights),
            },
            "candidates": {
                "prefill": [_cand(c) for c in self.prefill_candidates],
                "decode": [_cand(c) for c in self.decode_candidates],
            },
            "options": options,
            "rejected_workers": [
                {"worker_id": w, "pool_id": p, "reason": r} for w, p, r in self.rejected_workers
            ],
            "rejected_pools": {k: list(v) for k, v in self.rejected_pools.items()},
            "notes": list(self.notes),
        }


def _option_order(o: Option) -> tuple[float, int, int]:
    """Best first: score descending, then the snapshot tie-break (prefill, decode index)."""
    return (-o.score, o.p.ws.idx, o.d.ws.idx)


def _cand(c: Candidate) -> dict[str, Any]:
    ws = c.ws
    return {
        "worker_id": ws.worker_id,
        "pool_id": ws.pool_id,
        "score": round(c.score, 6),
        "factors": {k: round(v, 6) for k, v in c.factors.items()},
        "wait_ms": round(c.wait_ms, 3),
        "prefill_ms": round(c.run_ms, 3),
        "step_ms": round(c.step_ms, 3),
    }


@dataclass(frozen=True, slots=True)
class Decision:
    """The planner's answer for one request."""

    request_id: str
    kind: DecisionKind
    resource_need: ResourceNeed
    action: ServingAction
    plan: RoutePlan | None
    fallbacks: tuple[FallbackStep, ...]
    reject_reasons: tuple[str, ...]
    reject_class: str | None
    retry_after_ms: float | None
    record: DecisionRecord

    def route_record(self) -> dict[str, str]:
        """The seed's six-field route record (``selected_pool`` is the decode pool)."""
        plan = self.plan
        return {
            "resource_need": self.resource_need.value,
            "selected_pool": plan.decode_pool_id if plan else "none",
            "execution_mode": plan.mode.value if plan else "none",
            "route_decision": self.kind.value,
            "service_action": self.action.action.value,
            "protect": self.action.protects.value,
        }

    def to_dict(self) -> dict[str, Any]:
        """The full decision as JSON-ready data (plan, chain, action, record)."""
        plan = self.plan
        plan_d: dict[str, Any] | None = None
        if plan is not None:
            e = plan.estimates
            plan_d = {
                "resource_need": plan.resource_need.value,
                "mode": plan.mode.value,
                "prefill_worker_id": plan.prefill_worker_id,
                "prefill_pool_id": plan.prefill_pool_id,
                "prefill_endpoint": plan.prefill_endpoint,
                "decode_worker_id": plan.decode_worker_id,
                "decode_pool_id": plan.decode_pool_id,
                "decode_endpoint": plan.decode_endpoint,
                "decode_kv_bytes": plan.decode_kv_bytes,
                "prefill_tokens": plan.prefill_tokens,
                "estimates": {
                    "kv_bytes": e.kv_bytes,
                    "transfer_ms": None if e.transfer_ms is None else round(e.transfer_ms, 3),
                    "recompute_ms": round(e.recompute_ms, 3),
                    "conversion_ms": round(e.conversion_ms, 3),
                    "prefill_wait_ms": round(e.prefill_wait_ms, 3),
                    "prefill_ms": round(e.prefill_ms, 3),
                    "ttft_ms": round(e.ttft_ms, 3),
                    "tpot_ms": round(e.tpot_ms, 3),
                },
            }
        return {
            "request_id": self.request_id,
            "decision": self.kind.value,
            "resource_need": self.resource_need.value,
            "plan": plan_d,
            "serving_action": {
                "action": self.action.action.value,
                "protects": self.action.protects.value,
                "ladder": [
                    {"action": s.action.value, "above": s.above, "protects": s.protects.value}
                    for s in self.action.steps
                ],
            },
            "fallbacks": [f.to_dict() for f in self.fallbacks],
            "reject_reasons": list(self.reject_reasons),
            "reject_class": self.reject_class,
            "retry_after_ms": self.retry_after_ms,
            "record": self.record.to_dict(),
        }
