"""HTTP to the engines: tokenize, a prefill, a decode (whole or streamed).

Every failure that should move the request to its next fallback step is an
:class:`UpstreamError` with a stable ``cause``: ``connect_error`` (refused, reset, DNS),
``timeout``, ``upstream_5xx`` (the engine's own failure, a failed KV pull included),
``upstream_4xx`` (the engine refused the request: the client's fault, not retried),
``bad_reply`` (an answer the protocol does not allow).

A call made for a request names its :class:`Hop`: the engine gets the request's id as
``X-Request-Id`` (vLLM logs and runs the request under it, so the logs of the gateway, the
scheduler and the engines join), and while the gateway traces, a CLIENT span of the hop's
name (``prefill``, ``decode``, ``tokenize``) whose ``traceparent`` goes with the request
(vLLM continues the trace).
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import aiohttp

from hpd_common import tracing

__all__ = ["CHOICES", "USAGE", "EngineHttp", "Hop", "UpstreamError"]

CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\{')
"""An event that carries at least one choice (a token, or the role of a chat reply)."""
USAGE = re.compile(rb'"usage"\s*:\s*\{')
"""An event that carries a usage object (not ``"usage": null``)."""


@dataclass(slots=True)  # not frozen: made per engine call, and a frozen one costs 3x more
class Hop:
    """One engine call of a request: the span's name, the id the engine runs it under
    (empty: none sent) and the worker it goes to."""

    name: str
    request_id: str = ""
    worker: str = ""

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id} if self.request_id else {}

    def span(
        self, endpoint: str, path: str, headers: dict[str, str]
    ) -> AbstractContextManager[tracing.Span]:
        """The hop's CLIENT span (the no-op one while tracing is off), its context written
        into ``headers``."""
        if not tracing.enabled():
            return tracing.OFF
        return tracing.client_span(self.name, headers, {
            "http.request.method": "POST", "url.path": path, "server.address": endpoint,
            "hpd.worker_id": self.worker, "hpd.request_id": self.request_id,
        })  # fmt: skip


class UpstreamError(Exception):
    """An engine call failed; ``cause`` is stable, ``endpoint`` names the engine."""

    def __init__(self, cause: str, endpoint: str, detail: str = "", status: int = 0) -> None:
        super().__init__(f"{cause} from {endpoint}: {detail}"[:400])
        self.cause = cause
        self.endpoint = endpoint
        self.detail = detail
        self.status = status

    @property
    def retryable(self) -> bool:
        """A client error (4xx) is the request's fault: another engine would refuse it too."""
        return self.cause != "upstream_4xx"


# Idle pooled connections are dropped after this: under the engines' own keep-alive
# (uvicorn's and so vLLM's and SGLang's default is 5 s), so the gateway does not write a
# request into a connection the engine is closing at that moment.
KEEPALIVE_S = 4.0

# Failures that mean the engine closed a (pooled) connection before reading the request:
# tried once more on a fresh connection, before the step counts as failed.
_STALE = (aiohttp.ServerDisconnectedError, ConnectionResetError, BrokenPipeError)


def _stale(exc: BaseException) -> bool:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False  # connecting failed: nothing was pooled, the engine is not there
    if isinstance(exc, aiohttp.ClientOSError):
        return exc.errno in (errno.ECONNRESET, errno.EPIPE)
    return isinstance(exc, _STALE)


