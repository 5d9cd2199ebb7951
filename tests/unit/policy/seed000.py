"""Seed 000's dict-shaped functions, as thin adapters over the typed core.

They exist so the seed's test cases can be run as written (same inputs, same outputs); the
product's own code is :mod:`hpd_scheduler.policy` (:class:`~hpd_scheduler.policy.Planner`).
Memory in the seed's dicts is in GB; it is compared as given (both sides in the same unit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hpd_scheduler.policy.domain import Mode
from hpd_scheduler.policy.errors import InvalidInputError
from hpd_scheduler.policy.mechanisms import classify_need
from hpd_scheduler.policy.serving import SEED_LADDER, select_action

from .seed_mechanisms import (
    BYTES_PER_MB,
    PoolSpec,
    StageNeed,
    choose_handoff,
    evaluate_capability,
    route_with_fallback,
)

__all__ = [
    "build_route_record",
    "choose_handoff_mode",
    "classify_resource_need",
    "evaluate_pool_capability",
    "plan_route_with_fallback",
    "select_serving_action",
]


def _int_field(data: Mapping[str, Any], key: str) -> int:
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(key, f"must be an integer, got {value!r}")
    return value


def classify_resource_need(
    request: Mapping[str, Any], long_prompt_threshold: int, long_decode_threshold: int
) -> str:
    """``prefill`` / ``decode`` / ``shared`` from ``prompt_tokens`` and ``decode_tokens``."""
    need = classify_need(
        _int_field(request, "prompt_tokens"),
        _int_field(request, "decode_tokens"),
        long_prompt_threshold,
        long_decode_threshold,
    )
    return need.value


def choose_handoff_mode(
    link_gbps: float, cache_transfer_mb: float, recompute_ms: float
) -> dict[str, object]:
    """``{'mode', 'transfer_ms' (rounded to 4 places), 'recompute_ms' (as given)}``."""
    if cache_transfer_mb < 0:
        raise InvalidInputError("cache_transfer_mb", f"must be >= 0, got {cache_transfer_mb}")
    choice = choose_handoff(cache_transfer_mb * BYTES_PER_MB, link_gbps, recompute_ms)
    return {
        "mode": choice.mode.value,
        "transfer_ms": round(choice.transfer_ms, 4),
        "recompute_ms": recompute_ms,
    }


def _need(request: Mapping[str, Any]) -> StageNeed:
    return StageNeed(
        stage=str(request.get("stage", "decode")),
        model_revision=str(request.get("model_revision", "")),
        kv_dtype=str(request.get("kv_dtype", "")),
        kv_layout=str(request.get("kv_layout", "")),
        required_memory_bytes=float(request.get("required_memory_gb", 0.0)),
    )


def _pool(pool: Mapping[str, Any]) -> PoolSpec:
    return PoolSpec(
        pool_id=str(pool.get("pool_id", "unknown")),
        stages=frozenset(str(s) for s in pool.get("supported_stages", [])),
        model_revision=str(pool.get("model_revision", "")),
        kv_dtype=str(pool.get("kv_dtype", "")),
        kv_layout=str(pool.get("kv_layout", "")),
        available_memory_bytes=float(pool.get("available_memory_gb", 0.0)),
        healthy=bool(pool.get("healthy", False)),
    )


def evaluate_pool_capability(
    request: Mapping[str, Any], pool: Mapping[str, Any]
) -> dict[str, object]:
    """``{'pool_id', 'can_execute', 'can_accept_kv', 'reasons'}``."""
    cap = evaluate_capability(_need(request), _pool(pool))
    return {
        "pool_id": cap.pool_id,
        "can_execute": cap.can_execute,
        "can_accept_kv": cap.can_accept_kv,
        "reasons": list(cap.reasons),
    }


def plan_route_with_fallback(
    request: Mapping[str, Any],
    primary_pool: Mapping[str, Any],
    fallback_pools: Sequence[Mapping[str, Any]],
    preferred_handoff: str,
) -> dict[str, object]:
    """``{'selected_pool', 'execution_mode', 'decision', 'reasons', 'rejected_pools'}``;
    ``'none'`` for pool and mode on reject."""
    try:
        preferred = Mode(preferred_handoff)
    except ValueError:
        raise InvalidInputError("preferred_handoff", "must be transfer or recompute") from None
    route = route_with_fallback(
        _need(request), _pool(primary_pool), [_pool(p) for p in fallback_pools], preferred
    )
    return {
        "selected_pool": route.selected_pool or "none",
        "execution_mode": route.mode.value if route.mode else "none",
        "decision": route.decision.value,
        "reasons": list(route.reasons),
        "rejected_pools": {k: list(v) for k, v in route.rejected_pools.items()},
    }


def select_serving_action(
    memory_pressure: float, queue_delay_ms: float, slo_queue_budget_ms: float
) -> dict[str, str]:
    """``{'action', 'protect'}`` with the seed's single memory rule."""
    action = select_action(memory_pressure, queue_delay_ms, slo_queue_budget_ms, SEED_LADDER)
    return {"action": action.action.value, "protect": action.protects.value}


def build_route_record(
    request: Mapping[str, Any], route: Mapping[str, Any], action: Mapping[str, str]
) -> dict[str, str]:
    """The seed's six-field route record."""
    return {
        "resource_need": str(request.get("resource_need", "shared")),
        "selected_pool": str(route["selected_pool"]),
        "execution_mode": str(route["execution_mode"]),
        "route_decision": str(route["decision"]),
        "service_action": action["action"],
        "protect": action["protect"],
    }
