"""The answers to `Schedule` other than a fresh plan: a refusal (RESOURCE_EXHAUSTED with
a retry delay, or FAILED_PRECONDITION naming what no worker can do), always with its REJECT
record, and the stored answer to a retried request id."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hpd_common import auth
from hpd_common.errors import (
    AlreadyExists,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
)
from hpd_common.logging import get_logger
from hpd_common.tracing import current_trace_id
from hpd_scheduler import metrics
from hpd_scheduler.policy import (
    Action,
    Decision,
    DecisionKind,
    Protects,
    RejectClass,
    Request,
    ServingAction,
)
from hpd_scheduler.records import head_of, request_digest
from hpd_scheduler.snapshot import SchedulerState
from hpd_scheduler.spans import note_decision
from hpd_scheduler.store import (
    ReserveEntry,
    ReserveStatus,
)

log = get_logger("scheduler")


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    head: dict[str, Any]
    replayed: bool


def caller_name() -> str:
    """The name of the caller being served (auth on), else ''."""
    who = auth.current()
    return who.name if who is not None else ""


class ScheduleAnswers(SchedulerState):
    """Refusals and replays (module docstring)."""

    scheduler_id: str

    def _refusal(self, decision: Decision, tier_budget_ms: float) -> Exception:
        reasons = ", ".join(decision.reject_reasons) or "no_executable_pool"
        cls = decision.reject_class or RejectClass.SATURATED
        metrics.REJECTIONS.labels(reject_class=cls).inc()
        if cls == RejectClass.NO_CAPABLE_WORKER:
            pools = decision.record.rejected_pools
            detail = "; ".join(f"{k}: {','.join(v)}" for k, v in sorted(pools.items()))
            lead = {
                "no_worker_for_model": "the model has no worker in the fleet",
                "no_decode_worker_for_model": (
                    "the model has prefill workers but no worker that can decode"
                ),
            }.get(decision.reject_reasons[0] if decision.reject_reasons else "")
            return FailedPrecondition(
                f"{lead or 'no worker can serve this request'} ({reasons})"
                + (f" [{detail}]" if detail else ""),
                {k: list(v) for k, v in pools.items()},
            )
        retry = decision.retry_after_ms if decision.retry_after_ms is not None else tier_budget_ms
        return ResourceExhausted(f"{cls}: {reasons}", retry_after_ms=max(1, int(retry)))

    async def _refuse_fully_reserved(
        self, decision: Decision, req: Request, tier_name: str, queue_budget_ms: float
    ) -> ScheduleResult:
        """Every attempt found its decode worker full: refused, and recorded as refused like
        any other reject (a refused request always has its REJECT record)."""
        retry_ms = max(1, int(queue_budget_ms))
        refused = dataclasses.replace(
            decision,
            kind=DecisionKind.REJECT,
            plan=None,
            fallbacks=(),
            action=ServingAction(Action.REJECT, Protects.LATENCY),
            reject_reasons=("decode_workers_fully_reserved",),
            reject_class=RejectClass.SATURATED,
            retry_after_ms=float(retry_ms),
        )
        replayed = await self._record_reject(refused, req, tier_name, self.clock.now_ms())
        if replayed is not None:
            return replayed
        metrics.REJECTIONS.labels(reject_class=RejectClass.SATURATED).inc()
        raise ResourceExhausted(
            "saturated: every capable decode worker is fully reserved",
            retry_after_ms=retry_ms,
        )

    async def _record_reject(
        self, decision: Decision, req: Request, tier: str, now_ms: int
    ) -> ScheduleResult | None:
        """Write a refusal's REJECT record (a refused request always has one; a Redis that
        cannot take it is logged, the refusal stands). Returns the stored answer instead
        when the request id was already decided (a retry)."""
        s = self.settings
        note_decision(decision)  # the Schedule span's attributes (none while tracing is off)
        head = head_of(
            decision, req, tier, now_ms, self.scheduler_id, caller=caller_name(),
            trace_id=current_trace_id(),
        )  # fmt: skip
        try:
            res = await self.commits.reserve(ReserveEntry(
                req.request_id, head, "reject", None, now_ms,
                s.reservation_ttl_ms, s.record_ttl_ms,
            ))  # fmt: skip
        except Unavailable:
            log.warning("reject_record_lost", request_id=req.request_id)
            return None
        if res.status is ReserveStatus.REPLAY and res.head is not None:
            return self._replay(res.head, req)
        return None

    @staticmethod
    def _replay(head: dict[str, Any], req: Request) -> ScheduleResult:
        """The stored answer to a retried request id; ALREADY_EXISTS when the retry asks
        for something else (a different body under the same id is a caller's bug, and the
        old plan would silently answer the wrong question). Records written before the
        digest was kept replay as before."""
        stored = head.get("request_digest")
        if stored and stored != request_digest(req):
            raise AlreadyExists(
                f"request id {req.request_id!r} was scheduled with a different request "
                "(model, tokens, tier, hints, revision or pool); use a new id"
            )
        metrics.REPLAYS.inc()
        return ScheduleResult(head, True)
