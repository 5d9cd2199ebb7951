"""What a decision returns: the plan, the fallback chain, the serving action and the record.

The record holds references to the candidates actually scored (top-k of each side, so a
bounded number) and is turned into plain JSON-ready data only when :meth:`Decision.to_dict`
is called: the hot path pays nothing for explainability it does not serialise.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

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
    "decode_explanation",
    "expand_explanation",
]


class RejectClass:
    """Why a request was refused, for the status code at the edge.

    ``no_capable_worker`` -> FAILED_PRECONDITION (nothing could ever serve it);
    ``saturated``, ``throttled``, ``shed`` -> RESOURCE_EXHAUSTED (capable workers exist).
    """

    NO_CAPABLE_WORKER: Final = "no_capable_worker"
    SATURATED: Final = "saturated"
    THROTTLED: Final = "throttled"
    SHED: Final = "shed"


@dataclass(frozen=True, slots=True)
class Estimates:
    """Hand-off and latency estimates of the chosen route, ms unless stated.

    ``kv_bytes``: bytes crossing the link (TRANSFER) or built on the decode worker;
    ``transfer_ms``: link time incl. latency and conversion (None unless TRANSFER);
    ``recompute_ms``: the decode worker's own prefill time for the prompt;
    ``ttft_ms``: prefill wait + prefill + hand-off; ``tpot_ms``: predicted decode step (with
    the SLO objective, its TPOT estimate: the step as the engine's prefills stretch it,
    and a local prefill's stall on the batch it joins). ``prefill_nominal_ms``: the
    declared cost model's time for the prefill work ahead and the request's own (before the
    worker's measured corrections), ``prefill_ahead`` the requests queued ahead: what the
    learner (``LearnedSpeed``) fits the measured prefill phase against;
    ``decode_nominal_ms`` the declared step for the decode batch's context,
    ``decode_others`` the other sequences sharing the step and ``decode_step_ms`` the step
    predicted (``tpot_ms`` is it stretched by prefills and stalls), what it fits the
    measured TPOT against (``LearnedStep``); ``decode_duty`` the decode worker's prefill
    busy share the stretch used (the fit takes the measured TPOT back to a bare step by it).
    """

    kv_bytes: int
    transfer_ms: float | None
    recompute_ms: float
    conversion_ms: float
    prefill_wait_ms: float
    prefill_ms: float
    ttft_ms: float
    tpot_ms: float
    prefill_nominal_ms: float = 0.0
    prefill_ahead: float = 0.0
    decode_nominal_ms: float = 0.0
    decode_others: float = 0.0
    decode_step_ms: float = 0.0
    decode_duty: float = 0.0


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
    prefill_tokens: int  # the prompt tokens the prefill worker computes (cached ones left out)
    estimates: Estimates
    cached_tokens: int = 0  # the prompt's prefix the prefill worker's engine already holds

    @property
    def prefill_end_ms(self) -> float:
        """When, in ms after the decision, the prefill worker is predicted to be done with
        the prompt: a transfer's prefill ends before the hand-off and the decode side's
        admission wait, a local prefill with the first token."""
        e = self.estimates
        if self.mode is Mode.TRANSFER:
            return e.prefill_wait_ms + e.prefill_ms
        return e.ttft_ms


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
        return expand_explanation(self.compact(max_options))

    def encode(self, max_options: int = 16) -> str:
        """:meth:`compact` as one JSON text (what the scheduler stores per route record);
        :func:`decode_explanation` turns it back into :meth:`to_dict`'s form."""
        doc = self.compact(max_options)
        nums = doc["n"]
        if sys.byteorder != "little":
            nums.byteswap()
        doc["n"] = base64.b64encode(nums.tobytes()).decode("ascii")
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)

    def compact(self, max_options: int = 16) -> dict[str, Any]:
        """The record as a compact document: every number in one float64 array ``n``, in
        the order :func:`expand_explanation` reads them back, and the strings in ``s``.

        Encoding a record is paid once per decision on the scheduler's event loop, while
        reading one back is rare (``GetRouteRecord``): formatting ~150 floats as decimal
        text and building nested dicts per decision cost more than the decision itself.
        Factor names repeat across candidates, so each distinct name list is stored once
        (``s[5]``) and referenced by position. Non-finite values raise ``ValueError``, as
        strict JSON would."""
        nums = array("d")
        tables: dict[tuple[str, ...], int] = {}

        def table(keys: tuple[str, ...]) -> int:
            at = tables.get(keys)
            if at is None:
                at = tables[keys] = len(tables)
            return at

        nums.append(self.memory_pressure)
        nums.extend(self.prefill_weights.values())
        nums.extend(self.decode_weights.values())
        nums.extend(self.side_weights)
        sides: list[list[list[Any]]] = []
        for cands in (self.prefill_candidates, self.decode_candidates):
            rows: list[list[Any]] = []
            for c in cands:
                f = c.factors
                rows.append([c.ws.worker_id, c.ws.pool_id, table(tuple(f))])
                nums.extend((c.score, c.wait_ms, c.run_ms, c.step_ms))
                nums.extend(f.values())
            sides.append(rows)
        explain = self.explain
        options: list[list[Any]] = []
        for o in sorted(self.options, key=_option_order)[:max_options]:
            f = {**o.factors, **explain(o)} if explain is not None else o.factors
            transfer = o.mode is Mode.TRANSFER
            options.append(
                [
                    o.p.ws.worker_id,
                    o.d.ws.worker_id,
                    o.mode.value,
                    table(tuple(f)),
                    1 if transfer else 0,
                    o.kv_reasons,
                ]
            )
            nums.extend((o.score, o.ttft_ms, o.transfer_ms if transfer else 0.0))
            nums.extend(f.values())
        if not math.isfinite(sum(nums)):  # one pass in C; a NaN or inf anywhere shows here
            bad = [x for x in nums if not math.isfinite(x)]
            if bad:
                raise ValueError(f"non-finite value {bad[0]!r} in a decision record")
        return {
            "v": 2,
            "s": [
                self.profile,
                self.tier,
                list(self.prefill_weights),
                list(self.decode_weights),
                len(self.side_weights),
                [list(k) for k in tables],
                sides[0],
                sides[1],
                options,
                self.rejected_workers,
                self.rejected_pools,
                self.notes,
            ],
            "n": nums,
        }


def decode_explanation(doc: dict[str, Any]) -> dict[str, Any]:
    """A stored explanation as :meth:`DecisionRecord.to_dict` returns it: the compact form
    (``"v": 2``, ``n`` base64 little-endian float64) is expanded; a plain document (written
    before the compact form existed) comes back unchanged."""
    if doc.get("v") != 2:
        return doc
    nums = array("d")
    nums.frombytes(base64.b64decode(doc["n"]))
    if sys.byteorder != "little":
        nums.byteswap()
    return expand_explanation({"v": 2, "s": doc["s"], "n": nums})


def expand_explanation(doc: dict[str, Any]) -> dict[str, Any]:
    """:meth:`DecisionRecord.compact` back to plain data (the one place the record's public
    shape is written down)."""
    (
        profile,
        tier,
        pnames,
        dnames,
        n_sides,
        tables,
        pcands,
        dcands,
        options,
        rejected_workers,
        rejected_pools,
        notes,
    ) = doc["s"]
    it = iter(doc["n"])

    def take(n: int) -> list[float]:
        return [next(it) for _ in range(n)]

    def factors(t: int) -> dict[str, float]:
        names = tables[t]
        return {k: round(v, 6) for k, v in zip(names, take(len(names)), strict=True)}

    pressure = next(it)
    pw = dict(zip(pnames, take(len(pnames)), strict=True))
    dw = dict(zip(dnames, take(len(dnames)), strict=True))
    side_weights = take(n_sides)

    def cands(rows: list[list[Any]]) -> list[dict[str, Any]]:
        out = []
        for wid, pool, t in rows:
            score, wait, run, step = take(4)
            out.append(
                {
                    "worker_id": wid,
                    "pool_id": pool,
                    "score": round(score, 6),
                    "factors": factors(t),
                    "wait_ms": round(wait, 3),
                    "prefill_ms": round(run, 3),
                    "step_ms": round(step, 3),
                }
            )
        return out

    prefill = cands(pcands)
    decode = cands(dcands)
    opts = []
    for pid, did, mode, t, transfer, kv_reasons in options:
        score, ttft, xfer = take(3)
        opts.append(
            {
                "prefill_worker_id": pid,
                "decode_worker_id": did,
                "mode": mode,
                "score": round(score, 6),
                "ttft_ms": round(ttft, 3),
                "transfer_ms": round(xfer, 3) if transfer else None,
                "factors": factors(t),
                "kv_reasons": list(kv_reasons),
            }
        )
    return {
        "profile": profile,
        "tier": tier,
        "memory_pressure": round(pressure, 6),
        "weights": {"prefill": pw, "decode": dw, "sides": side_weights},
        "candidates": {"prefill": prefill, "decode": decode},
        "options": opts,
        "rejected_workers": [
            {"worker_id": w, "pool_id": p, "reason": r} for w, p, r in rejected_workers
        ],
        "rejected_pools": {k: list(v) for k, v in rejected_pools.items()},
        "notes": list(notes),
    }


def _option_order(o: Option) -> tuple[float, int, int]:
    """Best first: score descending, then the snapshot tie-break (prefill, decode index)."""
    return (-o.score, o.p.ws.idx, o.d.ws.idx)


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
                "cached_tokens": plan.cached_tokens,
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
