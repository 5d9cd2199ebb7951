"""The gateway emulation: replays a request trace through the real control plane and the
emulated fleet, the way a serving gateway in front of real engines would.

Per request, at its (time-scaled) arrival:

1. ``SchedulerService.Schedule`` with prompt and expected output tokens and a tier drawn from
   the configured mix (seeded). UNAVAILABLE and DEADLINE_EXCEEDED are retried (the RPC is
   idempotent per request id) with capped backoff for up to ``unavailable_budget_s``; after
   that the request is *rejected* with reason ``unavailable``. RESOURCE_EXHAUSTED and
   FAILED_PRECONDITION are final rejections with the scheduler's class (``saturated``,
   ``throttled``, ``shed``, ``no_capable_worker``).
2. The plan runs on the emulated workers:

   * TRANSFER (prefill worker P, decode worker D): D reserves the request's KV memory and
     reports RESERVED on the broker session; P prefills (queued on its GPU) and moves the
     KV at the physical link's rate, reporting progress and completing the session; D
     watches the session (``WatchSession``) and starts decoding on COMPLETE, the first token
     counting from then. Without a session id (no broker) the bytes just take the link time.
   * RECOMPUTE and SAME_POOL: the decode worker prefills the prompt itself, then decodes.

   When a step fails, the plan's fallback chain is walked in order, skipping steps whose
   workers are gone: a session that ends FAILED / EXPIRED / ABORTED or is not COMPLETE in
   time (cause ``kv_session_<state>``), a prefill or decode worker that dies
   (``prefill_worker_lost`` / ``decode_worker_lost``). The first token already delivered
   stays delivered; a decode that dies mid-way is recomputed elsewhere and restarts
   (the user sees a stall, which TPOT includes). A transfer step of the chain opens its own
   session (request id ``<id>:fb<n>``), because the broker keys sessions by request id.
3. ``ReportOutcome``: success with the observed TTFT / TPOT (emulated ms), the mode actually
   used, the prefill and transfer times; on success after a fallback, ``error_class`` names
   the cause so the route record says why the mode differs. A request that no step could
   serve is reported failed with its cause. UNAVAILABLE is retried until the budget runs out.

Every request ends in exactly one :class:`RequestRecord`: ``completed``, ``rejected`` (with
the reason) or ``failed`` (with the cause); the gateway never drops one.

Times: arrivals come from a trace reshaped with the time scale, so they are wall offsets;
all reported latencies are emulated ms (``EmuTime``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import random
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_agent.worker_client import SessionEnded, WorkerGone
from hpd_common.logging import get_logger
from hpd_sim.traces import Trace, TraceRequest

from .engine import EmuTime, WorkerLost
from .fleet import EmulatedWorker, Fleet

__all__ = [
    "MODE_NAMES",
    "Gateway",
    "GatewayConfig",
    "GatewayStats",
    "Replay",
    "RequestRecord",
    "plan_row",
    "replay_arrivals",
    "with_plan",
]

log = get_logger("fleet.gateway")

T = TypeVar("T")

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
_RETRY = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


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
    return _replace(
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


class StepFailed(Exception):
    """One route step could not serve the request; ``cause`` is a stable code."""

    def __init__(self, cause: str, detail: str = "") -> None:
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


@dataclass(frozen=True, slots=True)
class _Step:
    mode: str
    prefill_worker_id: str
    decode_worker_id: str
    session_id: str
    reason: str


@dataclass(slots=True)
class _Progress:
    arrival_ms: float
    first_token_ms: float | None = None
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0


class Replay:
    """What both trace replays share: the requests started at their arrivals (tier drawn
    from the mix), the counters of the live view, one record per request (a crash of the
    replay's own code is recorded, never lost), the plans seen, the backoff. Subclasses
    serve one request in ``_serve``: :class:`Gateway` executes plans in this process,
    :class:`~hpd_fleet.replay.HttpReplay` sends requests through ``hpd gateway``."""

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
            rec = _replace(
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


class Gateway(Replay):
    """Replays traces through the scheduler onto a fleet (module docstring)."""

    crash_prefix = "gateway_error"

    def __init__(
        self,
        scheduler: grpc.aio.Channel,
        fleet: Fleet,
        time: EmuTime,
        rng: random.Random,
        config: GatewayConfig | None = None,
        run_id: str = "run",
    ) -> None:
        super().__init__(time, rng, config, run_id)
        self._stub = s_grpc.SchedulerServiceStub(scheduler)
        self.fleet = fleet

    async def _crashed(self, rec: RequestRecord) -> RequestRecord:
        with contextlib.suppress(Exception):  # its plan's reservation goes back
            rec = await self._report(rec)
        return rec

    # -- Schedule ---------------------------------------------------------------------------

    async def _call(
        self, fn: Callable[[], Awaitable[T]]
    ) -> tuple[T | None, grpc.aio.AioRpcError | None, int]:
        """Call with retries on UNAVAILABLE / DEADLINE_EXCEEDED within the budget; returns
        (response, final error, retries)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.unavailable_budget_s
        attempt = 0
        while True:
            try:
                return await fn(), None, attempt
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRY or loop.time() >= deadline:
                    return None, exc, attempt
            self.stats.unavailable_retries += 1
            await self._backoff(attempt)
            attempt += 1

    async def _serve(self, base: RequestRecord) -> RequestRecord:
        cfg = self.config
        req = s.ScheduleRequest(
            request_id=base.request_id,
            model_id=cfg.model_id,
            prompt_tokens=base.prompt_tokens,
            expected_output_tokens=base.output_tokens,
            tier=base.tier,
        )
        resp, err, retries = await self._call(
            lambda: self._stub.Schedule(req, timeout=cfg.rpc_timeout_s)
        )
        if resp is None:
            assert err is not None
            return _replace(
                base, status="rejected", reason=reject_reason(err), schedule_retries=retries
            )
        plan = resp.plan
        rec = self._planned(_replace(base, schedule_retries=retries), plan, plan.decision)
        rec = await self._execute(rec, plan)
        return await self._report(rec)

    # -- execution --------------------------------------------------------------------------

    async def _execute(self, rec: RequestRecord, plan: s.RoutePlan) -> RequestRecord:
        steps = [
            _Step(
                MODE_NAMES.get(plan.mode, "recompute"),
                plan.prefill_worker_id,
                plan.decode_worker_id,
                plan.kv_session_id,
                "",
            )
        ] + [
            _Step(
                MODE_NAMES.get(f.mode, "recompute"),
                f.prefill_worker_id,
                f.decode_worker_id,
                "",
                f.reason,
            )
            for f in plan.fallbacks
        ]
        prog = _Progress(rec.arrival_ms)
        causes: list[str] = []
        kv_bytes = (
            int(plan.estimates.kv_bytes)
            or self.fleet.cluster.model.kv_format().bytes_per_token() * rec.prompt_tokens
        )
        for n, step in enumerate(steps):
            transfer = step.mode == "transfer" and step.prefill_worker_id != step.decode_worker_id
            decode = self.fleet.get(step.decode_worker_id)
            prefill = self.fleet.get(step.prefill_worker_id) if transfer else decode
            if decode is None or prefill is None:
                if n == 0:
                    causes.append("decode_worker_lost" if decode is None else "prefill_worker_lost")
                continue
            try:
                if transfer:
                    await self._transfer(rec, step, n, prefill, decode, kv_bytes, prog)
                else:
                    await self._local(rec, decode, prog)
            except StepFailed as exc:
                causes.append(exc.cause)
                log.info("route_step_failed", request_id=rec.request_id, step=n, cause=exc.cause)
                continue
            fallback = ""
            if n > 0:
                fallback = f"{causes[-1] if causes else 'worker_lost'}->{step.reason or step.mode}"
            end = self.time.now_ms()
            first = prog.first_token_ms if prog.first_token_ms is not None else end
            tpot = (end - first) / (rec.output_tokens - 1) if rec.output_tokens > 1 else 0.0
            return _replace(
                rec,
                status="completed",
                mode_used=step.mode if transfer or step.mode != "transfer" else "same_pool",
                prefill_worker=prefill.worker_id,
                decode_worker=decode.worker_id,
                prefill_pool=prefill.view.pool_id,
                decode_pool=decode.view.pool_id,
                ttft_ms=first - prog.arrival_ms,
                tpot_ms=tpot,
                prefill_ms=prog.prefill_ms,
                transfer_ms=prog.transfer_ms,
                fallback=fallback,
                reason=causes[-1] if fallback and causes else "",
            )
        cause = causes[-1] if causes else "no_live_route"
        return _replace(rec, status="failed", reason=cause, fallback=f"{cause}->none")

    async def _guard(self, aw: Awaitable[T], *workers: EmulatedWorker) -> T:
        """Await ``aw`` unless one of ``workers`` dies first (then WorkerLost)."""
        task = asyncio.ensure_future(aw)
        deaths = {asyncio.ensure_future(w.engine.died.wait()): w for w in workers}
        try:
            done, _ = await asyncio.wait([task, *deaths], return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            dead = next(w for d, w in deaths.items() if d in done)
            raise WorkerLost(dead.worker_id)
        finally:
            for d in deaths:
                d.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _local(self, rec: RequestRecord, worker: EmulatedWorker, prog: _Progress) -> None:
        """Prefill and decode on one worker (recompute, same pool, or a restart)."""
        eng = worker.engine
        rid = rec.request_id
        try:
            await eng.allocate(rid, rec.prompt_tokens + rec.output_tokens)
            pre = await eng.prefill(rid, rec.prompt_tokens, hold_kv=False)
            prog.prefill_ms = pre.compute_ms
            if prog.first_token_ms is None:
                prog.first_token_ms = self.time.now_ms()
            await eng.decode(rid, rec.prompt_tokens, rec.output_tokens - 1)
        except WorkerLost as exc:
            raise StepFailed("decode_worker_lost", exc.worker_id) from None
        finally:
            eng.release(rid)

    async def _transfer(
        self,
        rec: RequestRecord,
        step: _Step,
        n: int,
        src: EmulatedWorker,
        dst: EmulatedWorker,
        kv_bytes: int,
        prog: _Progress,
    ) -> None:
        """Prefill on ``src``, hand the KV to ``dst`` through the broker session, decode."""
        rid = rec.request_id
        sid = step.session_id
        cost_per_gib = 0.0
        if n > 0:
            try:
                sess = await self._guard(
                    src.client.open_session(f"{rid}:fb{n}", dst.worker_id, kv_bytes), src
                )
            except (grpc.aio.AioRpcError, WorkerLost, WorkerGone) as exc:
                raise StepFailed("kv_session_refused", str(exc)[:80]) from None
            sid = sess.session_id
            cost_per_gib = sess.negotiation.cost_ms_per_gib
        reserved = asyncio.Event()
        moved = {"ms": 0.0}

        async def sender() -> None:
            try:
                pre = await src.engine.prefill(rid, rec.prompt_tokens)
                prog.prefill_ms = pre.compute_ms
                await reserved.wait()
                ms = Fleet.transfer_ms(
                    self.fleet.link(src.worker_id, dst.worker_id), kv_bytes, cost_per_gib
                )
                parts = self.config.progress_reports
                for i in range(1, parts + 1):
                    await self.time.sleep_ms(ms / parts)
                    if sid:
                        await src.client.report_progress(sid, kv_bytes * i // parts)
                moved["ms"] = ms
                if sid:
                    await src.client.complete_session(sid)
            except SessionEnded:
                return  # the receiver sees the terminal state
            except (WorkerLost, WorkerGone):
                return  # a dead sender says nothing; the broker fails its sessions
            except grpc.aio.AioRpcError as exc:
                if sid:
                    with contextlib.suppress(Exception):
                        await src.client.report_failed(sid, f"sender_error:{exc.code().name}")
            finally:
                src.engine.release(rid)

        async def receiver() -> None:
            await dst.engine.allocate(rid, rec.prompt_tokens + rec.output_tokens)
            if not sid:
                reserved.set()
                return
            try:
                await dst.client.report_reserved(sid)
            except SessionEnded as exc:
                raise StepFailed(_session_cause(exc.state), exc.reason) from None
            except grpc.aio.AioRpcError as exc:
                # the broker would not take the decode side's word: typically its lease ran
                # out in a state-store outage and it registered again, so the session belongs
                # to an incarnation that is gone. A step that failed, not a lost request.
                raise StepFailed(f"kv_session_refused_{exc.code().name.lower()}") from None
            reserved.set()
            try:
                final = await dst.client.await_session(sid, self.config.session_wait_s)
            except TimeoutError:
                with contextlib.suppress(Exception):
                    await dst.client.abort_session(sid, "decode_side_timeout")
                raise StepFailed("kv_session_timeout") from None
            except SessionEnded as exc:
                raise StepFailed(_session_cause(exc.state), exc.reason) from None
            if final.state != kb.SESSION_STATE_COMPLETE:
                raise StepFailed(_session_cause(final.state), final.reason)

        send = asyncio.create_task(sender())
        try:
            try:
                await self._guard(receiver(), dst)
                if not sid:
                    await self._guard(send, src)
                else:
                    async with asyncio.timeout(self.config.rpc_timeout_s):
                        await asyncio.shield(send)
            except WorkerLost as exc:
                cause = (
                    "decode_worker_lost"
                    if exc.worker_id == dst.worker_id
                    else "prefill_worker_lost"
                )
                raise StepFailed(cause, exc.worker_id) from None
            except WorkerGone as exc:
                raise StepFailed("decode_worker_lost", str(exc)) from None
            except TimeoutError:
                pass  # the session is COMPLETE; the sender's last reply is late
            prog.transfer_ms = moved["ms"]
            prog.first_token_ms = self.time.now_ms()
            try:
                await dst.engine.decode(rid, rec.prompt_tokens, rec.output_tokens - 1)
            except WorkerLost as exc:
                raise StepFailed("decode_worker_lost", exc.worker_id) from None
        finally:
            if not send.done():
                send.cancel()
                with contextlib.suppress(BaseException):
                    await send
            dst.engine.release(rid)

    # -- ReportOutcome ----------------------------------------------------------------------

    async def _report(self, rec: RequestRecord) -> RequestRecord:
        ok = rec.status == "completed"
        out = s.ReportOutcomeRequest(
            request_id=rec.request_id,
            success=ok,
            error_class=(rec.reason if (not ok or rec.fallback) else "")[:64],
        )
        if ok:
            out.ttft_ms = max(0.0, rec.ttft_ms)
            out.tpot_ms = max(0.0, rec.tpot_ms)
            out.mode_used = MODE_PB.get(rec.mode_used, s.EXECUTION_MODE_UNSPECIFIED)
            out.prefill_ms = rec.prefill_ms
            out.transfer_ms = rec.transfer_ms
            out.output_tokens = rec.output_tokens
        if not ok and not out.error_class:
            out.error_class = "failed"
        resp, err, _ = await self._call(
            lambda: self._stub.ReportOutcome(out, timeout=self.config.rpc_timeout_s)
        )
        if resp is None:
            log.warning("outcome_not_reported", request_id=rec.request_id, error=str(err))
        return _replace(rec, outcome_reported=resp is not None)


def _session_cause(state: int) -> str:
    names: dict[int, str] = {
        kb.SESSION_STATE_FAILED: "failed",
        kb.SESSION_STATE_EXPIRED: "expired",
        kb.SESSION_STATE_ABORTED: "aborted",
    }
    return f"kv_session_{names.get(state, 'lost')}"


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


def _replace(rec: RequestRecord, **changes: Any) -> RequestRecord:
    import dataclasses

    return dataclasses.replace(rec, **changes)
