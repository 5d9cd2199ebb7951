"""Seed 000's dict-shaped functions, as thin adapters over the product's own rules.

They exist so the seed's test cases can be run as written (same inputs, same outputs): each
turns the seed's dicts into the policy core's values and calls the very functions the
planner applies (``hpd_scheduler.policy.mechanisms``: ``classify_need``, ``handoff_mode``,
the execution and KV gates; ``links.Link.transfer_ms``; ``hpd_common.kvformat.negotiate``;
``serving.select_action``). No gate or cost is decided here. What is composed here is the
seed's pool-level walk (primary pool, then the fallbacks in order; a preferred transfer
turned into a recompute on a pool that cannot take the KV as it is), since the planner walks
ranked workers, not pools; every gate answer in that walk comes from the product.

Units and names:

* memory in the seed's dicts is in GB; it is compared as given (both sides in the same unit)
  and with no headroom (the seed's ``required_memory_gb`` is the whole requirement);
* cache sizes are decimal MB (link rates are decimal Gb/s: 100 MB x 8 / 200 Gb/s = 4.0 ms);
* the seed names a KV state by its dtype and layout only (``float16``, ``paged-v1``...);
  they become two KV formats alike in every other field, negotiated from the request's
  (the state it brings) to the pool's. A pool takes the KV (``can_accept_kv``) only as it
  is, which no cast policy changes; the seed has no cast policy, so the formats are
  negotiated under one that permits every cast and a reason names what differs
  (``kv_dtype_mismatch``), not a deployment's refusal of a lossy cast
  (``kv_dtype_narrowing_not_allowed`` under the default policy).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from hpd_common.kvformat import KvDtype, KvFormat, KvLayout, KvPolicy, negotiate
from hpd_scheduler.policy.domain import DecisionKind, Health, Mode, Role, Stage
from hpd_scheduler.policy.errors import InvalidInputError
from hpd_scheduler.policy.links import Link
from hpd_scheduler.policy.mechanisms import (
    Capability,
    classify_need,
    execution_reasons,
    handoff_mode,
    kv_reasons,
)
from hpd_scheduler.policy.serving import SEED_LADDER, select_action

__all__ = [
    "build_route_record",
    "choose_handoff_mode",
    "classify_resource_need",
    "evaluate_pool_capability",
    "plan_route_with_fallback",
    "select_serving_action",
]

E = TypeVar("E", bound=enum.Enum)

BYTES_PER_MB = 1_000_000
"""Decimal megabyte (module docstring)."""

_SEED_FIELDS = {"link.gbps": "link_gbps", "link.latency_ms": "link_latency_ms"}
"""The product's field names in InvalidInputError, as the seed's arguments name them."""

_DTYPES = {"float32": KvDtype.FP32, "float16": KvDtype.FP16, "bfloat16": KvDtype.BF16}
_LAYOUTS = {"paged-v1": KvLayout.PAGED_NHD, "contiguous": KvLayout.CONTIGUOUS}
"""The seed's KV names; the product's own names (``fp16``, ``paged_nhd``...) are taken too."""

_ALL_CASTS = KvPolicy(allow_lossy_narrowing=True)
"""The cast policy the seed's KV states are negotiated under (module docstring)."""


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
    """``{'mode', 'transfer_ms' (rounded to 4 places), 'recompute_ms' (as given)}``: the
    link's transfer time for the cache (``Link.transfer_ms``, no setup latency), then the
    planner's hand-off rule (``handoff_mode``)."""
    if not cache_transfer_mb >= 0:
        raise InvalidInputError("cache_transfer_mb", f"must be >= 0, got {cache_transfer_mb}")
    if not recompute_ms >= 0:
        raise InvalidInputError("recompute_ms", f"must be >= 0, got {recompute_ms}")
    try:
        link = Link(gbps=float(link_gbps), latency_ms=0.0)
    except InvalidInputError as exc:
        raise InvalidInputError(_SEED_FIELDS.get(exc.field, exc.field), exc.message) from None
    transfer = link.transfer_ms(cache_transfer_mb * BYTES_PER_MB)
    return {
        "mode": handoff_mode(transfer, recompute_ms).value,
        "transfer_ms": round(transfer, 4),
        "recompute_ms": recompute_ms,
    }


