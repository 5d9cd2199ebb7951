"""OpenTelemetry tracing: off unless a process's ``tracing`` setting turns it on.

On, :func:`configure` sets up the SDK from the standard ``OTEL_*`` environment: a tracer
provider whose resource names the service (``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` win over the name the process gives), the sampler of
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default: parent-based, always on), a
batch span processor (``OTEL_BSP_*``) and the OTLP/gRPC exporter, which reads
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``; default localhost:4317) and
its ``INSECURE``, ``HEADERS``, ``CERTIFICATE``, ``TIMEOUT`` and ``COMPRESSION`` siblings.
``OTEL_TRACES_EXPORTER=console`` prints spans instead, ``none`` exports nothing (contexts
still cross the hops); ``OTEL_SDK_DISABLED=true`` keeps tracing off whatever the setting.

Off (the default) nothing of the SDK is imported and no exporter exists. Every helper here
answers at once: a span is the API's no-op span (``INVALID_SPAN``) entered through one
shared context object, inject and extract do nothing, the trace id is '', and the gRPC
interceptors (:mod:`hpd_common.tracing_interceptor`) are not installed. A request pays a
few function calls, no allocation.

Contexts cross the hops as W3C trace context (``traceparent``, ``tracestate``): in gRPC
metadata (the interceptors), in a ``ScheduleStream`` message's ``trace_context`` (one
stream carries many requests: :func:`inject_message`, :func:`message_span`), and in the
HTTP headers of the engine calls (:func:`client_span`; vLLM continues the trace and
exports its own spans with ``--otlp-traces-endpoint``).

The policy core never imports this module: spans and their attributes are the edges'.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, MutableMapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from hpd_common.logging import get_logger

__all__ = [
    "OFF",
    "AttributeValue",
    "Span",
    "SpanKind",
    "Status",
    "StatusCode",
    "client_span",
    "configure",
    "current_span",
    "current_trace_id",
    "enabled",
    "exporter",
    "flush",
    "inject",
    "inject_message",
    "message_span",
    "server_span",
    "shutdown",
    "span",
]

log = get_logger("tracing")

Attributes = Mapping[str, AttributeValue]

OFF: AbstractContextManager[Span] = contextlib.nullcontext(INVALID_SPAN)
"""What every span helper returns while tracing is off: one shared, reusable context that
enters as the API's no-op span (so ``with span(...) as s: s.set_attribute(...)`` costs no
allocation)."""

_W3C = TraceContextTextMapPropagator()
_NOOP: trace.Tracer = trace.NoOpTracer()


class _State:
    """The process's tracing (one provider per process, set up once)."""

    on = False
    tracer: trace.Tracer = _NOOP
    provider: Any = None  # the SDK's TracerProvider while on
    exporter: Any = None  # its span exporter (None: off, or OTEL_TRACES_EXPORTER=none)


_state = _State()


def enabled() -> bool:
    """Whether this process traces."""
    return _state.on


def exporter() -> Any:
    """The span exporter in use (None while tracing is off)."""
    return _state.exporter


def configure(on: bool, service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on for this process when ``on`` (the service's setting) and
    ``OTEL_SDK_DISABLED`` is not true; returns whether it is on. ``service_name`` names the
    process unless the environment does. Idempotent: the first call that turns it on sets
    it up, later ones keep it. Off, nothing is imported or made. (``env`` is where
    ``OTEL_SDK_DISABLED`` and ``OTEL_TRACES_EXPORTER`` are read; the SDK reads the rest of
    its variables from the process's environment.)"""
    env = os.environ if env is None else env
    if not on or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return _state.on
    if _state.on:
        return True
    # imported only here: a process that does not trace never loads the SDK
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service_name}))
    provider = TracerProvider(resource=resource)
    kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    span_exporter: Any = None
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        span_exporter = ConsoleSpanExporter()
    elif kind != "none":
        if kind != "otlp":
            log.warning("tracing_exporter_unknown", exporter=kind, using="otlp")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter()
    if span_exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
    _state.provider, _state.exporter = provider, span_exporter
    _state.tracer = provider.get_tracer("hetero-pd")
    _state.on = True
    log.info(
        "tracing_on",
        service=provider.resource.attributes.get("service.name", service_name),
        exporter=kind,
        endpoint=env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
    )
    return True


