"""The one place where domain errors become gRPC status codes (DESIGN.md section 5).

Every servicer method is wrapped by `unary`, `server_stream` or `stream_stream`:
the wrapper binds a request id (from the `x-request-id` metadata, or a fresh one)
into the structlog context, counts and times the call, and translates:

| raised                         | status              |
|--------------------------------|---------------------|
| InvalidArgument                | INVALID_ARGUMENT    |
| NotFound                       | NOT_FOUND           |
| AlreadyExists                  | ALREADY_EXISTS      |
| PermissionDenied               | PERMISSION_DENIED   |
| FailedPrecondition             | FAILED_PRECONDITION |
| ResourceExhausted              | RESOURCE_EXHAUSTED (+ `retry-after-ms` trailer) |
| Aborted                        | ABORTED             |
| Unavailable, Redis conn/timeout| UNAVAILABLE         |
| Redis OOM/READONLY/MASTERDOWN  | UNAVAILABLE (Redis refuses writes for now) |
| anything else                  | INTERNAL (logged with its traceback: a bug) |

`context.abort` raises `grpc.aio.AbortError`, which passes through untouched.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import redis.exceptions
import structlog

from hpd_common import errors, metrics
from hpd_common.logging import get_logger
from hpd_common.redis_conn import STORE_DOWN

log = get_logger("rpc")

Req = TypeVar("Req")
Resp = TypeVar("Resp")

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Aborted, grpc.StatusCode.ABORTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    # what a store would have turned into Unavailable, had it caught it (the Redis kinds
    # only: any OSError at the edge is not a store's)
    *(
        (kind, grpc.StatusCode.UNAVAILABLE)
        for kind in STORE_DOWN
        if issubclass(kind, redis.exceptions.RedisError)
    ),
    (ConnectionError, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.UNAVAILABLE),
]


def metadata_safe(value: str, limit: int = 256) -> str:
    """A metadata value gRPC will send: printable ASCII, non-ASCII escaped (a field path can
    hold a caller's label key; one emoji in a trailer made the status unsendable and left
    the caller waiting for its deadline)."""
    text = value.encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(ch if 32 <= ord(ch) < 127 else f"\\x{ord(ch):02x}" for ch in text)
    return text[:limit]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status code, message and trailing metadata for an exception."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            trailers: tuple[tuple[str, str], ...] = ()
            if isinstance(exc, errors.InvalidArgument):
                trailers = (("hpd-field", metadata_safe(exc.field)),)
            elif isinstance(exc, errors.ResourceExhausted) and exc.retry_after_ms:
                trailers = (("retry-after-ms", str(exc.retry_after_ms)),)
            message = str(exc) or kind.__name__
            if code is grpc.StatusCode.UNAVAILABLE and not isinstance(exc, errors.HpdError):
                message = f"state store unavailable: {message}"
            return code, message, trailers
    return grpc.StatusCode.INTERNAL, "internal error (logged)", ()


def _request_id(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and value:
            return str(value)[:128]
    return uuid.uuid4().hex[:16]


def refusal(
    method: str, exc: BaseException
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """`status_for`, logged and counted as a call of ``method`` that failed (also for one
    item of a stream that answers each item with its own status)."""
    code, message, trailers = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("rpc_failed", method=method, exc_info=exc)
    else:
        log.info("rpc_refused", method=method, code=code.name, detail=message)
    metrics.RPC_ERRORS.labels(method=method, code=code.name).inc()
    return code, message, trailers


async def _abort(context: Any, method: str, exc: BaseException) -> None:
    code, message, trailers = refusal(method, exc)
    if trailers:
        context.set_trailing_metadata(trailers)
    await context.abort(code, message)


def _bind(method: str, context: Any) -> float:
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=_request_id(context), rpc=method)
    return time.perf_counter()


def unary(
    fn: Callable[[Any, Req, Any], Awaitable[Resp]],
) -> Callable[[Any, Req, Any], Awaitable[Resp]]:
    """Wraps a unary-unary servicer method."""
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: Any) -> Resp:
        start = _bind(method, context)
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # translated; INTERNAL is logged with its traceback
            await _abort(context, method, exc)
            raise AssertionError("unreachable: abort raises") from exc
        finally:
            metrics.RPC_SECONDS.labels(method=method).observe(time.perf_counter() - start)

    return wrapper


def server_stream(
    fn: Callable[[Any, Req, Any], AsyncIterator[Resp]],
) -> Callable[[Any, Req, Any], AsyncIterator[Resp]]:
    """Wraps a unary-stream servicer method (an async generator)."""
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: Any) -> AsyncIterator[Resp]:
        _bind(method, context)
        try:
            async for item in fn(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, method, exc)

    return wrapper


def stream_stream(
    fn: Callable[[Any, AsyncIterator[Req], Any], AsyncIterator[Resp]],
) -> Callable[[Any, AsyncIterator[Req], Any], AsyncIterator[Resp]]:
    """Wraps a stream-stream servicer method (an async generator)."""
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Any, requests: AsyncIterator[Req], context: Any) -> AsyncIterator[Resp]:
        _bind(method, context)
        try:
            async for item in fn(self, requests, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, method, exc)

    return wrapper