def _named(raw: object, key: str, kind: type[E], names: Mapping[str, E] | None = None) -> E:
    """The product's enum member for the seed's name ``raw`` (of the field ``key``)."""
    name = str(raw)
    if names is not None and name in names:
        return names[name]
    try:
        return kind(name)
    except ValueError:
        raise InvalidInputError(key, f"unknown name {name!r}") from None


def _kv_format(data: Mapping[str, Any]) -> KvFormat:
    """A KV format with the seed's dtype and layout; every other field the same for all."""
    return KvFormat(
        dtype=_named(data.get("kv_dtype", ""), "kv_dtype", KvDtype, _DTYPES),
        layout=_named(data.get("kv_layout", ""), "kv_layout", KvLayout, _LAYOUTS),
        block_size_tokens=16,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
    )


def _stage(pool: Mapping[str, Any]) -> Stage:
    """The product's stage for the seed's ``supported_stages`` list."""
    roles = {_named(s, "supported_stages", Role) for s in pool.get("supported_stages", [])}
    if not roles:
        raise InvalidInputError("supported_stages", "must name prefill and/or decode")
    if len(roles) == 2:
        return Stage.BOTH
    return Stage(roles.pop().value)


def _capability(request: Mapping[str, Any], pool: Mapping[str, Any]) -> Capability:
    """The product's two gates for the seed's request on the seed's pool."""
    execution = execution_reasons(
        health=Health.HEALTHY if bool(pool.get("healthy", False)) else Health.UNHEALTHY,
        stage=_stage(pool),
        role=_named(request.get("stage", "decode"), "stage", Role),
        pinned_revision=str(request.get("model_revision", "")),
        served_revision=str(pool.get("model_revision", "")),
        available_bytes=float(pool.get("available_memory_gb", 0.0)),
        need_bytes=float(request.get("required_memory_gb", 0.0)),
        headroom=1.0,
    )
    kv = kv_reasons(negotiate(_kv_format(request), _kv_format(pool), _ALL_CASTS))
    return Capability(execution_reasons=execution, kv_reasons=kv)


def evaluate_pool_capability(
    request: Mapping[str, Any], pool: Mapping[str, Any]
) -> dict[str, object]:
    """``{'pool_id', 'can_execute', 'can_accept_kv', 'reasons'}``."""
    cap = _capability(request, pool)
    return {
        "pool_id": str(pool.get("pool_id", "unknown")),
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
    ``'none'`` for pool and mode on reject.

    The primary pool, then the fallbacks in order; the first that can execute wins
    (decision PRIMARY for the primary, REROUTE for a fallback). On it a preferred transfer
    becomes a recompute when it cannot take the KV as it is: the pool is kept, not dropped.
    None can execute: REJECT with ``no_executable_pool`` and every pool's reasons.
    """
    if preferred_handoff not in (Mode.TRANSFER, Mode.RECOMPUTE):
        raise InvalidInputError("preferred_handoff", "must be transfer or recompute")
    preferred = Mode(preferred_handoff)
    rejected: dict[str, list[str]] = {}
    for index, pool in enumerate((primary_pool, *fallback_pools)):
        pool_id = str(pool.get("pool_id", "unknown"))
        cap = _capability(request, pool)
        if not cap.can_execute:
            rejected[pool_id] = list(cap.reasons)
            continue
        mode = preferred
        if preferred is Mode.TRANSFER and not cap.can_accept_kv:
            mode = Mode.RECOMPUTE
        return {
            "selected_pool": pool_id,
            "execution_mode": mode.value,
            "decision": (DecisionKind.PRIMARY if index == 0 else DecisionKind.REROUTE).value,
            "reasons": list(cap.reasons),
            "rejected_pools": rejected,
        }
    return {
        "selected_pool": "none",
        "execution_mode": "none",
        "decision": DecisionKind.REJECT.value,
        "reasons": ["no_executable_pool"],
        "rejected_pools": rejected,
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