class EngineHttp:
    """One connection pool to every engine (keep-alive; no pool limit per host, since a
    gateway multiplexes a whole fleet's requests onto few engines). A request whose
    connection the engine reset before any answer came back is sent once more on a new
    connection (a pooled connection the engine was closing; no answer means nothing
    reached the client)."""

    def __init__(self, connect_timeout_s: float = 2.0, read_timeout_s: float = 300.0) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=self._timeout,
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
            ),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _url(self, endpoint: str, path: str) -> str:
        return (endpoint if "://" in endpoint else "http://" + endpoint) + path

    async def _error(self, resp: aiohttp.ClientResponse, endpoint: str) -> UpstreamError:
        text = (await resp.text(errors="replace"))[:300]
        cause = "upstream_4xx" if resp.status < 500 else "upstream_5xx"
        return UpstreamError(cause, endpoint, f"HTTP {resp.status}: {text}", resp.status)

    async def post_json(
        self,
        endpoint: str,
        path: str,
        body: Mapping[str, Any],
        timeout_s: float | None = None,
        hop: Hop | None = None,
    ) -> Any:
        """POST and return the decoded JSON answer (UpstreamError otherwise); ``timeout_s``
        bounds the whole call (default: the connect and read timeouts only)."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        headers = hop.headers() if hop is not None else {}
        with hop.span(endpoint, path, headers) if hop is not None else tracing.OFF as span:
            for attempt in (0, 1):
                answered = False
                try:
                    async with self._session.post(
                        self._url(endpoint, path), json=body, timeout=timeout,
                        headers=headers or None,
                    ) as resp:  # fmt: skip
                        answered = True
                        span.set_attribute("http.response.status_code", resp.status)
                        if resp.status != 200:
                            raise await self._error(resp, endpoint)
                        try:
                            return await resp.json(content_type=None)
                        except (json.JSONDecodeError, aiohttp.ContentTypeError) as exc:
                            raise UpstreamError("bad_reply", endpoint, "not JSON") from exc
                except TimeoutError as exc:
                    raise UpstreamError("timeout", endpoint, str(exc)) from exc
                except (aiohttp.ClientError, OSError) as exc:
                    if attempt == 0 and not answered and _stale(exc):
                        continue
                    raise UpstreamError("connect_error", endpoint, str(exc)) from exc
        raise AssertionError("unreachable")

    async def stream(
        self, endpoint: str, path: str, body: Mapping[str, Any], hop: Hop | None = None
    ) -> AsyncIterator[bytes | None]:
        """POST a streamed request; yields each event's JSON text, then None for ``[DONE]``.

        Events are passed on as the engine wrote them (no decode and re-encode per token);
        only an event that looks like an error is decoded, to tell it from a token. A
        failure before the first event raises UpstreamError; one after it raises
        UpstreamError too (the caller knows whether anything reached the client).
        """
        assert self._session is not None
        headers = hop.headers() if hop is not None else {}
        with hop.span(endpoint, path, headers) if hop is not None else tracing.OFF as span:
            try:
                async with self._post_fresh_on_reset(endpoint, path, body, headers) as resp:
                    span.set_attribute("http.response.status_code", resp.status)
                    if resp.status != 200:
                        raise await self._error(resp, endpoint)
                    done = False
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            done = True
                            yield None
                            break
                        if not payload.startswith(b"{") or not payload.endswith(b"}"):
                            raise UpstreamError("bad_reply", endpoint, "event not a JSON object")
                        if b'"error"' in payload and not CHOICES.search(payload):
                            try:
                                event = json.loads(payload)
                            except json.JSONDecodeError as exc:
                                raise UpstreamError(
                                    "bad_reply", endpoint, "event not JSON"
                                ) from exc
                            if isinstance(event, dict) and "error" in event:
                                detail = str(event["error"])[:300]
                                raise UpstreamError("upstream_5xx", endpoint, detail)
                        yield payload
                    if not done:
                        raise UpstreamError(
                            "connect_error", endpoint, "stream ended without [DONE]"
                        )
            except TimeoutError as exc:
                raise UpstreamError("timeout", endpoint, str(exc)) from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise UpstreamError("connect_error", endpoint, str(exc)) from exc

    @contextlib.asynccontextmanager
    async def _post_fresh_on_reset(
        self, endpoint: str, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """``session.post`` whose request is sent once more when the engine reset the
        connection before answering (the status line is the first byte of an answer)."""
        assert self._session is not None
        url, extra = self._url(endpoint, path), headers or None
        try:
            resp = await self._session.post(url, json=body, headers=extra)
        except (aiohttp.ClientError, OSError) as exc:
            if not _stale(exc):
                raise
            resp = await self._session.post(url, json=body, headers=extra)
        async with resp:  # released (and the connection closed if unread) as aiohttp does
            yield resp
