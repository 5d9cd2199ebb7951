"""What the demo's two trace replays share (the in-process one, ``hpd_fleet.gateway``, and
the one through ``hpd gateway``, ``hpd_fleet.replay``): their settings
(:class:`GatewayConfig`), one :class:`RequestRecord` per request and the live counters
(:class:`GatewayStats`), the arrival loop (:func:`replay_arrivals`) and the :class:`Replay`
base that starts each request at its arrival and never loses its record."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import random
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from hetero_pd.v1 import scheduler_pb2 as s
from hpd_common.logging import get_logger
from hpd_sim.traces import Trace, TraceRequest

from .engine import EmuTime

__all__ = [
    "DECISION_NAMES",
    "MODE_NAMES",
    "MODE_PB",
    "RETRYABLE",
    "GatewayConfig",
    "GatewayStats",
    "Replay",
    "RequestRecord",
    "plan_row",
    "reject_reason",
    "replace_record",
    "replay_arrivals",
    "with_plan",
]

log = get_logger("fleet.replay")


MODE_NAMES: Mapping[int, str] = {
    s.EXECUTION_MODE_TRANSFER: "transfer",
    s.EXECUTION_MODE_RECOMPUTE: "recompute",
    s.EXECUTION_MODE_SAME_POOL: "same_pool",
}


MODE_PB: Mapping[str, Any] = {v: k for k, v in MODE_NAMES.items()}


DECISION_NAMES: Mapping[int, str] = {
    s.ROUTE_DECISION_PRIMARY: "primary",
    s.ROUTE_DECISION_REROUTE: "reroute",
    s.ROUTE_DECISION_REJECT: "reject",
}


RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How the gateway behaves. Wall seconds unless stated.

    ``tier_mix``: (tier, weight) pairs, drawn per request with the seeded RNG.
    ``session_wait_s``: longest wait for a transfer session to end before the decode side
    gives up on it (aborts it) and falls back.
    """

    model_id: str = "llama-3-8b"
    tier_mix: tuple[tuple[str, float], ...] = (
        ("interactive", 0.2),
        ("standard", 0.6),
        ("batch", 0.2),
    )
    rpc_timeout_s: float = 2.0
    unavailable_budget_s: float = 15.0
    min_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    session_wait_s: float = 20.0
    progress_reports: int = 2

    def __post_init__(self) -> None:
        if not self.tier_mix or any(w < 0 for _, w in self.tier_mix):
            raise ValueError("tier_mix needs at least one tier with a weight >= 0")
        if sum(w for _, w in self.tier_mix) <= 0:
            raise ValueError("tier_mix weights must not all be 0")
        if self.progress_reports < 1:
            raise ValueError("progress_reports must be >= 1")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """How one request ended. Latencies in emulated ms (NaN when not measured)."""

    request_id: str
    index: int
    tier: str
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    status: str
    reason: str = ""
    decision: str = ""
    planned_mode: str = ""
    mode_used: str = ""
    mode_reason: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    prefill_pool: str = ""
    decode_pool: str = ""
    ttft_ms: float = math.nan
    tpot_ms: float = math.nan
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    fallback: str = ""
    serving_action: str = ""
    ladder_steps: tuple[str, ...] = ()
    schedule_retries: int = 0
    outcome_reported: bool = False

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["ladder_steps"] = list(self.ladder_steps)
        for k in ("ttft_ms", "tpot_ms"):
            if isinstance(d[k], float) and math.isnan(d[k]):
                d[k] = None
        return d


@dataclass(slots=True)
class GatewayStats:
    """Live counters for the progress display."""

    total: int = 0
    started: int = 0
    inflight: int = 0
    completed: int = 0
    rejected: int = 0
    failed: int = 0
    modes: collections.Counter[str] = field(default_factory=collections.Counter)
    fallbacks: collections.Counter[str] = field(default_factory=collections.Counter)
    rejects: collections.Counter[str] = field(default_factory=collections.Counter)
    unavailable_retries: int = 0
    events: list[str] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.completed + self.rejected + self.failed

    def ended(self, rec: RequestRecord) -> None:
        """Count a request that has ended (it was counted in flight until now)."""
        self.inflight -= 1
        if rec.status == "completed":
            self.completed += 1
            self.modes[rec.mode_used] += 1
        elif rec.status == "rejected":
            self.rejected += 1
            self.rejects[rec.reason] += 1
        else:
            self.failed += 1
        if rec.fallback:
            self.fallbacks[rec.fallback] += 1


def with_plan(rec: RequestRecord, plan: s.RoutePlan, decision: int) -> RequestRecord:
    """``rec`` with what the scheduler decided for it."""
    return replace_record(
        rec,
        decision=DECISION_NAMES.get(decision, ""),
        planned_mode=MODE_NAMES.get(plan.mode, ""),
        mode_reason=plan.mode_reason,
        prefill_worker=plan.prefill_worker_id,
        decode_worker=plan.decode_worker_id,
        prefill_pool=plan.prefill_pool_id,
        decode_pool=plan.decode_pool_id,
        serving_action=plan.serving_action.action,
        ladder_steps=tuple(plan.serving_action.ladder_steps),
    )


