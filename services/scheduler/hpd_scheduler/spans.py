"""What a Schedule span says about the decision: aggregate attributes only.

The span is the Schedule call's (the server interceptor's for a unary call, the stream
item's for ``ScheduleStream``; ``hpd_common.tracing``). It gets the decision's kind, the
mode and the workers chosen, and how many candidates and options were scored, never one
attribute per candidate: a fleet of hundreds would make every span as large as the route
record's explanation, which is where the per-candidate detail lives.

Nothing is built while tracing is off (one flag read per call).
"""

from __future__ import annotations

from hpd_common import tracing
from hpd_scheduler.policy import Decision, RoutePlan

__all__ = ["note_decision"]


def note_decision(
    decision: Decision, plan: RoutePlan | None = None, session: str = "", mode_reason: str = ""
) -> None:
    """The decision's attributes on the current span. ``plan``: the plan as served (after
    a broker that refused the transfer made it a recompute), else the planner's."""
    if not tracing.enabled():
        return
    span = tracing.current_span()
    if not span.is_recording():
        return
    rec = decision.record
    p = plan if plan is not None else decision.plan
    span.set_attributes({
        "hpd.decision": decision.kind.value,
        "hpd.tier": rec.tier,
        "hpd.resource_need": decision.resource_need.value,
        "hpd.candidates.prefill": len(rec.prefill_candidates),
        "hpd.candidates.decode": len(rec.decode_candidates),
        "hpd.options": len(rec.options),
        "hpd.rejected_workers": len(rec.rejected_workers),
        "hpd.fallbacks": len(decision.fallbacks),
    })  # fmt: skip
    if p is not None:
        span.set_attributes({
            "hpd.mode": p.mode.value,
            "hpd.prefill_worker_id": p.prefill_worker_id,
            "hpd.prefill_pool_id": p.prefill_pool_id,
            "hpd.decode_worker_id": p.decode_worker_id,
            "hpd.decode_pool_id": p.decode_pool_id,
            "hpd.cached_tokens": p.cached_tokens,
            "hpd.est_ttft_ms": round(p.estimates.ttft_ms, 3),
            "hpd.kv_bytes": p.estimates.kv_bytes,
        })  # fmt: skip
    if decision.reject_class:
        span.set_attribute("hpd.reject_class", decision.reject_class)
        span.set_attribute("hpd.reject_reasons", list(decision.reject_reasons))
    if session:
        span.set_attribute("hpd.kv_session_id", session)
    if mode_reason:
        span.set_attribute("hpd.mode_reason", mode_reason)
