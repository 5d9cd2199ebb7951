"""One client request, end to end: count, schedule, run the plan on the engines, report.

1. **Count** the prompt's tokens (``counting.py``) with the model's tokenizer when the
   gateway has it (``tokens.py``), else with an engine's ``/tokenize`` (a decode-capable
   worker of the model first). A model no worker serves is 404 before anything is scheduled.
2. **Schedule** with the request id, the tier, the prompt and expected output tokens.
3. **Run** the plan's steps in order, primary first:

   * TRANSFER: vLLM's NIXL hand-off. Prefill gets one output token and
     ``kv_transfer_params: {"do_remote_decode": true}``; decode gets the client's body with
     the parameters the prefill returned. Decode's first event means the KV arrived: the
     broker's session (opened by the scheduler for the primary step) then gets its bytes
     and COMPLETE; a failed step marks it FAILED (or ABORTED when the prefill never ran);
   * RECOMPUTE and SAME_POOL: the client's body straight to the planned decode worker.

   A step that fails before anything reached the client (connect error, timeout, 5xx, a KV
   pull the decode engine reports as failed) moves to the next step; a fallback step whose
   workers have left the fleet is skipped. When every step has failed, the gateway asks
   for one new plan (request id ``<id>:replan``; the first plan is reported failed, so
   its reservations go back) and runs it the same way; then it answers 502. Once a token
   has reached the client the request is never restarted: the stream ends with an error
   event and ``[DONE]``. An engine's 4xx is the request's own fault and goes back to the
   client as is.
4. **Report** the outcome (TTFT, TPOT, the mode really used, the first failed step's cause)
   with ``ReportOutcome``, also when the client hung up (that cancels the engine calls).

TTFT is measured from the request's arrival at the gateway to the first token event sent
to the client; TPOT is ``(last - first) / (tokens - 1)``; tokens are counted by the engine's
usage figure when it sends one, else by events carrying a choice.

While the gateway traces (``--tracing``; ``hpd_common.tracing``), the request's span
(``api.py``) has a child per step above: ``tokenize``, ``schedule`` (continued by the
scheduler, and by the broker for the KV session), ``prefill`` and ``decode`` on the engines
(which get its ``traceparent``), the session calls and ``report``. The engines get the
request id as ``X-Request-Id``: the plan's for the primary step, ``<id>:<step>`` for a
fallback (a fallback on the same engine never collides with the step it replaces).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hpd_common import tracing
from hpd_common.kvchain import chain_hashes
from hpd_common.logging import get_logger
from hpd_scheduler.policy.domain import MAX_AVOID_WORKERS as MAX_AVOID

from .control_client import ControlPlane
from .counting import PromptCounting
from .engine_client import CHOICES, USAGE, EngineHttp, Hop, UpstreamError
from .metrics import GatewayMetrics
from .plan import TRANSFER, Outcome, Plan, Step
from .protocol import (
    ClientRequest,
    GatewayError,
    decode_body,
    error_body,
    prefill_body,
    sse_event,
    strip_usage_chunk,
)
from .tokens import LocalTokenizers

__all__ = ["REPLAN_SUFFIX", "Gateway", "GatewayConfig", "Sink"]

log = get_logger("gateway")

REPLAN_SUFFIX = ":replan"
"""The request id of the one re-plan after a plan's fallback chain ran out is the request's
id with this suffix (its route record carries the request's final outcome)."""


class Sink(Protocol):
    """Where the answer goes (the HTTP response). ``server_timing``: the gateway's own
    steps so far (milliseconds by name), which the answer's headers carry."""

    server_timing: dict[str, float]

    async def start_stream(self) -> None:
        """Commit to 200 and server-sent events (called once, before the first event)."""
        ...

    async def send(self, data: bytes) -> None: ...

    async def send_json(self, status: int, body: Any, retry_after_s: int = 0) -> None:
        """The whole answer at once (non-streamed requests and errors before streaming)."""
        ...


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    default_tier: str = "standard"
    default_output_tokens: int = 256
    prefix_routing: bool = True


MAX_PREFIX_BLOCKS = 8192  # what Schedule accepts


class _Exhausted(GatewayError):
    """Every step of a plan failed before anything reached the client."""


def _failed_worker(step: Step, cause: str) -> str:
    """The worker whose phase failed (its cause's prefix says which; '' when neither, as a
    KV hand-off between the two)."""
    if cause.startswith("prefill_"):
        return step.prefill_worker or step.decode_worker  # a local prefill is decode's
    return step.decode_worker if cause.startswith("decode_") else ""


class _StepFailed(Exception):
    def __init__(self, cause: str, after_first_token: bool, upstream: UpstreamError) -> None:
        super().__init__(cause)
        self.cause = cause
        self.after_first_token = after_first_token
        self.upstream = upstream


class Gateway(PromptCounting):
    """The use case behind both OpenAI endpoints (module docstring)."""

    def __init__(
        self,
        control: ControlPlane,
        engines: EngineHttp,
        metrics: GatewayMetrics,
        config: GatewayConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        tokenizers: LocalTokenizers | None = None,
    ) -> None:
        self.tokenizers = tokenizers
        self.control = control
        self.engines = engines
        self.metrics = metrics
        self.config = config or GatewayConfig()
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the reports still on their way; cancel the rest."""
        tasks = set(self._tasks)
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            log.warning("reports_abandoned", count=len(late))

    def _background(self, aw: Awaitable[None]) -> None:
        async def run() -> None:
            await aw

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _prefix(self, model: str, ids: list[int] | None) -> tuple[tuple[int, ...], int]:
        """The prompt's block chain at the engines' block size (``hpd_common.kvchain``), for
        prefix-aware planning; empty without token ids or a known block size."""
        if not ids or not self.config.prefix_routing:
            return (), 0
        block = self.control.block_tokens(model)
        if block <= 0 or len(ids) < block:
            return (), 0
        return chain_hashes(ids, block)[:MAX_PREFIX_BLOCKS], block

    def _output_tokens(self, req: ClientRequest, prompt_tokens: int) -> int:
        """The output tokens to plan (and reserve KV) for: the client's ``max_tokens``, else
        the default, clamped to what the model's context leaves after the prompt, as vLLM
        clamps the generation; 400 when the prompt alone fills the context (the engine
        would refuse it after its KV had been reserved)."""
        ctx = self.control.context_tokens(req.model)
        if ctx and prompt_tokens >= ctx:
            raise GatewayError(
                400, f"the prompt's {prompt_tokens} tokens leave no room in the model's "
                f"context of {ctx} tokens", param="prompt", code="context_length_exceeded",
            )  # fmt: skip
        out = req.max_tokens or self.config.default_output_tokens
        return min(out, ctx - prompt_tokens) if ctx else out

    async def _size(
        self, req: ClientRequest, charge: Callable[[int], None] | None
    ) -> tuple[int, int, tuple[int, ...], int]:
        """(prompt tokens, output tokens to plan, prefix block chain, block size), the tokens
        charged to the caller's key."""
        with tracing.span("tokenize"):
            prompt_tokens, ids = await self._count_tokens(req)
        output_tokens = self._output_tokens(req, prompt_tokens)
        if charge is not None:
            charge(prompt_tokens + output_tokens)
        prefix, block = self._prefix(req.model, ids)
        return prompt_tokens, output_tokens, prefix, block

    async def handle(
        self,
        req: ClientRequest,
        sink: Sink,
        request_id: str = "",
        tier: str = "",
        charge: Callable[[int], None] | None = None,
    ) -> Outcome:
        """Serve one request into ``sink`` (module docstring); returns what happened.
        ``charge``: takes the request's prompt and output tokens from its key's budget (raises
        the 429), called once they are counted."""
        t0 = self._clock()
        request_id = request_id or "gw-" + uuid.uuid4().hex
        out = Outcome()
        plan: Plan | None = None
        self.metrics.in_flight.inc()
        try:
            prompt_tokens, output_tokens, prefix, block = await self._size(req, charge)
            tier = tier or self.config.default_tier
            t_s = self._clock()
            out.tokenize_ms = (t_s - t0) * 1000
            sink.server_timing["tokenize"] = out.tokenize_ms
            self.metrics.tokenize_seconds.observe(t_s - t0)
            plan = await self.control.schedule(
                request_id, req.model, prompt_tokens, output_tokens, tier, prefix, block
            )
            out.schedule_ms = (self._clock() - t_s) * 1000
            sink.server_timing["schedule"] = out.schedule_ms
            self.metrics.schedule_seconds.observe(out.schedule_ms / 1000)
            try:
                await self._run(req, plan, sink, t0, out)
            except _Exhausted:  # once more, from a view that knows what failed (_replan)
                request_id = self._give_up(request_id, out)
                ask = (prompt_tokens, output_tokens, tier, prefix, block)
                plan = await self._replan(req, sink, out, request_id, ask)
                cause, out.error_class = out.error_class, ""
                await self._run(req, plan, sink, t0, out)
                out.error_class = out.error_class or cause
                self.metrics.fallbacks.labels("replanned").inc()
        except GatewayError as exc:
            out.status = exc.status
            out.error_class = out.error_class or exc.code
            await sink.send_json(exc.status, exc.body(), exc.retry_after_s)
        except asyncio.CancelledError:  # the client hung up: engine calls are closed
            out.status = 499
            out.error_class = out.error_class or "client_gone"
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(str(out.status), out.mode or "none").inc()
            if out.success:
                self.metrics.ttft.observe(out.ttft_ms / 1000)
                if out.output_tokens > 1:
                    self.metrics.tpot.observe(out.tpot_ms / 1000)
            if plan is not None:
                # also when the client hung up and this task is being cancelled
                self._background(self.control.report(request_id, out))
            log.info(
                "request_served",
                request_id=request_id,
                status=out.status,
                mode=out.mode,
                ttft_ms=round(out.ttft_ms, 1),
                tokenize_ms=round(out.tokenize_ms, 2),
                schedule_ms=round(out.schedule_ms, 2),
                prefill_ms=round(out.prefill_ms, 1),
                fallbacks=out.fallbacks,
                error_class=out.error_class,
            )
        return out

    def _give_up(self, request_id: str, out: Outcome) -> str:
        """Every step of the plan failed before a token was sent: report it failed (its
        reservations go back); the request id the re-plan goes under."""
        first = Outcome(error_class=out.error_class, fallbacks=out.fallbacks, status=502)
        self._background(self.control.report(request_id, first))
        return f"{request_id}{REPLAN_SUFFIX}"

    async def _replan(
        self, req: ClientRequest, sink: Sink, out: Outcome, request_id: str,
        ask: tuple[int, int, str, tuple[int, ...], int],
    ) -> Plan:  # fmt: skip
        """The failed plan was made from a view that did not yet know what just failed (a
        worker dies between two feed events): a new plan, under a request id of its own,
        avoiding the workers whose steps failed (the view may list them until their leases
        lapse)."""
        prompt_tokens, output_tokens, tier, prefix, block = ask
        t_s = self._clock()
        plan = await self.control.schedule(
            request_id, req.model, prompt_tokens, output_tokens, tier, prefix, block,
            avoid=tuple(out.failed_workers[:MAX_AVOID]),
        )  # fmt: skip
        out.schedule_ms += (self._clock() - t_s) * 1000
        sink.server_timing["schedule"] = out.schedule_ms
        return plan

    async def _run(
        self, req: ClientRequest, plan: Plan, sink: Sink, t0: float, out: Outcome
    ) -> None:
        first_cause = ""
        for i, planned in enumerate(plan.steps):
            step = self._resolve(planned)
            if step is None:
                continue
            session = plan.session_id if i == 0 and step.mode == TRANSFER else ""
            rid = plan.request_id if i == 0 else f"{plan.request_id}:{i}"  # the engines' id
            try:
                await self._step(req, rid, step, session, sink, t0, out)
                out.success = True
                out.mode = step.mode
                out.error_class = first_cause
                return
            except _StepFailed as exc:
                up = exc.upstream
                self.metrics.upstream_errors.labels(up.endpoint, up.cause).inc()
                log.info(
                    "step_failed", request_id=plan.request_id, step=i, mode=step.mode,
                    cause=exc.cause, detail=up.detail[:200],
                )  # fmt: skip
                first_cause = first_cause or exc.cause
                if exc.after_first_token:
                    out.mode = step.mode
                    out.error_class = exc.cause
                    out.status = 502
                    err = error_body(
                        f"the engine failed mid-stream ({exc.cause}); the request was not "
                        "restarted", "server_error", "upstream_error",
                    )  # fmt: skip
                    with contextlib.suppress(ConnectionError):
                        await sink.send(sse_event(err))
                        await sink.send(sse_event("[DONE]"))
                    return
                if not up.retryable:
                    raise GatewayError(up.status or 400, up.detail, code="invalid_value") from up
                out.fallbacks += 1
                self.metrics.fallbacks.labels(exc.cause).inc()
                failed = _failed_worker(step, exc.cause)  # a re-plan avoids it (``handle``)
                if failed and failed not in out.failed_workers:
                    out.failed_workers.append(failed)
        out.error_class = first_cause or "no_step_left"
        raise _Exhausted(
            502, f"every step of the plan failed (first: {out.error_class})",
            type_="server_error", code="upstream_error",
        )  # fmt: skip

    def _resolve(self, step: Step) -> Step | None:
        """Endpoints for a step that named only its workers; None when one has left."""
        dec = step.decode_endpoint or self.control.endpoint(step.decode_worker)
        pre = step.prefill_endpoint
        if step.mode == TRANSFER and not pre:
            pre = self.control.endpoint(step.prefill_worker)
            if not pre:
                return None
        if not dec:
            return None
        return Step(step.mode, step.decode_worker, dec, step.prefill_worker, pre, step.reason)

    async def _step(
        self,
        req: ClientRequest,
        rid: str,
        step: Step,
        session: str,
        sink: Sink,
        t0: float,
        out: Outcome,
    ) -> None:
        params: dict[str, Any] | None = None
        prefilled = False
        t_step = self._clock()
        try:
            if step.mode == TRANSFER:
                t_p = self._clock()
                try:
                    reply = await self.engines.post_json(
                        step.prefill_endpoint, req.path, prefill_body(req),
                        hop=Hop("prefill", rid, step.prefill_worker),
                    )  # fmt: skip
                except UpstreamError as exc:
                    raise _StepFailed("prefill_" + exc.cause, False, exc) from exc
                out.prefill_ms = (self._clock() - t_p) * 1000
                sink.server_timing["prefill"] = out.prefill_ms
                kv = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
                if not isinstance(kv, dict):
                    raise _StepFailed(
                        "prefill_bad_reply",
                        False,
                        UpstreamError("bad_reply", step.prefill_endpoint, "no kv_transfer_params"),
                    )
                params, prefilled = kv, True
            body = decode_body(req, params)
            if req.stream:
                await self._stream(req, step, body, session, rid, sink, (t0, t_step), out)
            else:
                try:
                    reply = await self.engines.post_json(
                        step.decode_endpoint, req.path, body,
                        hop=Hop("decode", rid, step.decode_worker),
                    )  # fmt: skip
                except UpstreamError as exc:
                    raise _StepFailed("decode_" + exc.cause, False, exc) from exc
                if isinstance(reply, dict):
                    reply.pop("kv_transfer_params", None)
                    usage = reply.get("usage") or {}
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                out.ttft_ms = (self._clock() - t0) * 1000
                if session:
                    self._background(self.control.session_done(session))
                await sink.send_json(200, reply)
        except _StepFailed as exc:
            # after the first token the KV had arrived: the session is COMPLETE already
            if session and not exc.after_first_token:
                self._background(self.control.session_failed(session, exc.cause, prefilled))
            raise
        except asyncio.CancelledError:
            if session and not out.ttft_ms:  # the client left before the KV was used
                self._background(self.control.session_failed(session, "client_gone", prefilled))
            raise

    async def _stream(
        self,
        req: ClientRequest,
        step: Step,
        body: dict[str, Any],
        session: str,
        rid: str,
        sink: Sink,
        times: tuple[float, float],
        out: Outcome,
    ) -> None:
        """Stream the decode engine's answer (the engine runs it as ``rid``); ``times``: when
        the request and this step began. A step served on one engine reports that engine's
        time to its first token as its ``prefill_ms`` (what the scheduler's learner fits; the
        gateway's own time before the step is no engine's)."""
        t0, t_step = times
        sent = 0
        started = False
        first = last = 0.0
        usage_tokens = 0
        try:
            hop = Hop("decode", rid, step.decode_worker)
            async for payload in self.engines.stream(step.decode_endpoint, req.path, body, hop):
                if payload is None:
                    if not started:  # an empty stream is still a stream
                        started = True
                        await sink.start_stream()
                    await sink.send(sse_event("[DONE]"))
                    break
                has_choice = CHOICES.search(payload) is not None
                if USAGE.search(payload):  # rare: decode only this one (the last event)
                    event = json.loads(payload)
                    usage_tokens = int((event.get("usage") or {}).get("completion_tokens") or 0)
                    if strip_usage_chunk(event, req.include_usage):
                        continue
                    if not req.include_usage:
                        event.pop("usage", None)
                        payload = json.dumps(event, separators=(",", ":")).encode()
                if not started:
                    started = True
                    await sink.start_stream()
                    first = self._clock()
                    out.ttft_ms = (first - t0) * 1000
                    if step.mode != TRANSFER:
                        out.prefill_ms = (first - t_step) * 1000
                    if session:
                        self._background(self.control.session_done(session))
                await sink.send(b"data: " + payload + b"\n\n")
                if has_choice:
                    sent += 1
                    last = self._clock()
        except UpstreamError as exc:
            raise _StepFailed("decode_" + exc.cause, started, exc) from exc
        out.output_tokens = usage_tokens or sent
        if out.output_tokens > 1 and last > first:
            out.tpot_ms = (last - first) * 1000 / (out.output_tokens - 1)
