"""The gateway's gRPC side: Schedule and ReportOutcome at the scheduler, the KV session
at the broker, and the fleet view (endpoints, models) from the registry's feed.

Scheduler answers become :class:`~hpd_gateway.protocol.GatewayError` with the HTTP status a
client understands: RESOURCE_EXHAUSTED 429 with ``Retry-After``, no worker for the model
404 naming it, UNAVAILABLE (and other refusals to place) 503, INVALID_ARGUMENT 400,
DEADLINE_EXCEEDED 504. Session updates are best effort: a broker that is away must not fail
a request whose tokens are flowing; they are logged. ``ReportOutcome`` (idempotent at the
scheduler) is sent again while the control plane answers UNAVAILABLE or misses its deadline,
for up to ``report_budget_s``, so a record still learns what happened after an outage.
"""

from __future__ import annotations

import asyncio
import random

import grpc

from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common import rpc, tracing
from hpd_common.channels import CallIdentity, aio_channel
from hpd_common.logging import get_logger
from hpd_common.worker_model import Stage
from hpd_registry.informer import CLIENT_OPTIONS, FleetInformer
from hpd_scheduler.settings import SchedulerSettings

from .embedded_client import EmbeddedScheduler
from .plan import RECOMPUTE, SAME_POOL, TRANSFER, Outcome, Plan, Step
from .protocol import GatewayError
from .schedule_stream_client import ScheduleStreamClient, StreamBroken

__all__ = ["ControlPlane"]

log = get_logger("gateway.control")

_MODES = {
    s.EXECUTION_MODE_TRANSFER: TRANSFER,
    s.EXECUTION_MODE_RECOMPUTE: RECOMPUTE,
    s.EXECUTION_MODE_SAME_POOL: SAME_POOL,
}
_MODE_PB = {v: k for k, v in _MODES.items()}
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def plan_of(p: s.RoutePlan) -> Plan:
    steps = [
        Step(
            mode=_MODES.get(p.mode, RECOMPUTE),
            decode_worker=p.decode_worker_id,
            decode_endpoint=p.decode_endpoint,
            prefill_worker=p.prefill_worker_id if p.mode == s.EXECUTION_MODE_TRANSFER else "",
            prefill_endpoint=p.prefill_endpoint if p.mode == s.EXECUTION_MODE_TRANSFER else "",
            reason="primary",
        )
    ]
    for f in p.fallbacks:
        mode = _MODES.get(f.mode, RECOMPUTE)
        steps.append(
            Step(
                mode=mode,
                decode_worker=f.decode_worker_id,
                prefill_worker=f.prefill_worker_id if mode == TRANSFER else "",
                reason=f.reason,
            )
        )
    return Plan(
        request_id=p.request_id,
        steps=tuple(steps),
        session_id=p.kv_session_id,
        kv_bytes=int(p.estimates.kv_bytes),
        record_id=p.route_record_id,
    )


