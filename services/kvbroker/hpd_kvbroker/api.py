"""KvBrokerService servicer: validate, convert, call the use case, convert back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from hetero_pd.v1 import kvbroker_pb2 as k
from hetero_pd.v1 import kvbroker_pb2_grpc as k_grpc
from hpd_common import rpc, tracing
from hpd_common.errors import InvalidArgument
from hpd_common.kvformat import KvFormat
from hpd_common.server import ServiceComponent
from hpd_kvbroker import convert as cv
from hpd_kvbroker.service import KvBrokerService, OpenRequest

SERVICE_NAME = k.DESCRIPTOR.services_by_name["KvBrokerService"].full_name


def _side(request: k.NegotiateRequest, side: str) -> str | KvFormat:
    which = request.WhichOneof(side)
    if which is None:
        raise InvalidArgument(f"{side}_worker_id", f"give {side}_worker_id or {side}_format")
    if which.endswith("_format"):
        return cv.format_from_pb(getattr(request, which), which)
    return str(getattr(request, which))


class KvBrokerApi(k_grpc.KvBrokerServiceServicer):
    def __init__(self, service: KvBrokerService) -> None:
        self.svc = service

    @rpc.unary
    async def Negotiate(self, request: k.NegotiateRequest, context: Any) -> k.NegotiateResponse:
        source = _side(request, "source")
        destination = _side(request, "destination")
        out = await self.svc.negotiate(source, destination)
        return k.NegotiateResponse(
            negotiation=cv.negotiation_to_pb(out.negotiation),
            source_format=cv.format_to_pb(out.source),
            destination_format=cv.format_to_pb(out.destination),
            conversion_ms=cv.conversion_ms(out.negotiation, request.kv_bytes),
        )

    @rpc.unary
    async def GetCompatibilityMatrix(
        self, request: k.GetCompatibilityMatrixRequest, context: Any
    ) -> k.GetCompatibilityMatrixResponse:
        view = self.svc.compatibility(request.model_id)
        return cv.matrix_to_pb(view, self.svc.matrix.revision)

    @rpc.unary
    async def OpenSession(
        self, request: k.OpenSessionRequest, context: Any
    ) -> k.OpenSessionResponse:
        session, created = await self.svc.open(
            OpenRequest(
                request_id=request.request_id,
                source_worker_id=request.source_worker_id,
                destination_worker_id=request.destination_worker_id,
                expected_bytes=request.expected_bytes,
                deadline_ms=request.deadline_ms,
                lease_ttl_ms=request.lease_ttl_ms,
            ),
            cv.caller_from_pb(request.caller),
        )
        tracing.current_span().set_attribute("hpd.session_id", session.session_id)
        resp = k.OpenSessionResponse(created=created)
        cv.session_to_pb(session, resp.session)
        return resp

    @rpc.unary
    async def ReportProgress(
        self, request: k.ReportProgressRequest, context: Any
    ) -> k.ReportProgressResponse:
        state = cv.state_from_pb("state", request.state or k.SESSION_STATE_TRANSFERRING)
        s = await self.svc.report(
            request.session_id,
            cv.caller_from_pb(request.caller),
            state,
            request.bytes_done,
            request.reason,
        )
        resp = k.ReportProgressResponse()
        cv.session_to_pb(s, resp.session)
        return resp

    @rpc.unary
    async def CompleteSession(
        self, request: k.CompleteSessionRequest, context: Any
    ) -> k.CompleteSessionResponse:
        s = await self.svc.complete(
            request.session_id, cv.caller_from_pb(request.caller), request.all_bytes_arrived
        )
        resp = k.CompleteSessionResponse()
        cv.session_to_pb(s, resp.session)
        return resp

    @rpc.unary
    async def AbortSession(
        self, request: k.AbortSessionRequest, context: Any
    ) -> k.AbortSessionResponse:
        s = await self.svc.abort(
            request.session_id, cv.caller_from_pb(request.caller), request.reason
        )
        resp = k.AbortSessionResponse()
        cv.session_to_pb(s, resp.session)
        return resp

    @rpc.unary
    async def GetSession(self, request: k.GetSessionRequest, context: Any) -> k.GetSessionResponse:
        s = await self.svc.get(request.session_id, request.request_id)
        resp = k.GetSessionResponse()
        cv.session_to_pb(s, resp.session)
        return resp

    @rpc.server_stream
    async def WatchSession(
        self, request: k.WatchSessionRequest, context: Any
    ) -> AsyncIterator[k.WatchSessionResponse]:
        async for s in self.svc.watch(request.session_id, request.request_id, request.from_version):
            yield k.WatchSessionResponse(session=cv.session_to_pb(s))

    @rpc.unary
    async def ListSessions(
        self, request: k.ListSessionsRequest, context: Any
    ) -> k.ListSessionsResponse:
        state = cv.state_from_pb("state", request.state) if request.state else None
        sessions, token = await self.svc.list_sessions(
            state, request.worker_id, request.page_size, request.page_token
        )
        return k.ListSessionsResponse(
            sessions=[cv.session_to_pb(s) for s in sessions], next_page_token=token
        )


class KvBrokerComponent(ServiceComponent):
    """The KV broker as the server bootstrap sees it."""

    service_names = (SERVICE_NAME,)
    service: KvBrokerService

    def add_to_server(self, server: grpc.aio.Server) -> None:
        k_grpc.add_KvBrokerServiceServicer_to_server(KvBrokerApi(self.service), server)

    def drain(self) -> None:
        self.service.drain()
