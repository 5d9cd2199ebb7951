"""Tracing at the gRPC edges: a server interceptor and a client interceptor, installed by
:class:`~hpd_common.server.GrpcServer` and :func:`~hpd_common.channels.aio_channel` only
while tracing is on (:mod:`hpd_common.tracing`), so a process that does not trace has no
interceptor of this kind at all.

Server: a SERVER span per unary call, named by the full method
(``hetero_pd.v1.SchedulerService/Schedule``), continuing the caller's ``traceparent`` from
the metadata, current while the servicer runs (its own spans and its calls out are
children). Attributes: ``rpc.system``, ``rpc.service``, ``rpc.method``,
``rpc.grpc.status_code``, and the request's ``request_id``, ``session_id`` and
``worker_id`` when it has them (``hpd.*``). Streaming calls get no span of their own: they
live as long as a connection (a registry watch, the gateway's ``ScheduleStream``); what
travels over them carries its own context (:func:`hpd_common.tracing.message_span`).

Client: a CLIENT span per unary call, child of the current span, whose context goes into
the call's metadata.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from hpd_common import tracing

__all__ = ["client_interceptors", "server_interceptors"]

_SUBJECT_FIELDS = ("request_id", "session_id", "worker_id")
# what a server span counts as failed (OpenTelemetry's gRPC conventions: the others are
# the caller's doing, answered as designed)
_SERVER_ERRORS = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})  # fmt: skip
_CONTEXT_KEYS = ("traceparent", "tracestate")


def _rpc_attributes(method: str) -> dict[str, Any]:
    service, _, name = method.lstrip("/").rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _subject(request: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in _SUBJECT_FIELDS:
        value = getattr(request, name, "")
        if value and isinstance(value, str):
            out[f"hpd.{name}"] = value[:128]
    return out


class TracingServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A SERVER span around every unary call (module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        method = str(details.method).lstrip("/")
        carrier = {k: v for k, v in details.invocation_metadata or () if k in _CONTEXT_KEYS}
        inner = handler.unary_unary

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            attributes = _rpc_attributes(method) | _subject(request)
            with tracing.server_span(method, carrier, attributes) as span:
                try:
                    return await inner(request, context)
                finally:
                    code = context.code() if hasattr(context, "code") else None
                    code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    if code in _SERVER_ERRORS:
                        span.set_status(tracing.Status(tracing.StatusCode.ERROR, code.name))

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class TracingClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """A CLIENT span around every unary call, its context in the call's metadata."""

    async def intercept_unary_unary(self, continuation: Any, d: Any, request: Any) -> Any:
        method = d.method.decode() if isinstance(d.method, bytes) else str(d.method)
        method = method.lstrip("/")
        headers: dict[str, str] = {}
        with tracing.client_span(method, headers, _rpc_attributes(method)) as span:
            md = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()))
            for key, value in headers.items():
                md.add(key, value)
            details = grpc.aio.ClientCallDetails(
                d.method, d.timeout, md, d.credentials, d.wait_for_ready
            )
            call = await continuation(details, request)
            code = await call.code()  # the call's end, without raising its error here
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code is not grpc.StatusCode.OK:
                span.set_status(tracing.Status(tracing.StatusCode.ERROR, code.name))
            return call


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The tracing interceptor while tracing is on, else none."""
    return [TracingServerInterceptor()] if tracing.enabled() else []


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The tracing interceptor while tracing is on, else none."""
    return [TracingClientInterceptor()] if tracing.enabled() else []
