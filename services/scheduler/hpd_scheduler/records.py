"""Route record heads: the plan as stored (and replayed) JSON. Pure.

A record has a small *head* written on the hot path with the reservation (the plan, the
decision, the serving action, the seed's six-field summary; it doubles as the idempotency
key, so a retried Schedule replays exactly this) and a larger *explanation* (every scored
candidate's factors, the weights, the ranked options, rejected workers and pools) written
just after, off the hot path. Both live in the record's Redis hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from hpd_scheduler.policy import Decision, Estimates, FallbackStep, Mode, Request, RoutePlan

__all__ = ["as_recompute", "head_of"]


def _r(x: float) -> float:
    return round(x, 3)


def as_recompute(
    plan: RoutePlan, fallbacks: tuple[FallbackStep, ...]
) -> tuple[RoutePlan, tuple[FallbackStep, ...]]:
    """A TRANSFER plan turned into recompute on its decode worker (e.g. the broker could
    not open the transfer session). The planner's first fallback of a transfer is exactly
    that recompute, with ``est = primary ttft + (decode wait + recompute)``; so the new
    TTFT is ``est - primary ttft`` and that step leaves the chain."""
    e = plan.estimates
    ttft = e.recompute_ms
    rest = fallbacks
    if fallbacks and fallbacks[0].reason == "kv_transfer_failed":
        ttft = max(e.recompute_ms, fallbacks[0].est_ttft_ms - e.ttft_ms)
        rest = fallbacks[1:]
    est = dataclasses.replace(
        e,
        transfer_ms=None,
        conversion_ms=0.0,
        prefill_wait_ms=max(0.0, ttft - e.recompute_ms),
        prefill_ms=e.recompute_ms,
        ttft_ms=ttft,
    )
    new = dataclasses.replace(
        plan,
        mode=Mode.RECOMPUTE,
        prefill_worker_id=plan.decode_worker_id,
        prefill_pool_id=plan.decode_pool_id,
        prefill_endpoint=plan.decode_endpoint,
        estimates=est,
    )
    return new, rest


def estimates_of(e: Estimates) -> dict[str, Any]:
    """A plan's estimates as its record keeps them (what the learner reads back)."""
    return {
        "kv_bytes": e.kv_bytes,
        "transfer_ms": None if e.transfer_ms is None else _r(e.transfer_ms),
        "recompute_ms": _r(e.recompute_ms),
        "conversion_ms": _r(e.conversion_ms),
        "prefill_wait_ms": _r(e.prefill_wait_ms),
        "prefill_ms": _r(e.prefill_ms),
        "ttft_ms": _r(e.ttft_ms),
        "tpot_ms": _r(e.tpot_ms),
        "prefill_nominal_ms": _r(e.prefill_nominal_ms),
        "prefill_ahead": _r(e.prefill_ahead),
        "decode_nominal_ms": float(f"{e.decode_nominal_ms:.6g}"),  # can be tiny
        "decode_others": _r(e.decode_others),
        "decode_step_ms": _r(e.decode_step_ms),
        "decode_duty": _r(e.decode_duty),
    }


def head_of(
    decision: Decision,
    request: Request,
    tier: str,
    created_at_ms: int,
    scheduler_id: str,
    plan: RoutePlan | None = None,
    fallbacks: tuple[FallbackStep, ...] | None = None,
    kv_session_id: str = "",
    mode_reason: str = "",
    reservation_expires_at_ms: int = 0,
    caller: str = "",
    trace_id: str = "",
) -> dict[str, Any]:
    """The record head (JSON-ready). ``plan`` / ``fallbacks`` override the decision's
    (after a broker-forced recompute)."""
    p = plan if plan is not None else decision.plan
    chain = fallbacks if fallbacks is not None else decision.fallbacks
    action = decision.action
    plan_d: dict[str, Any] | None = None
    if p is not None:
        plan_d = {
            "mode": p.mode.value,
            "prefill_worker_id": p.prefill_worker_id,
            "prefill_pool_id": p.prefill_pool_id,
            "prefill_endpoint": p.prefill_endpoint,
            "decode_worker_id": p.decode_worker_id,
            "decode_pool_id": p.decode_pool_id,
            "decode_endpoint": p.decode_endpoint,
            "prefill_tokens": p.prefill_tokens,
            "cached_tokens": p.cached_tokens,
            "reserved_kv_bytes": p.decode_kv_bytes,
            "reservation_expires_at_ms": reservation_expires_at_ms,
            "kv_session_id": kv_session_id,
            "mode_reason": mode_reason,
            "estimates": estimates_of(p.estimates),
            "fallbacks": [f.to_dict() for f in chain],
        }
    summary = decision.route_record()
    if p is not None:
        summary["execution_mode"] = p.mode.value
    return {
        "request_id": request.request_id,
        "model_id": request.model_id,
        "tier": tier,
        "created_at_ms": created_at_ms,
        "decision": decision.kind.value,
        "resource_need": decision.resource_need.value,
        "plan": plan_d,
        "serving_action": {
            "action": action.action.value,
            "protects": action.protects.value,
            "ladder_steps": [s.action.value for s in action.steps],
        },
        "reject_reasons": list(decision.reject_reasons),
        "reject_class": decision.reject_class or "",
        "retry_after_ms": decision.retry_after_ms,
        "summary": summary,
        "scheduler_id": scheduler_id,
        "request_digest": request_digest(request),
        # who asked (auth on): only they, or an operator, may report its outcome
        "caller": caller,
        # the trace it was planned in (hpd_common.tracing), kept only when there is one
        **({"trace_id": trace_id} if trace_id else {}),
    }


def request_digest(request: Request) -> str:
    """What a request asked for, as a short digest: a retry under the same id must ask for
    the same (``Schedule`` is idempotent per id, not a way to change a request)."""
    fields: list[Any] = [
        request.model_id,
        request.prompt_tokens,
        request.expected_output_tokens,
        request.tier,
        list(request.prefix_hints),
        request.model_revision,
        request.preferred_pool,
    ]
    if request.prefix_blocks:  # only then: earlier records' digests stay valid
        fields += [request.prefix_block_tokens, list(request.prefix_blocks)]
    body = json.dumps(fields, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:16]