def plan_row(plan: s.RoutePlan) -> tuple[str, str, str, str, str]:
    """(mode, prefill worker, decode worker, prefill pool, decode pool) of a plan."""
    return (
        MODE_NAMES.get(plan.mode, ""),
        plan.prefill_worker_id,
        plan.decode_worker_id,
        plan.prefill_pool_id,
        plan.decode_pool_id,
    )


async def replay_arrivals(
    reqs: Sequence[TraceRequest],
    time: EmuTime,
    rng: random.Random,
    tier_mix: Sequence[tuple[str, float]],
    start: Callable[[int, TraceRequest, str, float], Coroutine[Any, Any, RequestRecord]],
) -> list[RequestRecord]:
    """Start ``start(index, request, tier, arrival_ms)`` for every request at its arrival
    offset (wall seconds from now), its tier drawn from ``tier_mix`` with ``rng`` and its
    arrival in emulated ms; wait for all of them. The records in trace order."""
    tiers = [t for t, _ in tier_mix]
    weights = [w for _, w in tier_mix]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    emu_start = time.now_ms()
    tasks: list[asyncio.Task[RequestRecord]] = []
    for i, req in enumerate(reqs):
        tier = rng.choices(tiers, weights)[0]
        delay = t0 + req.arrival_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        arrival_ms = emu_start + req.arrival_s * 1000.0 * time.scale
        tasks.append(asyncio.create_task(start(i, req, tier, arrival_ms)))
    return list(await asyncio.gather(*tasks))


class Replay:
    """What both trace replays share: the requests started at their arrivals (tier drawn
    from the mix), the counters of the live view, one record per request (a crash of the
    replay's own code is recorded, never lost), the plans seen, the backoff. Subclasses
    serve one request in ``_serve``: :class:`~hpd_fleet.gateway.Gateway` executes plans in
    this process, :class:`~hpd_fleet.replay.HttpReplay` sends requests through ``hpd
    gateway``."""

    crash_prefix = "replay_error"

    def __init__(
        self,
        time: EmuTime,
        rng: random.Random,
        config: GatewayConfig | None = None,
        run_id: str = "run",
    ) -> None:
        self.time = time
        self.rng = rng
        self.config = config or GatewayConfig()
        self.run_id = run_id
        self.stats = GatewayStats()
        self.records: dict[str, RequestRecord] = {}
        self.planned: list[tuple[str, str, str, str, str]] = []
        """(mode, prefill worker, decode worker, prefill pool, decode pool) per plan, in order."""
        self.on_record: Callable[[RequestRecord], None] | None = None

    def request_id(self, index: int) -> str:
        return f"{self.run_id}-{index:06d}"

    async def run(self, trace: Trace | Sequence[TraceRequest]) -> list[RequestRecord]:
        """Replay every request at its arrival offset (wall seconds from now) and wait for
        all of them to end. Returns the records in trace order."""
        reqs = trace.requests if isinstance(trace, Trace) else tuple(trace)
        self.stats.total += len(reqs)
        return await replay_arrivals(reqs, self.time, self.rng, self.config.tier_mix, self._handle)

    async def _handle(
        self, index: int, req: TraceRequest, tier: str, arrival_ms: float
    ) -> RequestRecord:
        rid = self.request_id(index)
        if rid in self.records:
            raise RuntimeError(f"request {rid} handled twice")
        self.stats.started += 1
        self.stats.inflight += 1
        base = RequestRecord(rid, index, tier, arrival_ms, req.prompt_tokens, req.output_tokens, "")
        try:
            rec = await self._serve(base)
        except Exception as exc:  # a bug must not lose the request: record it
            log.exception("request_crashed", request_id=rid)
            rec = replace_record(
                base, status="failed", reason=f"{self.crash_prefix}:{type(exc).__name__}"
            )
            rec = await self._crashed(rec)
        self.stats.ended(rec)
        self.records[rid] = rec
        if self.on_record is not None:
            self.on_record(rec)
        return rec

    async def _serve(self, base: RequestRecord) -> RequestRecord:
        raise NotImplementedError

    async def _crashed(self, rec: RequestRecord) -> RequestRecord:
        """After ``_serve`` raised: what is left to settle (nothing by default)."""
        return rec

    def _planned(self, rec: RequestRecord, plan: s.RoutePlan, decision: int) -> RequestRecord:
        """``rec`` with what the scheduler decided; a plan that was not a refusal is counted."""
        if decision != s.ROUTE_DECISION_REJECT:
            self.planned.append(plan_row(plan))
        return with_plan(rec, plan, decision)

    async def _backoff(self, attempt: int) -> None:
        c = self.config
        base = min(c.max_backoff_s, c.min_backoff_s * (2 ** min(attempt, 20)))
        await asyncio.sleep(base * (0.5 + 0.5 * self.rng.random()))


def reject_reason(err: grpc.aio.AioRpcError) -> str:
    """A stable reason code from a refused Schedule: the scheduler's reject class for
    RESOURCE_EXHAUSTED (the message starts ``<class>: ``), ``no_capable_worker`` for
    FAILED_PRECONDITION, the status name otherwise (``unavailable``)."""
    code = err.code()
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        head = (err.details() or "").split(":", 1)[0].strip()
        return head if head and " " not in head else "resource_exhausted"
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return "no_capable_worker"
    return str(code.name).lower()


def replace_record(rec: RequestRecord, **changes: Any) -> RequestRecord:
    return dataclasses.replace(rec, **changes)