def flush(timeout_ms: int = 5_000) -> bool:
    """Export every span ended so far (blocks up to ``timeout_ms``); True when all went."""
    provider = _state.provider
    return bool(provider.force_flush(timeout_ms)) if provider is not None else True


def shutdown(timeout_ms: int = 5_000) -> None:
    """Export what is still buffered (for up to ``timeout_ms``), then turn tracing off."""
    provider = _state.provider
    _state.on, _state.tracer, _state.provider, _state.exporter = False, _NOOP, None, None
    if provider is not None:
        provider.force_flush(timeout_ms)
        provider.shutdown()


# -- spans -------------------------------------------------------------------------------


def span(
    name: str, kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes | None = None
) -> AbstractContextManager[Span]:
    """A span, current inside the ``with`` block, child of the current one."""
    if not _state.on:
        return OFF
    return _state.tracer.start_as_current_span(name, kind=kind, attributes=attributes)


def server_span(
    name: str, carrier: Mapping[str, Any] | None, attributes: Attributes | None = None
) -> AbstractContextManager[Span]:
    """A SERVER span, current inside the block, continuing the trace context ``carrier``
    brings (HTTP headers, a mapping of metadata); a new trace when it brings none."""
    if not _state.on:
        return OFF
    parent = _W3C.extract(carrier) if carrier else None
    return _state.tracer.start_as_current_span(
        name,
        context=parent,
        kind=SpanKind.SERVER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    )


def message_span(
    name: str, message: Any, attributes: Attributes | None = None
) -> AbstractContextManager[Span]:
    """:func:`server_span` for one message of a stream that carries many requests: the
    context is the message's ``trace_context`` map, and its ``request_id`` an attribute
    (``hpd.request_id``); the message is not read while tracing is off."""
    if not _state.on:
        return OFF
    attrs = dict(attributes or {})
    request_id = getattr(message, "request_id", "")
    if request_id:
        attrs["hpd.request_id"] = str(request_id)[:128]
    return server_span(name, message.trace_context, attrs)


class _ClientSpan:
    """A CLIENT span that is not made current (it may live across an async generator's
    yields) and ends when the block does; an exception (not a cancellation or a generator
    closed early) marks it failed."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> Span:
        return self._span

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, Exception):
            self._span.record_exception(exc)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))
        self._span.end()


def client_span(
    name: str, headers: MutableMapping[str, str], attributes: Attributes | None = None
) -> AbstractContextManager[Span]:
    """A CLIENT span for a call out (child of the current span) whose context is written
    into ``headers`` (``traceparent``, ``tracestate``) for the callee to continue."""
    if not _state.on:
        return OFF
    out = _state.tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
    _W3C.inject(headers, context=trace.set_span_in_context(out))
    return _ClientSpan(out)


def current_span() -> Span:
    """The span being recorded here (the no-op span while tracing is off)."""
    if not _state.on:
        return INVALID_SPAN
    return trace.get_current_span()


def current_trace_id() -> str:
    """The current trace's id as 32 lowercase hex digits; '' when off or outside a trace."""
    if not _state.on:
        return ""
    ctx = trace.get_current_span().get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else ""


# -- propagation -------------------------------------------------------------------------


def inject(carrier: MutableMapping[str, str]) -> None:
    """Write the current trace context into ``carrier`` (headers, metadata, a map field)."""
    if _state.on:
        _W3C.inject(carrier)


def inject_message(message: Any) -> None:
    """Write the current trace context into ``message.trace_context`` (see
    :func:`message_span`); nothing is touched while tracing is off."""
    if _state.on:
        _W3C.inject(message.trace_context)