class ControlPlane:
    """Channels to the scheduler, broker and registry (one each per gateway process); or,
    with ``embedded`` settings, a scheduler replica in this process (``embedded_client.py``) in
    place of the scheduler's channels, sharing this fleet view."""

    def __init__(
        self,
        scheduler: str,
        broker: str,
        registry: str,
        gateway_token: str = "",
        timeout_s: float = 2.0,
        identity: CallIdentity | None = None,
        stream: bool = True,
        scheduler_channels: int = 1,
        report_budget_s: float = 30.0,
        embedded: SchedulerSettings | None = None,
    ) -> None:
        # several channels, each its own connection (a local subchannel pool), reach every
        # process of a scheduler run with --processes N: the kernel spreads connections
        opts = [*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        remote = embedded is None
        self._sched_chs = (
            [aio_channel(scheduler, identity, opts) for _ in range(max(1, scheduler_channels))]
            if remote
            else []
        )
        self._broker_ch = aio_channel(broker, identity, CLIENT_OPTIONS)
        self._stubs = [s_grpc.SchedulerServiceStub(ch) for ch in self._sched_chs]
        self.broker = kb_grpc.KvBrokerServiceStub(self._broker_ch)
        self.fleet = FleetInformer(registry, identity=identity)
        self.embedded = EmbeddedScheduler(embedded, self.fleet) if embedded is not None else None
        # with auth on, the gateway's bearer identity is what the broker checks; the
        # in-message token only for a broker configured with one (it refuses any other)
        self._caller = kb.SessionCaller(gateway_token=gateway_token)
        self.timeout_s = timeout_s
        self.report_budget_s = report_budget_s
        self.streams = [ScheduleStreamClient(stub) for stub in self._stubs] if stream else []
        self._turn = 0  # the next stream
        self._unary_turn = 0  # the next channel for a unary call

    def _next_stream(self) -> ScheduleStreamClient | None:
        """The stream the next request goes over (round robin); None: unary Schedule."""
        if not self.streams:
            return None
        self._turn = (self._turn + 1) % len(self.streams)
        return self.streams[self._turn]

    async def start(self) -> None:
        if self.embedded is not None:
            await self.embedded.start()  # starts the fleet view it shares
        else:
            await self.fleet.start()

    async def close(self) -> None:
        for stream in self.streams:
            await stream.close()
        if self.embedded is not None:
            await self.embedded.close()  # stops the fleet view too
        else:
            await self.fleet.stop()
        for ch in self._sched_chs:
            await ch.close()
        await self._broker_ch.close()

    # -- fleet view -------------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted({rec.spec.model_id for rec in self.fleet.workers.values()})

    def endpoint(self, worker_id: str) -> str:
        rec = self.fleet.workers.get(worker_id)
        return rec.spec.endpoint if rec is not None else ""

    def tokenizer_endpoints(self, model: str) -> list[str]:
        """Endpoints that can count a prompt's tokens: decode-capable workers first."""
        recs = [r for r in self.fleet.workers.values() if r.spec.model_id == model]
        recs.sort(key=lambda r: (Stage.DECODE not in r.spec.stages, r.spec.worker_id))
        return [r.spec.endpoint for r in recs]

    def context_tokens(self, model: str) -> int:
        """The longest sequence every engine of the model accepts (its smallest stated
        ``max_context_tokens``; 0 when none states one)."""
        stated = [
            r.spec.max_context_tokens
            for r in self.fleet.workers.values()
            if r.spec.model_id == model and r.spec.max_context_tokens > 0
        ]
        return min(stated) if stated else 0

    def block_tokens(self, model: str) -> int:
        """The KV block size the model's prefill-capable engines cache prompts in (the most
        common one; 0 when none is known): the gateway keys a prompt's blocks at it."""
        sizes: dict[int, int] = {}
        for rec in self.fleet.workers.values():
            if rec.spec.model_id != model or Stage.PREFILL not in rec.spec.stages:
                continue
            b = rec.spec.kv_format.block_size_tokens
            if b > 0:
                sizes[b] = sizes.get(b, 0) + 1
        return max(sizes, key=lambda b: (sizes[b], -b)) if sizes else 0

    # -- scheduler --------------------------------------------------------------------------

    async def schedule(
        self, request_id: str, model: str, prompt_tokens: int, output_tokens: int, tier: str,
        prefix: tuple[int, ...] = (), block_tokens: int = 0, avoid: tuple[str, ...] = (),
    ) -> Plan:  # fmt: skip
        """The scheduler's plan for the request (module docstring), in a ``schedule`` span
        whose context the scheduler continues (in the message over the stream, in the
        metadata of a unary call, which also carries the request id for its logs)."""
        with tracing.span("schedule"):
            req = s.ScheduleRequest(
                request_id=request_id,
                model_id=model,
                prompt_tokens=prompt_tokens,
                expected_output_tokens=output_tokens,
                tier=tier,
                prefix_block_hashes=list(prefix),
                prefix_block_tokens=block_tokens if prefix else 0,
                avoid_workers=avoid,
            )
            if self.embedded is not None:
                return plan_of(await self._schedule_here(req, model))
            tracing.inject_message(req)  # nothing while tracing is off
            stream = self._next_stream()
            if stream is not None:
                try:
                    answer = await stream.schedule(req, self.timeout_s)
                except TimeoutError:
                    raise _http_error(grpc.StatusCode.DEADLINE_EXCEEDED, "", 0, model) from None
                except StreamBroken:
                    pass  # retried unary below, under the same request id (idempotent)
                else:
                    if answer.WhichOneof("result") == "response":
                        return plan_of(answer.response.plan)
                    err = answer.error
                    raise _http_error(_CODES.get(err.code, grpc.StatusCode.UNKNOWN), err.message,
                                      err.retry_after_ms, model)  # fmt: skip
            try:
                resp = await self._unary().Schedule(
                    req, timeout=self.timeout_s, metadata=(("x-request-id", request_id),)
                )
            except grpc.aio.AioRpcError as exc:
                retry = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "0")
                raise _http_error(
                    exc.code(),
                    exc.details() or "",
                    int(retry) if str(retry).isdigit() else 0,
                    model,
                ) from exc
            return plan_of(resp.plan)

    async def _schedule_here(self, req: s.ScheduleRequest, model: str) -> s.RoutePlan:
        """The embedded replica's plan, its refusals answered as a remote scheduler's
        statuses are (``_http_error``), within the same deadline."""
        assert self.embedded is not None
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.embedded.schedule(req)
        except TimeoutError:
            raise _http_error(grpc.StatusCode.DEADLINE_EXCEEDED, "", 0, model) from None
        except Exception as exc:  # the policy's errors, as Schedule's status would carry them
            code, message, trailers = rpc.status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.error("schedule_failed", request_id=req.request_id, exc_info=exc)
            retry = dict(trailers).get("retry-after-ms", "0")
            raise _http_error(code, message, int(retry) if retry.isdigit() else 0, model) from exc

    def _unary(self) -> s_grpc.SchedulerServiceStub:
        self._unary_turn = (self._unary_turn + 1) % len(self._stubs)
        return self._stubs[self._unary_turn]

    async def report(self, request_id: str, out: Outcome) -> None:
        """``ReportOutcome``, sent again while the control plane is away (module docstring),
        in a ``report`` span."""
        with tracing.span("report"):
            req = s.ReportOutcomeRequest(
                request_id=request_id,
                success=out.success,
                error_class=out.error_class[:128],
                ttft_ms=out.ttft_ms,
                tpot_ms=out.tpot_ms,
                mode_used=_MODE_PB.get(out.mode, s.EXECUTION_MODE_UNSPECIFIED),
                prefill_ms=out.prefill_ms,
                output_tokens=out.output_tokens,
            )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.report_budget_s
            delay = 0.1
            while True:
                # idempotent at the scheduler (an outcome is attached once), so a report the
                # control plane could not take (Redis failing over, a scheduler restarting)
                # is sent again: without it the record never says what happened
                code = await self._report_once(req)
                if code is None:
                    return
                if code not in _RETRYABLE or loop.time() + delay > deadline:
                    log.warning("outcome_not_reported", request_id=request_id, code=code.name)
                    return
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(2.0, delay * 2)

    async def _report_once(self, req: s.ReportOutcomeRequest) -> grpc.StatusCode | None:
        """One try at the report: None when it was taken, else the status it failed with."""
        if self.embedded is not None:
            try:
                await self.embedded.report(req)
            except Exception as exc:  # the policy's errors, as ReportOutcome's status
                return rpc.status_for(exc)[0]
            return None
        try:
            await self._unary().ReportOutcome(
                req, timeout=self.timeout_s, metadata=(("x-request-id", req.request_id),)
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return None

    # -- KV session -------------------------------------------------------------------------

    async def session_done(self, session_id: str) -> None:
        """The decode worker produced a token from the transferred KV: every byte arrived
        (progress and completion in one call)."""
        try:
            await self.broker.CompleteSession(
                kb.CompleteSessionRequest(
                    session_id=session_id, caller=self._caller, all_bytes_arrived=True
                ),
                timeout=self.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("session_not_completed", session_id=session_id, code=exc.code().name)

    async def session_failed(self, session_id: str, reason: str, started: bool) -> None:
        """The transfer failed (``started``: the prefill ran) or never began (aborted)."""
        try:
            if started:
                await self.broker.ReportProgress(
                    kb.ReportProgressRequest(
                        session_id=session_id,
                        caller=self._caller,
                        state=kb.SESSION_STATE_FAILED,
                        reason=reason[:256] or "failed",
                    ),
                    timeout=self.timeout_s,
                )
            else:
                await self.broker.AbortSession(
                    kb.AbortSessionRequest(
                        session_id=session_id, caller=self._caller, reason=reason[:256]
                    ),
                    timeout=self.timeout_s,
                )
        except grpc.aio.AioRpcError as exc:
            log.info("session_not_ended", session_id=session_id, code=exc.code().name)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _http_error(
    code: grpc.StatusCode, details: str, retry_after_ms: int, model: str
) -> GatewayError:
    """A scheduler refusal as the HTTP answer a client understands (module docstring)."""
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return GatewayError(
            429, details or "the fleet is saturated", type_="rate_limit_error",
            code="rate_limited", retry_after_s=max(1, -(-retry_after_ms // 1000)),
        )  # fmt: skip
    if code is grpc.StatusCode.FAILED_PRECONDITION and "no_worker_for_model" in details:
        return GatewayError(
            404, f"the model {model!r} has no worker in the fleet", code="model_not_found",
            param="model",
        )  # fmt: skip
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return GatewayError(400, details, code="invalid_value")
    if code is grpc.StatusCode.ALREADY_EXISTS:  # a request id reused for another request
        return GatewayError(409, details, code="request_id_conflict", param="x-request-id")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(504, "the scheduler did not answer in time", type_="server_error")
    return GatewayError(
        503, details or "the control plane is unavailable", type_="server_error",
        code="unavailable", retry_after_s=1,
    )  # fmt: skip
