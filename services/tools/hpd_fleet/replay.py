"""A trace replayed as an OpenAI client would send it: every request goes over HTTP to
``hpd gateway`` (the product's front door, ``hpd_gateway.GatewayServer``), which plans it
with the scheduler and runs the plan on the emulated engines' HTTP servers
(``hpd_fleet.engine_http``), exactly as it runs plans on real vLLM engines.

Per request, at its (time-scaled) arrival: ``POST /v1/completions``, streamed, with a
token-id prompt of the trace's length, ``max_tokens`` and ``ignore_eos`` for its output,
``x-request-id`` and ``x-hpd-tier`` (drawn from the tier mix with the seeded RNG). The
client measures TTFT and TPOT on the stream (emulated ms) and reads what the control plane
decided and what happened from the request's route record (plan, mode used, prefill and
transfer times, the cause of a fallback or a failure).

Answers: 200 with ``[DONE]`` is *completed*; a stream that ends with an error event, or a
502, is *failed* (the route record's error class is the cause); 429 and 404 are *rejected*
(the scheduler's reject class); a 503 or 504 whose request has no REJECT record is the
control plane being unavailable: retried with capped backoff for up to
``unavailable_budget_s`` (a client honouring ``Retry-After``), then rejected as
``unavailable``; a 503 with a REJECT record is that rejection.

Every request ends in exactly one :class:`~hpd_fleet.replay_common.RequestRecord`, the same
record the in-process replay (``hpd_fleet.gateway``) makes, so the report, the live view
and the reconciliation with the route records are shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
from collections.abc import Sequence
from typing import Any

import aiohttp
import grpc

from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.logging import get_logger
from hpd_gateway.service import REPLAN_SUFFIX
from hpd_sim.traces import Trace, TraceRequest

from .engine import EmuTime
from .replay_common import MODE_NAMES, GatewayConfig, Replay, RequestRecord

__all__ = ["HttpReplay"]

log = get_logger("fleet.replay")

_VOCAB = 32_000


class HttpReplay(Replay):
    """Replays traces through ``hpd gateway`` at ``gateway_url`` (module docstring); the
    rest is :class:`~hpd_fleet.replay_common.Replay`'s, as for the in-process replay."""

    def __init__(
        self,
        gateway_url: str,
        scheduler: grpc.aio.Channel,
        time: EmuTime,
        rng: random.Random,
        config: GatewayConfig | None = None,
        run_id: str = "run",
    ) -> None:
        super().__init__(time, rng, config, run_id)
        self.url = gateway_url.rstrip("/")
        self._stub = s_grpc.SchedulerServiceStub(scheduler)
        self._http: aiohttp.ClientSession | None = None

    async def run(self, trace: Trace | Sequence[TraceRequest]) -> list[RequestRecord]:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=300),
        )
        try:
            done = await super().run(trace)
        finally:
            await self._http.close()
            self._http = None
        return await self._fill_plans(done)

    async def _fill_plans(self, records: list[RequestRecord]) -> list[RequestRecord]:
        """Records of requests the gateway served whose route record could not be read at
        the time (a control plane too busy to answer within the client's timeout) get their
        plan now, when it has time: a completed request is never reported without one
        while its record exists."""
        out = []
        for rec in records:
            if rec.status == "completed" and not rec.planned_mode:
                got = await self._record(rec.request_id, wait_outcome=True, patient=True)
                if got is not None and got.HasField("outcome") and not got.outcome.success:
                    again = await self._record(rec.request_id + REPLAN_SUFFIX, True, True)
                    got = again if again is not None else got
                if got is not None:
                    rec = self._planned(rec, got.plan, got.decision)
                    used = (
                        MODE_NAMES.get(got.outcome.mode_used, "") if got.HasField("outcome") else ""
                    )
                    rec = dataclasses.replace(rec, mode_used=used or rec.planned_mode)
            out.append(rec)
        return out

    async def _serve(self, base: RequestRecord) -> RequestRecord:
        cfg = self.config
        rng = random.Random(self.rng.getrandbits(32))  # the prompt's token ids
        body = {
            "model": cfg.model_id,
            "prompt": [rng.randrange(1, _VOCAB) for _ in range(max(1, base.prompt_tokens))],
            "max_tokens": max(1, base.output_tokens),
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"x-request-id": base.request_id, "x-hpd-tier": base.tier}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.unavailable_budget_s
        retries = 0
        while True:
            status, error, first_ms, last_ms, tokens = await self._post(body, headers)
            if status not in (503, 504):
                break
            record = await self._record(base.request_id, wait_outcome=False)
            if record is not None and record.decision == s.ROUTE_DECISION_REJECT:
                break  # the scheduler refused it: not an outage
            if loop.time() >= deadline:
                self.stats.unavailable_retries += retries
                return dataclasses.replace(
                    base, status="rejected", reason="unavailable", schedule_retries=retries
                )
            await self._backoff(retries)
            retries += 1
        self.stats.unavailable_retries += retries
        rec = dataclasses.replace(base, schedule_retries=retries)
        record = await self._record(base.request_id, wait_outcome=status == 200 or status >= 500)
        if (
            status == 200
            and record is not None
            and record.HasField("outcome")
            and not record.outcome.success
        ):  # the chain ran out and the gateway re-planned: that plan served the request
            again = await self._record(base.request_id + REPLAN_SUFFIX, wait_outcome=True)
            record = again if again is not None else record
        if record is not None:
            rec = self._planned(rec, record.plan, record.decision)
        if status in (429, 404) or (status in (503, 504) and record is not None):
            reason = _reject_class(record, error) if status != 404 else "no_capable_worker"
            return dataclasses.replace(rec, status="rejected", reason=reason)
        outcome = record.outcome if record is not None and record.HasField("outcome") else None
        if status == 200 and not error:
            mode = MODE_NAMES.get(outcome.mode_used, "") if outcome is not None else ""
            mode = mode or rec.planned_mode
            cause = outcome.error_class if outcome is not None else ""
            return dataclasses.replace(
                rec,
                status="completed",
                mode_used=mode,
                ttft_ms=first_ms - rec.arrival_ms,
                tpot_ms=(last_ms - first_ms) / (tokens - 1) if tokens > 1 else 0.0,
                prefill_ms=outcome.prefill_ms if outcome is not None else 0.0,
                transfer_ms=outcome.transfer_ms if outcome is not None else 0.0,
                fallback=f"{cause}->{mode}" if cause else "",
                reason=cause,
            )
        cause = (outcome.error_class if outcome is not None else "") or error or f"http_{status}"
        return dataclasses.replace(rec, status="failed", reason=cause, fallback=f"{cause}->none")

    async def _post(
        self, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, str, float, float, int]:
        """One streamed request: (status, error code or "", first and last token times in
        emulated ms, tokens)."""
        assert self._http is not None
        first = last = 0.0
        tokens = 0
        err: Any
        try:
            async with self._http.post(
                self.url + "/v1/completions", json=body, headers=headers
            ) as resp:
                if resp.status != 200:
                    with contextlib.suppress(Exception):
                        err = (await resp.json()).get("error") or {}
                        return resp.status, _error_text(err), 0.0, 0.0, 0
                    return resp.status, f"http_{resp.status}", 0.0, 0.0, 0
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        return 200, "", first, last, tokens
                    event = json.loads(data)
                    if "error" in event:
                        return 200, _error_text(event["error"]), first, last, tokens
                    if event.get("usage"):
                        tokens = int(event["usage"].get("completion_tokens") or tokens)
                    if event.get("choices"):
                        last = self.time.now_ms()
                        if not tokens:
                            first = last
                        tokens = max(tokens, 1)
                return 200, "stream_cut", first, last, tokens
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 599, f"gateway_unreachable:{type(exc).__name__}", first, last, tokens

    async def _record(
        self, rid: str, wait_outcome: bool, patient: bool = False
    ) -> s.RouteRecord | None:
        """The request's route record (with its outcome when ``wait_outcome``: the gateway
        reports it just after the answer); None when there is none or the scheduler does not
        answer. ``patient``: a call that timed out or found the scheduler unavailable is
        asked again (after the replay, nothing else waits on it)."""
        for _ in range(40 if wait_outcome else 1):
            try:
                got = await self._stub.GetRouteRecord(
                    s.GetRouteRecordRequest(request_id=rid), timeout=self.config.rpc_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                retry = code is grpc.StatusCode.NOT_FOUND and wait_outcome
                busy = code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
                if retry or (patient and busy):
                    await asyncio.sleep(0.05)
                    continue
                return None
            record: s.RouteRecord = got.record
            if not wait_outcome or record.HasField("outcome"):
                return record
            await asyncio.sleep(0.05)
        return None


def _error_text(err: Any) -> str:
    if not isinstance(err, dict):
        return "error"
    return str(err.get("code") or err.get("type") or "error")


def _reject_class(rr: s.RouteRecord | None, error: str) -> str:
    """The scheduler's reject class: from the REJECT record, else the HTTP error's code."""
    if rr is not None and rr.decision == s.ROUTE_DECISION_REJECT and rr.reject_class:
        return str(rr.reject_class)
    return error or "rejected"
