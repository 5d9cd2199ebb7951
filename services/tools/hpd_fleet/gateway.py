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

Every request ends in exactly one record (``hpd_fleet.replay_common.RequestRecord``):
``completed``, ``rejected`` (with the reason) or ``failed`` (with the cause); the gateway
never drops one.

Times: arrivals come from a trace reshaped with the time scale, so they are wall offsets;
all reported latencies are emulated ms (``EmuTime``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_agent.worker_client import SessionEnded, WorkerGone
from hpd_common.logging import get_logger

from .engine import EmuTime, WorkerLost
from .fleet import EmulatedWorker, Fleet
from .replay_common import (
    MODE_NAMES,
    MODE_PB,
    RETRYABLE,
    GatewayConfig,
    Replay,
    RequestRecord,
    reject_reason,
    replace_record,
)

__all__ = ["Gateway", "StepFailed"]

log = get_logger("fleet.gateway")

T = TypeVar("T")


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


@dataclass(slots=True)
class _HandOff:
    """One transfer step between its sender and its receiver (``Gateway._transfer``)."""

    rec: RequestRecord
    session_id: str  # "" without a broker: the bytes just take the link time
    src: EmulatedWorker
    dst: EmulatedWorker
    kv_bytes: int
    cost_per_gib: float
    prog: _Progress
    reserved: asyncio.Event = field(default_factory=asyncio.Event)  # the decode side's KV
    moved_ms: float = 0.0  # the link time of the bytes, once they all moved


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
                if exc.code() not in RETRYABLE or loop.time() >= deadline:
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
            return replace_record(
                base, status="rejected", reason=reject_reason(err), schedule_retries=retries
            )
        plan = resp.plan
        rec = self._planned(replace_record(base, schedule_retries=retries), plan, plan.decision)
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
            return replace_record(
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
        return replace_record(rec, status="failed", reason=cause, fallback=f"{cause}->none")

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
        """Prefill on ``src``, hand the KV to ``dst`` through the broker session, decode.
        The ``n``-th step of a fallback chain opens a session of its own."""
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
        hand_off = _HandOff(rec, sid, src, dst, kv_bytes, cost_per_gib, prog)
        send = asyncio.create_task(self._send_kv(hand_off))
        try:
            try:
                await self._guard(self._receive_kv(hand_off), dst)
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
            prog.transfer_ms = hand_off.moved_ms
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

    async def _send_kv(self, h: _HandOff) -> None:
        """The prefill side of a transfer: prefill, wait for the decode side's reservation,
        move the KV at the link's rate with progress reports, complete the session. A dead
        sender says nothing (the broker fails its sessions); a refused report fails it."""
        src, sid = h.src, h.session_id
        rid = h.rec.request_id
        try:
            pre = await src.engine.prefill(rid, h.rec.prompt_tokens)
            h.prog.prefill_ms = pre.compute_ms
            await h.reserved.wait()
            ms = Fleet.transfer_ms(
                self.fleet.link(src.worker_id, h.dst.worker_id), h.kv_bytes, h.cost_per_gib
            )
            parts = self.config.progress_reports
            for i in range(1, parts + 1):
                await self.time.sleep_ms(ms / parts)
                if sid:
                    await src.client.report_progress(sid, h.kv_bytes * i // parts)
            h.moved_ms = ms
            if sid:
                await src.client.complete_session(sid)
        except SessionEnded:
            return  # the receiver sees the terminal state
        except (WorkerLost, WorkerGone):
            return
        except grpc.aio.AioRpcError as exc:
            if sid:
                with contextlib.suppress(Exception):
                    await src.client.report_failed(sid, f"sender_error:{exc.code().name}")
        finally:
            src.engine.release(rid)

    async def _receive_kv(self, h: _HandOff) -> None:
        """The decode side of a transfer: reserve the request's KV memory, say so on the
        session, and wait for it to end COMPLETE (any other end fails the step)."""
        dst, sid = h.dst, h.session_id
        await dst.engine.allocate(h.rec.request_id, h.rec.prompt_tokens + h.rec.output_tokens)
        if not sid:
            h.reserved.set()
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
        h.reserved.set()
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
        return replace_record(rec, outcome_reported=resp is not None)


def _session_cause(state: int) -> str:
    names: dict[int, str] = {
        kb.SESSION_STATE_FAILED: "failed",
        kb.SESSION_STATE_EXPIRED: "expired",
        kb.SESSION_STATE_ABORTED: "aborted",
    }
    return f"kv_session_{names.get(state, 'lost')}"
