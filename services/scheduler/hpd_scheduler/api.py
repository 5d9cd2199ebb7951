"""SchedulerService servicer: validate, convert, call the use case, convert back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog

from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common import rpc, tracing
from hpd_common.errors import InvalidArgument
from hpd_common.ids import check_id
from hpd_common.server import ServiceComponent
from hpd_scheduler import convert as cv
from hpd_scheduler.service import SchedulerService

SERVICE_NAME = s.DESCRIPTOR.services_by_name["SchedulerService"].full_name
_STREAM_ITEM = f"{SERVICE_NAME}/ScheduleStream"
"""The span of one request over ScheduleStream (the call itself, which lives as long as
its connection, has none)."""
_STREAM_ATTRIBUTES = {
    "rpc.system": "grpc",
    "rpc.service": SERVICE_NAME,
    "rpc.method": "ScheduleStream",
}


class SchedulerApi(s_grpc.SchedulerServiceServicer):
    def __init__(self, service: SchedulerService) -> None:
        self.svc = service

    @rpc.unary
    async def Schedule(self, request: s.ScheduleRequest, context: Any) -> s.ScheduleResponse:
        out = await self.svc.schedule(cv.request_from_pb(request))
        tracing.current_span().set_attribute("hpd.replayed", out.replayed)
        return s.ScheduleResponse(plan=cv.plan_to_pb(out.head), replayed=out.replayed)

    @rpc.stream_stream
    async def ScheduleStream(
        self, requests: AsyncIterator[s.ScheduleRequest], context: Any
    ) -> AsyncIterator[s.ScheduleStreamResponse]:
        """Reads requests while fewer than ``stream_max_in_flight`` are being decided, decides
        each in a task of its own (so a slow one holds up none), and writes the answers as
        they come (one writer: the stream)."""
        limit = asyncio.Semaphore(self.svc.settings.stream_max_in_flight)
        answers: asyncio.Queue[s.ScheduleStreamResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def decide(req: s.ScheduleRequest) -> None:
            try:
                answers.put_nowait(await self._decide(req))
            finally:
                limit.release()

        async def read() -> None:
            try:
                async for req in requests:
                    await limit.acquire()
                    task = asyncio.ensure_future(decide(req))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
            await reader  # a broken request stream ends the call with its error
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _decide(self, request: s.ScheduleRequest) -> s.ScheduleStreamResponse:
        """One stream item: Schedule's answer, or its status as a ScheduleError; in a span
        of its own that continues the trace the message brings (``hpd_common.tracing``)."""
        rid = request.request_id
        structlog.contextvars.bind_contextvars(request_id=rid[:128])
        with tracing.message_span(_STREAM_ITEM, request, _STREAM_ATTRIBUTES) as span:
            try:
                out = await self.svc.schedule(cv.request_from_pb(request))
            except Exception as exc:  # what Schedule would have returned as a status
                code, message, trailers = rpc.refusal("ScheduleStream", exc)
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                meta = dict(trailers)
                return s.ScheduleStreamResponse(
                    request_id=rid,
                    error=s.ScheduleError(
                        code=code.value[0],
                        message=message,
                        retry_after_ms=int(meta.get("retry-after-ms", "0") or 0),
                        field=meta.get("hpd-field", ""),
                    ),
                )
            span.set_attribute("hpd.replayed", out.replayed)
        return s.ScheduleStreamResponse(
            request_id=rid,
            response=s.ScheduleResponse(plan=cv.plan_to_pb(out.head), replayed=out.replayed),
        )

    @rpc.unary
    async def ReportOutcome(
        self, request: s.ReportOutcomeRequest, context: Any
    ) -> s.ReportOutcomeResponse:
        released, first = await self.svc.report_outcome(
            request.request_id, cv.outcome_from_pb(request)
        )
        return s.ReportOutcomeResponse(released=released, first_report=first)

    @rpc.unary
    async def GetRouteRecord(
        self, request: s.GetRouteRecordRequest, context: Any
    ) -> s.GetRouteRecordResponse:
        check_id("request_id", request.request_id)
        rec = await self.svc.get_record(request.request_id)
        return s.GetRouteRecordResponse(record=cv.record_to_pb(rec))

    @rpc.unary
    async def ListRouteRecords(
        self, request: s.ListRouteRecordsRequest, context: Any
    ) -> s.ListRouteRecordsResponse:
        query, size = cv.query_from_pb(request)
        records, token = await self.svc.list_records(query, size, request.page_token)
        return s.ListRouteRecordsResponse(
            records=[cv.record_to_pb(x) for x in records], next_page_token=token
        )

    @rpc.unary
    async def GetPolicy(self, request: s.GetPolicyRequest, context: Any) -> s.GetPolicyResponse:
        return s.GetPolicyResponse(policy=cv.policy_to_pb(self.svc.policy))

    @rpc.unary
    async def ReloadPolicy(
        self, request: s.ReloadPolicyRequest, context: Any
    ) -> s.ReloadPolicyResponse:
        which = request.WhichOneof("source")
        if which is None:
            raise InvalidArgument("source", "give builtin_profile or profile_yaml")
        if len(request.profile_yaml) > 1_000_000:
            raise InvalidArgument("profile_yaml", "at most 1,000,000 characters")
        state = await self.svc.reload_policy(
            request.builtin_profile, request.profile_yaml, request.dry_run
        )
        return s.ReloadPolicyResponse(policy=cv.policy_to_pb(state), applied=not request.dry_run)

    @rpc.unary
    async def GetRecommendations(
        self, request: s.GetRecommendationsRequest, context: Any
    ) -> s.GetRecommendationsResponse:
        if len(request.model_id) > 128:
            raise InvalidArgument("model_id", "at most 128 characters")
        return cv.recommendations_to_pb(self.svc.recommendations(request.model_id))


class SchedulerComponent(ServiceComponent):
    """The scheduler as the server bootstrap sees it."""

    service_names = (SERVICE_NAME,)
    service: SchedulerService

    def add_to_server(self, server: grpc.aio.Server) -> None:
        s_grpc.add_SchedulerServiceServicer_to_server(SchedulerApi(self.service), server)

    def ready(self) -> bool:
        return bool(self.service.ready())

    def watch_readiness(self, notify: Callable[[], None]) -> None:
        """The fleet view's (re)syncs: SERVING follows at once, not at the next probe."""
        self.service.on_view_synced = notify
