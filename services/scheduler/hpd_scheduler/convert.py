"""Protobuf <-> scheduler values, with the edge validation of every request field.

Route records travel as JSON-ready dicts (the record head, see `records.py`); these
functions turn them into messages. Validation errors name the field (INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf import struct_pb2

from hetero_pd.v1 import scheduler_pb2 as s
from hpd_common.errors import InvalidArgument
from hpd_common.ids import check_id
from hpd_scheduler.directives import Recommendations
from hpd_scheduler.policy import Request
from hpd_scheduler.policy.domain import (
    MAX_AVOID_WORKERS,
    MAX_PREFIX_BLOCK_TOKENS,
    MAX_PREFIX_BLOCKS,
)
from hpd_scheduler.record_queries import RecordQuery
from hpd_scheduler.settings import PolicyState
from hpd_scheduler.store import UNREADABLE_EXPLANATION, StoredRecord

MAX_TOKENS = 10_000_000
MAX_MS = 1e7
MAX_HINTS = 64

MODE_TO_PB: dict[str, s.ExecutionMode] = {
    "transfer": s.EXECUTION_MODE_TRANSFER,
    "recompute": s.EXECUTION_MODE_RECOMPUTE,
    "same_pool": s.EXECUTION_MODE_SAME_POOL,
}
MODE_FROM_PB: dict[int, str] = {v: k for k, v in MODE_TO_PB.items()}
NEED_TO_PB: dict[str, s.ResourceNeed] = {
    "prefill": s.RESOURCE_NEED_PREFILL,
    "decode": s.RESOURCE_NEED_DECODE,
    "shared": s.RESOURCE_NEED_SHARED,
}
DECISION_TO_PB: dict[str, s.RouteDecision] = {
    "primary": s.ROUTE_DECISION_PRIMARY,
    "reroute": s.ROUTE_DECISION_REROUTE,
    "reject": s.ROUTE_DECISION_REJECT,
}
DECISION_FROM_PB: dict[int, str] = {v: k for k, v in DECISION_TO_PB.items()}


def _text(field: str, value: str, max_len: int, required: bool = False) -> None:
    if required and not value:
        raise InvalidArgument(field, "is required")
    if len(value) > max_len:
        raise InvalidArgument(field, f"at most {max_len} characters")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise InvalidArgument(field, "must not contain control characters")


def _ms(field: str, value: float) -> float:
    if not math.isfinite(value) or value < 0 or value > MAX_MS:
        raise InvalidArgument(field, f"must be a finite number in [0, {MAX_MS:g}] ms")
    return float(value)


def request_from_pb(m: s.ScheduleRequest) -> Request:
    """A validated policy Request; the first invalid field raises InvalidArgument."""
    check_id("request_id", m.request_id)
    _text("model_id", m.model_id, 128, required=True)
    if not 1 <= m.prompt_tokens <= MAX_TOKENS:
        raise InvalidArgument("prompt_tokens", f"must be in [1, {MAX_TOKENS}]")
    if m.expected_output_tokens > MAX_TOKENS:
        raise InvalidArgument("expected_output_tokens", f"must be in [0, {MAX_TOKENS}]")
    _text("tier", m.tier, 64)
    if len(m.prefix_hints) > MAX_HINTS:
        raise InvalidArgument("prefix_hints", f"at most {MAX_HINTS} entries")
    for i, hint in enumerate(m.prefix_hints):
        _text(f"prefix_hints[{i}]", hint, 128, required=True)
    if len(m.avoid_workers) > MAX_AVOID_WORKERS:
        raise InvalidArgument("avoid_workers", f"at most {MAX_AVOID_WORKERS} entries")
    for i, wid in enumerate(m.avoid_workers):
        _text(f"avoid_workers[{i}]", wid, 128, required=True)
    _text("model_revision", m.model_revision, 128)
    _text("preferred_pool", m.preferred_pool, 128)
    blocks = tuple(m.prefix_block_hashes)
    if len(blocks) > MAX_PREFIX_BLOCKS:
        raise InvalidArgument("prefix_block_hashes", f"at most {MAX_PREFIX_BLOCKS} entries")
    if blocks and not 1 <= m.prefix_block_tokens <= MAX_PREFIX_BLOCK_TOKENS:
        raise InvalidArgument(
            "prefix_block_tokens", f"must be in [1, {MAX_PREFIX_BLOCK_TOKENS}] with hashes"
        )
    return Request(
        request_id=m.request_id,
        model_id=m.model_id,
        prompt_tokens=int(m.prompt_tokens),
        expected_output_tokens=int(m.expected_output_tokens),
        tier=m.tier,
        prefix_hints=tuple(m.prefix_hints),
        model_revision=m.model_revision,
        preferred_pool=m.preferred_pool,
        prefix_blocks=blocks,
        prefix_block_tokens=int(m.prefix_block_tokens) if blocks else 0,
        avoid_workers=tuple(m.avoid_workers),
    )


def outcome_from_pb(m: s.ReportOutcomeRequest) -> dict[str, Any]:
    """A validated outcome as stored with the record."""
    check_id("request_id", m.request_id)
    _text("error_class", m.error_class, 64, required=not m.success)
    if m.mode_used and m.mode_used not in MODE_FROM_PB:
        raise InvalidArgument("mode_used", f"unknown value {m.mode_used}")
    if m.output_tokens > MAX_TOKENS:
        raise InvalidArgument("output_tokens", f"must be in [0, {MAX_TOKENS}]")
    return {
        "success": bool(m.success),
        "error_class": m.error_class,
        "ttft_ms": _ms("ttft_ms", m.ttft_ms),
        "tpot_ms": _ms("tpot_ms", m.tpot_ms),
        "mode_used": MODE_FROM_PB.get(m.mode_used, ""),
        "prefill_ms": _ms("prefill_ms", m.prefill_ms),
        "transfer_ms": _ms("transfer_ms", m.transfer_ms),
        "output_tokens": int(m.output_tokens),
    }


def query_from_pb(m: s.ListRouteRecordsRequest) -> tuple[RecordQuery, int]:
    """Filters and the page size (1..1000; 0 = 50)."""
    if m.since_unix_ms < 0:
        raise InvalidArgument("since_unix_ms", "must be >= 0")
    if m.until_unix_ms < 0:
        raise InvalidArgument("until_unix_ms", "must be >= 0")
    if m.until_unix_ms and m.until_unix_ms < m.since_unix_ms:
        raise InvalidArgument("until_unix_ms", "must be >= since_unix_ms")
    _text("tier", m.tier, 64)
    if m.worker_id:
        check_id("worker_id", m.worker_id)
    _text("model_id", m.model_id, 128)
    if m.decision and m.decision not in DECISION_FROM_PB:
        raise InvalidArgument("decision", f"unknown value {m.decision}")
    if m.mode and m.mode not in MODE_FROM_PB:
        raise InvalidArgument("mode", f"unknown value {m.mode}")
    if m.page_size > 1000:
        raise InvalidArgument("page_size", "must be in [0, 1000]")
    _text("page_token", m.page_token, 300)
    q = RecordQuery(
        since_ms=int(m.since_unix_ms),
        until_ms=int(m.until_unix_ms),
        tier=m.tier,
        worker_id=m.worker_id,
        decision=DECISION_FROM_PB.get(m.decision, ""),
        mode=MODE_FROM_PB.get(m.mode, ""),
        model_id=m.model_id,
    )
    return q, int(m.page_size or 50)


def _action_pb(a: Mapping[str, Any]) -> s.ServingAction:
    return s.ServingAction(
        action=str(a.get("action", "")),
        protects=str(a.get("protects", "")),
        ladder_steps=[str(x) for x in a.get("ladder_steps", [])],
    )


def plan_to_pb(head: Mapping[str, Any]) -> s.RoutePlan:
    """The plan of a record head (a rejection gives a plan with only the decision set)."""
    p = head.get("plan") or {}
    out = s.RoutePlan(
        request_id=str(head.get("request_id", "")),
        resource_need=NEED_TO_PB.get(str(head.get("resource_need")), s.RESOURCE_NEED_UNSPECIFIED),
        decision=DECISION_TO_PB.get(str(head.get("decision")), s.ROUTE_DECISION_UNSPECIFIED),
        serving_action=_action_pb(head.get("serving_action") or {}),
        route_record_id=str(head.get("request_id", "")),
        tier=str(head.get("tier", "")),
        planned_at_unix_ms=int(head.get("created_at_ms") or 0),
    )
    if not p:
        return out
    e = p.get("estimates") or {}
    out.mode = MODE_TO_PB.get(str(p.get("mode")), s.EXECUTION_MODE_UNSPECIFIED)
    out.prefill_worker_id = str(p.get("prefill_worker_id", ""))
    out.prefill_pool_id = str(p.get("prefill_pool_id", ""))
    out.prefill_endpoint = str(p.get("prefill_endpoint", ""))
    out.decode_worker_id = str(p.get("decode_worker_id", ""))
    out.decode_pool_id = str(p.get("decode_pool_id", ""))
    out.decode_endpoint = str(p.get("decode_endpoint", ""))
    out.kv_session_id = str(p.get("kv_session_id", ""))
    out.mode_reason = str(p.get("mode_reason", ""))
    out.reserved_kv_bytes = int(p.get("reserved_kv_bytes") or 0)
    out.cached_tokens = int(p.get("cached_tokens") or 0)
    out.reservation_expires_at_unix_ms = int(p.get("reservation_expires_at_ms") or 0)
    out.estimates.CopyFrom(
        s.Estimates(
            kv_bytes=int(e.get("kv_bytes") or 0),
            transfer_ms=float(e.get("transfer_ms") or 0.0),
            recompute_ms=float(e.get("recompute_ms") or 0.0),
            conversion_ms=float(e.get("conversion_ms") or 0.0),
            prefill_wait_ms=float(e.get("prefill_wait_ms") or 0.0),
            prefill_ms=float(e.get("prefill_ms") or 0.0),
            ttft_ms=float(e.get("ttft_ms") or 0.0),
            tpot_ms=float(e.get("tpot_ms") or 0.0),
        )
    )
    for f in p.get("fallbacks") or []:
        out.fallbacks.append(
            s.FallbackStep(
                mode=MODE_TO_PB.get(str(f.get("mode")), s.EXECUTION_MODE_UNSPECIFIED),
                prefill_worker_id=str(f.get("prefill_worker_id", "")),
                decode_worker_id=str(f.get("decode_worker_id", "")),
                decode_pool_id=str(f.get("decode_pool_id", "")),
                reason=str(f.get("reason", "")),
                est_ttft_ms=float(f.get("est_ttft_ms") or 0.0),
                remaining_budget_ms=float(f.get("remaining_budget_ms") or 0.0),
            )
        )
    return out


def record_to_pb(rec: StoredRecord) -> s.RouteRecord:
    h = rec.head
    out = s.RouteRecord(
        request_id=str(h.get("request_id", "")),
        model_id=str(h.get("model_id", "")),
        tier=str(h.get("tier", "")),
        created_at_unix_ms=int(h.get("created_at_ms") or 0),
        decision=DECISION_TO_PB.get(str(h.get("decision")), s.ROUTE_DECISION_UNSPECIFIED),
        resource_need=NEED_TO_PB.get(str(h.get("resource_need")), s.RESOURCE_NEED_UNSPECIFIED),
        serving_action=_action_pb(h.get("serving_action") or {}),
        reject_reasons=[str(x) for x in h.get("reject_reasons") or []],
        reject_class=str(h.get("reject_class") or ""),
        summary={str(k): str(v) for k, v in (h.get("summary") or {}).items()},
        scheduler_id=str(h.get("scheduler_id", "")),
        trace_id=str(h.get("trace_id") or ""),
    )
    if h.get("plan"):
        out.plan.CopyFrom(plan_to_pb(h))
    if rec.explanation is not None:
        st = struct_pb2.Struct()
        try:
            st.update(rec.explanation)
        except (ValueError, TypeError, AttributeError):  # decoded, but not Struct-shaped
            st = struct_pb2.Struct()
            st.update(UNREADABLE_EXPLANATION)
        out.explanation.CopyFrom(st)
    o = rec.outcome
    if o is not None:
        out.outcome.CopyFrom(
            s.Outcome(
                success=bool(o.get("success")),
                error_class=str(o.get("error_class", "")),
                ttft_ms=float(o.get("ttft_ms") or 0.0),
                tpot_ms=float(o.get("tpot_ms") or 0.0),
                mode_used=MODE_TO_PB.get(str(o.get("mode_used")), s.EXECUTION_MODE_UNSPECIFIED),
                prefill_ms=float(o.get("prefill_ms") or 0.0),
                transfer_ms=float(o.get("transfer_ms") or 0.0),
                output_tokens=int(o.get("output_tokens") or 0),
                reported_at_unix_ms=int(o.get("reported_at_ms") or 0),
            )
        )
    return out


def policy_to_pb(state: PolicyState) -> s.Policy:
    p = state.profile
    return s.Policy(
        profile=p.name,
        pairing=p.pairing,
        prefill_weights=p.prefill.weights(),
        decode_weights=p.decode.weights(),
        tiers=[
            s.Tier(
                name=t.name,
                ttft_ms=t.ttft_ms,
                tpot_ms=t.tpot_ms,
                queue_budget_ms=t.queue_budget_ms,
                priority=t.priority,
                may_throttle=t.may_throttle,
                may_shed=t.may_shed,
                hard_ttft_ms=t.hard_ttft_ms or 0.0,
            )
            for t in sorted(p.tiers.values(), key=lambda t: (-t.priority, t.name))
        ],
        default_tier=p.default_tier,
        source_yaml=state.source_yaml,
        generation=state.generation,
        loaded_at_unix_ms=state.loaded_at_ms,
    )


def recommendations_to_pb(recs: Recommendations) -> s.GetRecommendationsResponse:
    out = s.GetRecommendationsResponse(computed_at_unix_ms=recs.computed_at_ms)
    for m in recs.models:
        mr = s.ModelRecommendations(
            model_id=m.model_id, imbalanced=m.rebalance.imbalanced, mean_load=m.rebalance.mean_load
        )
        for mv in m.rebalance.moves:
            mr.moves.append(
                s.RebalanceMove(
                    src_worker_id=mv.src,
                    dst_worker_id=mv.dst,
                    fraction=mv.fraction,
                    requests=mv.requests,
                )
            )
        for wid, current, b, itl, target in m.batch:
            mr.batch_sizes.append(
                s.BatchSizeRecommendation(
                    worker_id=wid,
                    current_max_batch_size=current,
                    recommended_max_batch_size=b.max_batch_size,
                    change=b.change.value,
                    reason=b.reason,
                    itl_p99_ms=itl,
                    target_itl_ms=target,
                )
            )
        out.models.append(mr)
    for w in recs.workers:
        out.workers.append(
            s.WorkerEstimate(
                worker_id=w.worker_id,
                prefill_tokens_per_s=w.prefill_tokens_per_s,
                itl_ms=w.itl_ms,
                samples=w.samples,
                reserved_kv_bytes=w.reserved.kv_bytes,
                reserved_requests=w.reserved.requests,
                load=w.load,
                learned_prefill_fixed_ms=w.learned.fixed_ms if w.learned else 0.0,
                learned_prefill_scale=w.learned.scale if w.learned else 0.0,
                learned_prefill_samples=w.learned.samples if w.learned else 0,
                learned_prefill_queue_share=w.learned.queue_share if w.learned else 0.0,
                learned_decode_scale=w.learned_step.scale if w.learned_step else 0.0,
                learned_decode_seq_ms=w.learned_step.seq_ms if w.learned_step else 0.0,
                learned_decode_samples=w.learned_step.samples if w.learned_step else 0,
            )
        )
    for src, dst, gbps, n in recs.links:
        out.links.append(s.LinkEstimate(src_pool_id=src, dst_pool_id=dst, gbps=gbps, samples=n))
    return out
