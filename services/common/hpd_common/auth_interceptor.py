"""The servers' side of access control: the gRPC interceptor that names each caller (a
bearer token, or the client certificate's names under mutual TLS) by the token book of
`auth.py`, refuses what its role may not call and audits what changes state."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc

from hpd_common.auth import (
    ACCESS,
    NOT_AUDITED,
    PRINCIPAL,
    READ,
    Principal,
    TokenBook,
    method_key,
)
from hpd_common.logging import get_logger

log = get_logger("auth")

_SUBJECT_FIELDS = ("worker_id", "request_id", "session_id")
"""Request fields that name what a call acts on (audited with it)."""


def bearer(metadata: Sequence[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


Behavior = Callable[..., Any]


def _denial(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> Any:
    """A handler of the same shape that refuses the call."""

    if handler.response_streaming:

        async def refuse_stream(
            _request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            await context.abort(code, message)
            yield None  # pragma: no cover - abort raises

        behavior: Behavior = refuse_stream
    else:

        async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)

        behavior = refuse
    return _rebuild(handler, behavior)


def _rebuild(handler: grpc.RpcMethodHandler, behavior: Behavior) -> Any:
    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _behavior(handler: grpc.RpcMethodHandler) -> Behavior:
    """The one behaviour a method handler carries, whatever its streaming shape."""
    found: Behavior = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    return found


def _subject(request: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in _SUBJECT_FIELDS:
        value = getattr(request, name, "")
        if value:
            out[name] = str(value)[:128]
    return out


def _as(handler: grpc.RpcMethodHandler, principal: Principal | None, audit: str | None) -> Any:
    """The handler, run with ``principal`` as :func:`current` (and audited when named)."""
    inner = _behavior(handler)
    if handler.response_streaming:

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            PRINCIPAL.set(principal)
            if audit is not None:
                _audit(audit, principal, {} if handler.request_streaming else _subject(request),
                       "opened", context)  # fmt: skip
            async for item in inner(request, context):
                yield item

        return _rebuild(handler, streaming)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = PRINCIPAL.set(principal)
        outcome = "OK"
        try:
            return await inner(request, context)
        except BaseException:
            outcome = "refused"
            raise
        finally:
            PRINCIPAL.reset(token)
            if audit is not None:
                code = context.code() if hasattr(context, "code") else None
                if code is not None and code != grpc.StatusCode.OK:
                    outcome = getattr(code, "name", str(code))
                subject = {} if handler.request_streaming else _subject(request)
                _audit(audit, principal, subject, outcome, context)

    return _rebuild(handler, unary)


def _audit(
    method: str,
    principal: Principal | None,
    subject: Mapping[str, str],
    outcome: str,
    context: grpc.aio.ServicerContext,
) -> None:
    # at warning level, so that a quieter log level (hpd up's default) still keeps them
    log.warning(
        "audit",
        method=method,
        caller=principal.name if principal else "",
        role=principal.role.value if principal else "",
        peer=context.peer(),
        outcome=outcome,
        **subject,
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks every call's token and role against :data:`ACCESS` (module docstring)."""

    def __init__(self, book: TokenBook, open_reads: bool = True) -> None:
        self.book = book
        self.open_reads = open_reads

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        key = method_key(details.method)
        if handler is None or key is None:
            return handler  # unknown method (gRPC answers UNIMPLEMENTED), health, reflection
        given = bearer(details.invocation_metadata)
        if not given and self.book.has_certificates:
            # the peer's certificate is known only to the call's context: decide there
            return self._by_certificate(handler, key)
        return self._decide(handler, key, self.book.lookup(given), given)

    def _by_certificate(self, handler: grpc.RpcMethodHandler, key: str) -> Any:
        def checked(context: grpc.aio.ServicerContext) -> Behavior:
            names = certificate_names(context.auth_context())
            return _behavior(self._decide(handler, key, self.book.lookup_certificate(names), ""))

        if handler.response_streaming:

            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async for item in checked(context)(request, context):
                    yield item

            return _rebuild(handler, streaming)

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await checked(context)(request, context)

        return _rebuild(handler, unary)

    def _decide(
        self,
        handler: grpc.RpcMethodHandler,
        key: str,
        principal: Principal | None,
        given: str,
    ) -> Any:
        rule = ACCESS.get(key, frozenset())
        if rule == READ and self.open_reads:
            return _as(handler, principal, None)
        if principal is None:
            why = (
                "unknown bearer token"
                if given
                else "no `authorization: Bearer` token"
                + (" and no known client certificate" if self.book.has_certificates else "")
            )
            return _denial(handler, grpc.StatusCode.UNAUTHENTICATED, f"{key}: {why}")
        if isinstance(rule, frozenset) and not principal.operator and principal.role not in rule:
            allowed = sorted({"operator", *(r.value for r in rule)})
            log.info("auth_denied", method=key, caller=principal.name, role=principal.role.value)
            return _denial(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{key} needs role {' or '.join(allowed)}; "
                f"{principal.name!r} is {principal.role.value}",
            )
        audit = None if rule == READ or key in NOT_AUDITED else key
        return _as(handler, principal, audit)


def certificate_names(auth_context: Mapping[str, Sequence[bytes]]) -> list[str]:
    """A verified client certificate's names from a call's auth context: its common name,
    then its subject alternative names; none without mutual TLS."""
    out: list[str] = []
    for field in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth_context.get(field, ()):
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if text and text not in out:
                out.append(text)
    return out


def interceptors_for(tokens_file: str, open_reads: bool) -> list[grpc.aio.ServerInterceptor]:
    """The server's interceptors: the auth check when a tokens file is set, else none."""
    if not tokens_file:
        return []
    book = TokenBook.load(tokens_file)
    log.info("auth_on", tokens=len(book), open_reads=open_reads)
    return [AuthInterceptor(book, open_reads)]
