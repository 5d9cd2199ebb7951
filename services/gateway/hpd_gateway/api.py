"""The HTTP edge: OpenAI routes on aiohttp, errors in OpenAI's shape, limits.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not),
``GET /v1/models`` (the fleet's models), ``GET /health`` (200 while the fleet view is
fresh), ``GET /metrics`` (Prometheus). Headers read: ``x-request-id`` (else one is made;
it is echoed back), ``x-hpd-tier`` (else the API key's tier, else the default), and
``Authorization: Bearer <key>`` for the key's tier. Answers carry ``x-request-id`` and a
``Server-Timing`` header with the gateway's own steps (``tokenize``, ``schedule``, and for a
transfer the ``prefill`` call) in milliseconds.

Limits: bodies over ``max_body_bytes`` are 413; past ``max_concurrent`` requests in flight
a request is 429 with ``Retry-After``. A client that hangs up cancels its handler, which
closes the engine connections (vLLM aborts a request whose connection closes).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .protocol import CHAT, COMPLETIONS, GatewayError, error_body, parse_request
from .service import Gateway

__all__ = ["build_app"]

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


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


def _error(exc: GatewayError, request_id: str = "") -> web.Response:
    headers = {"x-request-id": request_id} if request_id else {}
    if exc.retry_after_s:
        headers["Retry-After"] = str(exc.retry_after_s)
    return web.json_response(exc.body(), status=exc.status, headers=headers)


class _Routes:
    """The handlers of ``hpd gateway``'s routes, with the request-in-flight count they share."""

    def __init__(
        self, gateway: Gateway, max_body_bytes: int, max_concurrent: int, stale_after_s: float
    ) -> None:
        self.gateway = gateway
        self.max_body_bytes = max_body_bytes
        self.max_concurrent = max_concurrent
        self.stale_after_s = stale_after_s
        self.in_flight = 0

    async def serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        rid = request.headers.get("x-request-id", "")
        rid = rid if _REQUEST_ID.match(rid) else "gw-" + uuid.uuid4().hex
        if self.in_flight >= self.max_concurrent:
            return _error(
                GatewayError(
                    429, f"the gateway is at its limit of {self.max_concurrent} requests in flight",
                    type_="rate_limit_error", code="rate_limited", retry_after_s=1,
                ),
                rid,
            )  # fmt: skip
        self.in_flight += 1  # counted from here: a slow body still holds its place
        try:
            return await self._serve_counted(request, kind, rid)
        finally:
            self.in_flight -= 1

    async def _serve_counted(self, request: web.Request, kind: str, rid: str) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(
                GatewayError(
                    413, f"the body is larger than {self.max_body_bytes} bytes", param="body",
                    code="body_too_large",
                ),
                rid,
            )  # fmt: skip
        try:
            req = parse_request(kind, raw)
        except GatewayError as exc:
            return _error(exc, rid)
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        tier = self.gateway.tier_for(request.headers.get("x-hpd-tier", ""), key)
        sink = _HttpSink(request, rid)
        await self.gateway.handle(req, sink, request_id=rid, tier=tier)
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

    async def metrics(self, request: web.Request) -> web.Response:
        del request
        body = generate_latest(self.gateway.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @staticmethod
    async def not_found(request: web.Request) -> web.Response:
        return web.json_response(
            error_body(f"no route {request.method} {request.path}", "invalid_request_error",
                       "not_found"),
            status=404,
        )  # fmt: skip


def build_app(
    gateway: Gateway,
    max_body_bytes: int = 4 << 20,
    max_concurrent: int = 1024,
    stale_after_s: float = 10.0,
) -> web.Application:
    """The aiohttp application of ``hpd gateway`` (module docstring)."""
    app = web.Application(client_max_size=max_body_bytes)
    routes = _Routes(gateway, max_body_bytes, max_concurrent, stale_after_s)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_route("*", "/{tail:.*}", routes.not_found)
    return app
