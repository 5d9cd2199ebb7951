"""What a decision hands out: the chosen option as a route plan, and the fallback chain of
the options ranked after it."""

from __future__ import annotations

from .decision import Estimates, FallbackStep, RoutePlan
from .domain import Mode, Request, ResourceNeed, Tier
from .framework import Option

__all__ = ["fallback_chain", "plan_of"]


def plan_of(o: Option, request: Request, need: ResourceNeed) -> RoutePlan:
    """The route plan of the chosen option, with its estimates."""
    p, d = o.p, o.d
    transfer = o.mode is Mode.TRANSFER
    ws = p.ws
    ahead = ws.requests_ahead()
    # the declared model's time of the queue and the request: the estimate less the fixed
    # costs it priced (the request's own and the queue's share of theirs)
    fixed = ws.p_fixed + (ws.backlog_tokens + ws.live_tokens) * ws.fixed_per_token
    nominal = (p.wait_ms + p.run_ms - fixed) / ws.m_p
    # the declared model's decode step: the estimate less the learned cost per sequence
    dws = d.ws
    seqs = dws.step_sequences()
    step_nominal = (d.step_ms - dws.d_seq * seqs) / dws.m_d if d.step_ms > 0 else 0.0
    return RoutePlan(
        resource_need=need,
        mode=o.mode,
        prefill_worker_id=p.ws.worker_id,
        prefill_pool_id=p.ws.pool_id,
        prefill_endpoint=p.ws.view.endpoint,
        decode_worker_id=d.ws.worker_id,
        decode_pool_id=d.ws.pool_id,
        decode_endpoint=d.ws.view.endpoint,
        decode_kv_bytes=d.kv_need,
        prefill_tokens=request.prompt_tokens - p.cached_tokens,
        cached_tokens=p.cached_tokens,
        estimates=Estimates(
            kv_bytes=(request.prompt_tokens - d.cached_tokens) * p.ws.cap.kv_bytes_per_token,
            transfer_ms=o.transfer_ms if transfer else None,
            recompute_ms=o.recompute_ms,
            conversion_ms=o.conversion_ms,
            prefill_wait_ms=p.wait_ms,
            prefill_ms=p.run_ms,
            ttft_ms=o.ttft_ms,
            tpot_ms=o.tpot_ms or d.step_ms,
            prefill_nominal_ms=max(nominal, 0.0),
            prefill_ahead=ahead,
            decode_nominal_ms=max(step_nominal, 0.0),
            decode_others=float(seqs - 1),
            decode_step_ms=d.step_ms,
            decode_duty=dws.duty,
        ),
    )


def fallback_chain(
    chosen: Option, rest: list[Option], tier: Tier, limit: int
) -> tuple[FallbackStep, ...]:
    """At most ``limit`` fallback steps after ``chosen``: its decode worker's own recompute
    when it transfers, then the next options on other decode workers (a shared pool first,
    once), each with its reason and predicted TTFT."""
    steps: list[FallbackStep] = []
    if limit <= 0:
        return ()
    used = {chosen.d.ws.worker_id}
    if chosen.mode is Mode.TRANSFER:
        d = chosen.d
        recompute_ttft = d.wait_ms + chosen.recompute_ms
        est = chosen.ttft_ms + recompute_ttft
        steps.append(
            FallbackStep(
                Mode.RECOMPUTE,
                d.ws.worker_id,
                d.ws.worker_id,
                d.ws.pool_id,
                "kv_transfer_failed",
                est,
                tier.ttft_ms - est,
            )
        )
    have_shared = False
    for o in rest:
        if len(steps) >= limit:
            break
        wid = o.d.ws.worker_id
        if wid in used:
            continue
        used.add(wid)
        if o.mode is Mode.SAME_POOL and not have_shared and chosen.mode is not Mode.SAME_POOL:
            reason = "shared_pool"
            have_shared = True
        elif o.d.ws.pool_id != chosen.d.ws.pool_id:
            reason = "next_pool"
        else:
            reason = "next_best_pair"
        steps.append(
            FallbackStep(
                o.mode,
                o.p.ws.worker_id,
                wid,
                o.d.ws.pool_id,
                reason,
                o.ttft_ms,
                tier.ttft_ms - o.ttft_ms,
            )
        )
    return tuple(steps[:limit])
