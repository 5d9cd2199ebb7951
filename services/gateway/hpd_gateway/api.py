"""The HTTP edge: OpenAI routes on aiohttp, errors in OpenAI's shape, limits, client keys.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not),
``GET /v1/models`` (the fleet's models), ``GET /health`` (200 while the fleet view is
fresh). ``/metrics`` is served on a listener of its own (``build_metrics_app``): the public
port does not show engines' addresses. Headers read: ``x-request-id`` (else one is made; it
is echoed back), ``Authorization: Bearer <key>`` (with ``--api-keys``: the tenant, its tiers
and limits, ``keys.py``), ``x-hpd-tier`` (within what the key allows; else the key's tier,
else the default), ``traceparent`` (with ``--tracing``: the request's span continues the
client's trace; ``service.py`` lists its children). Answers carry ``x-request-id`` and a
``Server-Timing`` header with the gateway's own steps (``tokenize``, ``schedule``, and for
a transfer the ``prefill`` call) in milliseconds.

What an outsider cannot exhaust: the body is read under ``body_timeout_s`` (408 after it)
and a request takes its place among the ``max_concurrent`` in flight only once its body is
read and checked, so slow bodies hold no place; bodies over ``max_body_bytes`` are 413;
past ``max_concurrent`` a request is 429 with ``Retry-After``. The request id the scheduler
keys its plan by is the tenant's namespace plus the client's id, and a second request under
an id still in flight is 409 (it would share the first one's reservation). Every error,
the handler's own bugs included, is one OpenAI-shaped JSON body (one middleware). A
client that hangs up cancels its handler, which closes the engine connections (vLLM aborts
a request whose connection closes).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hpd_common import tracing
from hpd_common.ids import is_id
from hpd_common.logging import get_logger

from .keys import ApiKey, ApiKeys
from .plan import Outcome
from .protocol import CHAT, COMPLETIONS, ClientRequest, GatewayError, error_body, parse_request
from .service import Gateway

__all__ = ["build_app", "build_metrics_app"]

log = get_logger("gateway")

MAX_SCHEDULER_ID = 128  # the scheduler's request-id limit
PARSE_OFF_LOOP_BYTES = 256 << 10
"""Bodies larger than this are parsed on a worker thread: a 4 MiB JSON body takes tens of
milliseconds to parse, which every stream on the event loop would otherwise wait out."""


class _HttpSink:
    """Writes a handler's answer: one JSON body, or a stream of server-sent events."""

    def __init__(self, request: web.Request, request_id: str) -> None:
        self.request = request
        self.request_id = request_id
        self.response: web.StreamResponse | None = None
        self.server_timing: dict[str, float] = {}

    def _headers(self) -> dict[str, str]:
        headers = {"x-request-id": self.request_id}
        if self.server_timing:  # W3C Server-Timing: the gateway's own steps, in ms
            headers["Server-Timing"] = ", ".join(
                f"{name};dur={ms:.2f}" for name, ms in self.server_timing.items()
            )
        return headers

    async def start_stream(self) -> None:
        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **self._headers(),
            },
        )
        await resp.prepare(self.request)
        self.response = resp

    async def send(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def send_json(self, status: int, body: Any, retry_after_s: int = 0) -> None:
        headers = self._headers()
        if retry_after_s:
            headers["Retry-After"] = str(retry_after_s)
        self.response = web.json_response(body, status=status, headers=headers)


_SPANS = {COMPLETIONS: "POST /v1/completions", CHAT: "POST /v1/chat/completions"}
"""The request span's name per endpoint (HTTP method and route)."""


def _request_attributes(
    request: web.Request, sid: str, req: ClientRequest, tier: str
) -> dict[str, tracing.AttributeValue]:
    return {
        "http.request.method": request.method, "url.path": request.path,
        "hpd.request_id": sid, "hpd.model": req.model, "hpd.tier": tier,
        "hpd.stream": req.stream,
    }  # fmt: skip


def _outcome_attributes(out: Outcome) -> dict[str, tracing.AttributeValue]:
    """What happened, as the outcome report tells the scheduler (``plan.Outcome``)."""
    return {
        "hpd.mode": out.mode or "none", "hpd.success": out.success,
        "hpd.error_class": out.error_class, "hpd.fallbacks": out.fallbacks,
        "hpd.ttft_ms": round(out.ttft_ms, 3), "hpd.output_tokens": out.output_tokens,
    }  # fmt: skip


def _error(exc: GatewayError, request_id: str = "") -> web.Response:
    headers = {"x-request-id": request_id} if request_id else {}
    if exc.retry_after_s:
        headers["Retry-After"] = str(exc.retry_after_s)
    return web.json_response(exc.body(), status=exc.status, headers=headers)


class _Routes:
    """The handlers of ``hpd gateway``'s routes, with the requests in flight they share."""

    def __init__(
        self,
        gateway: Gateway,
        max_body_bytes: int,
        max_concurrent: int,
        stale_after_s: float,
        keys: ApiKeys | None,
        body_timeout_s: float,
    ) -> None:
        self.gateway = gateway
        self.max_body_bytes = max_body_bytes
        self.max_concurrent = max_concurrent
        self.stale_after_s = stale_after_s
        self.keys = keys
        self.body_timeout_s = body_timeout_s
        self.in_flight = 0
        self.active: set[str] = set()  # scheduler request ids in flight

    def _tier(self, request: web.Request, key: ApiKey | None) -> str:
        """The tier the request gets: what it asks within what its key allows (403 past it)."""
        asked = request.headers.get("x-hpd-tier", "")
        if key is None:
            return asked or self.gateway.config.default_tier
        return key.tier_for(asked)

    async def _body(self, request: web.Request) -> bytes:
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except TimeoutError:
            self.gateway.metrics.refused.labels("body_timeout").inc()
            raise GatewayError(
                408, f"the body did not arrive within {self.body_timeout_s:g} s", param="body",
                code="request_timeout",
            ) from None  # fmt: skip
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(
                413, f"the body is larger than {self.max_body_bytes} bytes", param="body",
                code="body_too_large",
            ) from None  # fmt: skip

    @staticmethod
    def _scheduler_id(key: ApiKey | None, rid: str) -> str:
        """The id the scheduler keys the plan by: the client's id in its tenant's namespace
        (hashed when the two are longer than the scheduler takes)."""
        if key is None:
            return rid
        sid = f"{key.tenant}:{rid}"
        if len(sid) <= MAX_SCHEDULER_ID and is_id(sid):
            return sid
        return "t-" + hashlib.sha256(sid.encode()).hexdigest()[:40]

    async def serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        """One request in its SERVER span (continuing the client's ``traceparent``, if it
        sent one; the no-op span while tracing is off)."""
        with tracing.server_span(_SPANS[kind], request.headers) as span:
            return await self._serve(request, kind, span)

    async def _serve(
        self, request: web.Request, kind: str, span: tracing.Span
    ) -> web.StreamResponse:
        rid = request.headers.get("x-request-id", "")
        rid = rid if is_id(rid) else "gw-" + uuid.uuid4().hex
        key: ApiKey | None = None
        status = 500
        try:
            if self.keys is not None:  # 401 without a known key
                key = self.keys.identify(request.headers.get("Authorization", ""))
            tier = self._tier(request, key)
            raw = await self._body(request)
            if len(raw) > PARSE_OFF_LOOP_BYTES:
                req = await asyncio.to_thread(parse_request, kind, raw)
            else:
                req = parse_request(kind, raw)
            sid = self._scheduler_id(key, rid)
            if tracing.enabled():
                span.set_attributes(_request_attributes(request, sid, req, tier))
            if sid in self.active:
                raise GatewayError(
                    409, f"a request with the id {rid!r} is still in flight",
                    code="request_id_in_flight", param="x-request-id",
                )  # fmt: skip
            if self.in_flight >= self.max_concurrent:
                raise GatewayError(
                    429, f"the gateway is at its limit of {self.max_concurrent} requests in flight",
                    type_="rate_limit_error", code="rate_limited", retry_after_s=1,
                )  # fmt: skip
            if key is not None:
                key.admit(time.monotonic())
            self.in_flight += 1  # counted from here: the body is in and checked
            self.active.add(sid)
            try:
                resp = await self._serve_counted(req, request, rid, sid, tier, key)
            finally:
                self.in_flight -= 1
                self.active.discard(sid)
                if key is not None:
                    key.release()
            status = resp.status
            return resp
        except GatewayError as exc:
            status = exc.status
            return _error(exc, rid)
        finally:
            if key is not None:
                self.gateway.metrics.tenant_requests.labels(key.tenant, str(status)).inc()
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(tracing.Status(tracing.StatusCode.ERROR, f"HTTP {status}"))

    async def _serve_counted(
        self,
        req: ClientRequest,
        request: web.Request,
        rid: str,
        sid: str,
        tier: str,
        key: ApiKey | None,
    ) -> web.StreamResponse:
        sink = _HttpSink(request, rid)
        charge: Callable[[int], None] | None = None
        if key is not None:
            tenant_tokens = self.gateway.metrics.tenant_tokens.labels(key.tenant)

            def charge(tokens: int, key: ApiKey = key) -> None:
                key.charge(tokens, time.monotonic())
                tenant_tokens.inc(tokens)

        out = await self.gateway.handle(req, sink, request_id=sid, tier=tier, charge=charge)
        if tracing.enabled():
            tracing.current_span().set_attributes(_outcome_attributes(out))
        if sink.response is None:  # nothing was sent: cannot happen, answer honestly
            return _error(GatewayError(500, "no answer was produced", type_="server_error"))
        if isinstance(sink.response, web.StreamResponse) and not isinstance(
            sink.response, web.Response
        ):
            await sink.response.write_eof()
        return sink.response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, CHAT)

    async def models(self, request: web.Request) -> web.Response:
        del request
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "hetero-pd"}
            for m in self.gateway.control.models()
        ]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        del request
        age = self.gateway.control.fleet.age_s()
        if age > self.stale_after_s:
            return web.json_response(
                error_body("the fleet view is stale or not synced", "server_error", "unavailable"),
                status=503,
            )
        return web.json_response({"status": "ok", "fleet_age_s": round(age, 3)})

    @staticmethod
    async def not_found(request: web.Request) -> web.Response:
        return web.json_response(
            error_body(f"no route {request.method} {request.path}", "invalid_request_error",
                       "not_found"),
            status=404,
        )  # fmt: skip


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error in OpenAI's shape: aiohttp's own (405, 413, ...) and a handler's bug."""
    try:
        return await handler(request)
    except GatewayError as exc:
        return _error(exc, request.headers.get("x-request-id", "")[:128])
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = "not_found" if exc.status == 404 else str(exc.status)
        return web.json_response(
            error_body(exc.reason or "error", "invalid_request_error", code), status=exc.status
        )
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("request_failed", path=request.path)
        return web.json_response(
            error_body("the gateway failed on this request", "server_error", "internal_error"),
            status=500,
        )


def build_app(
    gateway: Gateway,
    max_body_bytes: int = 4 << 20,
    max_concurrent: int = 1024,
    stale_after_s: float = 10.0,
    *,
    keys: ApiKeys | None = None,
    body_timeout_s: float = 15.0,
) -> web.Application:
    """The aiohttp application of ``hpd gateway``'s public port (module docstring)."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[openai_errors])
    routes = _Routes(gateway, max_body_bytes, max_concurrent, stale_after_s, keys, body_timeout_s)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/health", routes.health)
    app.router.add_route("*", "/{tail:.*}", routes.not_found)
    return app


def build_metrics_app(gateway: Gateway) -> web.Application:
    """``GET /metrics`` (Prometheus) for the gateway's metrics listener."""

    async def metrics(request: web.Request) -> web.Response:
        del request
        body = generate_latest(gateway.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app
