"""Outcomes: `ReportOutcome` releases a request's reservation (once, by its owner or an
operator), keeps the reservation mirror and the queued-prefill count right, and feeds the
observed TTFT, TPOT and transfer figures back into the per-worker estimates."""

from __future__ import annotations

from typing import Any

from hpd_common import auth
from hpd_common.errors import NotFound, PermissionDenied
from hpd_common.logging import get_logger
from hpd_scheduler import metrics
from hpd_scheduler.feedback import observation_from
from hpd_scheduler.policy.learning import samples_from
from hpd_scheduler.snapshot import FleetSnapshot
from hpd_scheduler.store import Totals

log = get_logger("scheduler")


class OutcomeReports(FleetSnapshot):
    """The outcome side of a plan (module docstring)."""

    async def report_outcome(self, request_id: str, outcome: dict[str, Any]) -> tuple[bool, bool]:
        """Release the reservation, attach the outcome, learn from it (once).
        Returns (released, first_report)."""
        now_ms = self.clock.now_ms()
        outcome = {**outcome, "reported_at_ms": now_ms}
        who = auth.current()
        owner = "" if who is None or who.operator else who.name
        res = await self.store.report_outcome(request_id, outcome, owner)
        if res.not_owner:
            raise PermissionDenied(
                f"request {request_id!r} was scheduled by another caller; "
                "only it (or an operator) may report its outcome"
            )
        if not res.record_found and not res.released:
            raise NotFound("route record", request_id)
        plan = (res.head or {}).get("plan") or {}
        if res.released and plan:
            dw = str(plan.get("decode_worker_id", ""))
            pw = str(plan.get("prefill_worker_id", ""))
            kv = int(plan.get("reserved_kv_bytes") or 0)
            tokens = int(plan.get("prefill_tokens") or 0)
            # forgotten first, so the totals' release below leaves the snapshot's count of
            # queued tokens right whether or not they were presumed prefilled already
            self.prefill_due.release(request_id)
            old = self.reserved(dw)
            self._set_totals(
                dw,
                Totals(
                    max(0, old.kv_bytes - kv),
                    max(0, old.requests - 1),
                    max(0, old.prefill_tokens - (tokens if pw == dw else 0)),
                ),
            )
            if pw != dw and tokens:
                old = self.reserved(pw)
                self._set_totals(
                    pw,
                    Totals(old.kv_bytes, old.requests, max(0, old.prefill_tokens - tokens)),
                )
            self._apply(pw)
            self._apply(dw)
        metrics.OUTCOMES.labels(success=str(bool(outcome.get("success"))).lower()).inc()
        if res.first_report and plan:
            obs = observation_from(plan, outcome)
            if obs is not None:
                self.observed.observe(obs, now_ms / 1000.0)
                self._changed.set()
            self._learn(plan, outcome, res.head or {})
        return res.released, res.first_report

    def _learn(self, plan: dict[str, Any], outcome: dict[str, Any], head: dict[str, Any]) -> None:
        """The outcome's samples for the learner, learned with the others of their batch
        (``learning_queue``: fitted here, shared with every replica through the store);
        the estimate's error goes to the metrics at once."""
        est = plan.get("estimates") or {}
        tier = str(head.get("tier") or "")
        created_ms = int(head.get("created_at_ms") or 0)
        _error_metrics(plan, est, outcome, tier)
        incarnation = {}
        for role in ("prefill_worker_id", "decode_worker_id"):
            worker = str(plan.get(role, ""))
            rec = self.informer.workers.get(worker)
            if rec is not None:
                incarnation[worker] = rec.state.registered_at_ms
        got = samples_from(plan, outcome, created_ms, incarnation, self.clock.now_ms())
        self.learning.add(got)  # fitted, exported and shared in a batch (learning_queue)


def _error_metrics(
    plan: dict[str, Any], est: dict[str, Any], outcome: dict[str, Any], tier: str
) -> None:
    """``actual / predicted`` TTFT per prefill worker and TPOT per decode worker."""
    if not outcome.get("success"):
        return
    ttft, pred = float(outcome.get("ttft_ms") or 0.0), float(est.get("ttft_ms") or 0.0)
    if ttft > 0 and pred > 0:
        worker = str(plan.get("prefill_worker_id", ""))
        metrics.TTFT_ESTIMATE_RATIO.labels(worker=worker, tier=tier).observe(ttft / pred)
    tpot, pred = float(outcome.get("tpot_ms") or 0.0), float(est.get("tpot_ms") or 0.0)
    if tpot > 0 and pred > 0:
        worker = str(plan.get("decode_worker_id", ""))
        metrics.TPOT_ESTIMATE_RATIO.labels(worker=worker, tier=tier).observe(tpot / pred)
