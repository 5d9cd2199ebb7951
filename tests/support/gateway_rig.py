"""The rig the gateway's component tests run `hpd gateway` on: the real Gateway and
aiohttp app in front of fake engines (small aiohttp servers on 127.0.0.1 that answer like
vLLM: ``/tokenize`` counts, the OpenAI routes answer whole or as server-sent events, a
request with ``kv_transfer_params: {"do_remote_decode": true}`` is a prefill that returns
the parameters for the decode, and a decode records what it was given) and a recording
fake of the gRPC control plane with the methods the gateway calls."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from hpd_gateway.api import build_app, build_metrics_app
from hpd_gateway.control_client import ControlPlane
from hpd_gateway.engine_client import EngineHttp
from hpd_gateway.keys import ApiKeys
from hpd_gateway.metrics import GatewayMetrics
from hpd_gateway.plan import Outcome, Plan, Step
from hpd_gateway.protocol import GatewayError
from hpd_gateway.service import Gateway, GatewayConfig

MODEL = "tiny"
PROMPT_TOKENS = 7
KV_BYTES = 123_456
SESSION = "sess-1"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


# -- fake engines ------------------------------------------------------------------------------


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


class FakeEngine:
    """A vLLM look-alike. ``behaviour`` of its generation routes: ``ok``; ``error500`` /
    ``error4xx`` (answers ``status_4xx``; ``tokenize_behaviour`` the same for ``/tokenize``);
    ``drop`` (streams two chunks, then closes the connection); ``hang``
    (streams one chunk, then waits until its connection is closed); ``hold`` (waits for
    ``release`` before answering)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.behaviour = "ok"
        self.tokenize_behaviour = "ok"
        self.status_4xx = 400
        self.tokens = 3
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.endpoint = ""
        self._runner: web.AppRunner | None = None
        self._ids = itertools.count()

    def params(self) -> dict[str, Any]:
        """The kv_transfer_params this engine's prefill answers (vLLM NIXL connector's)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{self.name}",
            "remote_block_ids": [4, 5, 6],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }

    @property
    def generations(self) -> list[dict[str, Any]]:
        return [body for path, body in self.calls if path != "/tokenize"]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post(COMPLETIONS, self._generate)
        app.router.add_post(CHAT, self._generate)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.endpoint = f"{host}:{port}"

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append((request.path, body))
        if self.tokenize_behaviour == "error500":
            return self._error(500)
        if self.tokenize_behaviour == "error4xx":
            return self._error(self.status_4xx)
        return web.json_response(
            {"count": PROMPT_TOKENS, "max_model_len": 2048, "tokens": list(range(PROMPT_TOKENS))}
        )

    def _error(self, status: int) -> web.Response:
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        body = {"object": "error", "message": f"{self.name} says no", "type": kind, "code": status}
        return web.json_response(body, status=status)

    def _choice(self, chat: bool, text: str, streamed: bool, done: bool) -> dict[str, Any]:
        reason = "length" if done else None
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        key = "delta" if streamed else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((request.path, body))
        self.entered.set()
        chat = request.path == CHAT
        if self.behaviour == "error500":
            return self._error(500)
        if self.behaviour == "error4xx":
            return self._error(self.status_4xx)
        if self.behaviour == "hold":
            await asyncio.wait_for(self.release.wait(), 5)
        rid = f"{self.name}-{next(self._ids)}"
        obj = "chat.completion" if chat else "text_completion"
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            return web.json_response(
                {
                    "id": rid,
                    "object": obj,
                    "model": body["model"],
                    "choices": [self._choice(chat, "P", streamed=False, done=True)],
                    "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1},
                    "kv_transfer_params": self.params(),
                }
            )
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": self.tokens,
            "total_tokens": PROMPT_TOKENS + self.tokens,
        }
        if not body.get("stream"):
            text = "".join(f"{self.name}-{i} " for i in range(self.tokens))
            return web.json_response(
                {
                    "id": rid,
                    "object": obj,
                    "model": body["model"],
                    "choices": [self._choice(chat, text, streamed=False, done=True)],
                    "usage": usage,
                    "kv_transfer_params": None,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj += ".chunk" if chat else ""
        for i in range(self.tokens):
            if self.behaviour == "drop" and i == 2:
                assert request.transport is not None
                request.transport.close()
                await asyncio.sleep(5)  # cancelled as the connection goes
            choice = self._choice(chat, f"{self.name}-{i} ", True, i == self.tokens - 1)
            await resp.write(sse({"id": rid, "object": obj, "choices": [choice]}))
            if self.behaviour == "hang":
                try:
                    await asyncio.wait_for(self.release.wait(), 5)
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(sse({"id": rid, "object": obj, "choices": [], "usage": usage}))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp


# -- fake control plane ------------------------------------------------------------------------


class FakeFleet:
    def __init__(self) -> None:
        self.age = 0.25

    def age_s(self) -> float:
        return self.age


class FakeControl:
    """What Gateway and build_app use of ControlPlane, recording every call."""

    def __init__(self, workers: dict[str, str], tokenizers: list[str]) -> None:
        self.workers = workers
        self.tokenizers = tokenizers
        self.fleet = FakeFleet()
        self.plan: Plan | None = None
        self.schedule_error: GatewayError | None = None
        self.scheduled: list[tuple[str, str, int, int, str]] = []
        self.reports: list[tuple[str, Outcome]] = []
        self.prefixes: list[tuple[tuple[int, ...], int]] = []
        self.avoided: list[tuple[str, ...]] = []  # each Schedule's avoid_workers
        self.block = 0  # the engines' KV block size the fleet shows (0: none known)
        self.context = 0  # the engines' stated context length (0: none stated)
        self.done: list[str] = []
        self.failed: list[tuple[str, str, bool]] = []
        self._recorded = asyncio.Event()

    def models(self) -> list[str]:
        return [MODEL]

    def endpoint(self, worker_id: str) -> str:
        return self.workers.get(worker_id, "")

    def tokenizer_endpoints(self, model: str) -> list[str]:
        return list(self.tokenizers) if model == MODEL else []

    def block_tokens(self, model: str) -> int:
        return self.block if model == MODEL else 0

    def context_tokens(self, model: str) -> int:
        return self.context if model == MODEL else 0

    async def schedule(
        self, request_id: str, model: str, prompt_tokens: int, output_tokens: int, tier: str,
        prefix: tuple[int, ...] = (), block_tokens: int = 0, avoid: tuple[str, ...] = (),
    ) -> Plan:  # fmt: skip
        self.scheduled.append((request_id, model, prompt_tokens, output_tokens, tier))
        self.prefixes.append((prefix, block_tokens))
        self.avoided.append(avoid)
        self._recorded.set()
        if self.schedule_error is not None:
            raise self.schedule_error
        assert self.plan is not None, "the test set no plan"
        return replace(self.plan, request_id=request_id)

    async def report(self, request_id: str, out: Outcome) -> None:
        self.reports.append((request_id, out))
        self._recorded.set()

    async def session_done(self, session_id: str) -> None:
        self.done.append(session_id)
        self._recorded.set()

    async def session_failed(self, session_id: str, reason: str, started: bool) -> None:
        self.failed.append((session_id, reason, started))
        self._recorded.set()

    async def until(self, check: Callable[[], bool], timeout_s: float = 2.0) -> None:
        """Wait for ``check`` to hold: reports and session updates run in the background."""
        async with asyncio.timeout(timeout_s):
            while not check():
                self._recorded.clear()
                await self._recorded.wait()

    async def outcome(self) -> Outcome:
        """The one reported outcome."""
        await self.until(lambda: bool(self.reports))
        assert len(self.reports) == 1
        return self.reports[0][1]


def closed_port() -> str:
    """An endpoint nothing listens on: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


# -- the rig -----------------------------------------------------------------------------------


@dataclass
class Rig:
    control: FakeControl
    engines: dict[str, FakeEngine]
    url: str
    http: aiohttp.ClientSession
    metrics_url: str = ""
    gateway: Gateway | None = None

    def __getitem__(self, name: str) -> FakeEngine:
        return self.engines[name]

    def primary(self, mode: str, decode: str, prefill: str = "") -> Step:
        """The plan's first step, endpoints filled in as the scheduler does."""
        pre = self.control.workers[prefill] if prefill else ""
        return Step(mode, decode, self.control.workers[decode], prefill, pre, "primary")

    def use(self, *steps: Step) -> None:
        self.control.plan = Plan("", steps, SESSION, KV_BYTES, "rec-1")

    async def post(
        self, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, Mapping[str, str], Any]:
        """POST and read a whole JSON answer: status, headers, body."""
        kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with self.http.post(self.url + path, headers=headers, **kw) as resp:
            return resp.status, resp.headers, await resp.json(content_type=None)

    async def stream(self, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
        """POST a streamed request: status and each event's payload (JSON, or "[DONE]")."""
        async with self.http.post(self.url + path, json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            text = await resp.text()
        assert text.endswith("\n\n")
        events: list[Any] = []
        for block in text.split("\n\n")[:-1]:
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        return resp.status, events


def fallback(mode: str, decode: str, prefill: str = "") -> Step:
    """A fallback step: workers only, resolved from the fleet view when it runs."""
    return Step(mode, decode, prefill_worker=prefill, reason="fallback")


@contextlib.asynccontextmanager
async def open_rig(
    config: GatewayConfig | None = None,
    max_body_bytes: int = 4 << 20,
    max_concurrent: int = 1024,
    keys: ApiKeys | None = None,
    body_timeout_s: float = 15.0,
) -> AsyncIterator[Rig]:
    engines = {name: FakeEngine(name) for name in ("p1", "d1", "d2")}
    for e in engines.values():
        await e.start()
    workers = {name: e.endpoint for name, e in engines.items()} | {"dead": closed_port()}
    control = FakeControl(workers, tokenizers=[engines["p1"].endpoint])
    http_to_engines = EngineHttp(connect_timeout_s=1.0, read_timeout_s=5.0)
    await http_to_engines.start()
    gateway = Gateway(
        cast(ControlPlane, control), http_to_engines, GatewayMetrics(CollectorRegistry()), config
    )
    app = build_app(
        gateway, max_body_bytes=max_body_bytes, max_concurrent=max_concurrent, keys=keys,
        body_timeout_s=body_timeout_s,
    )  # fmt: skip
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    metrics = web.AppRunner(build_metrics_app(gateway), access_log=None)
    await metrics.setup()
    await web.TCPSite(metrics, "127.0.0.1", 0).start()
    mhost, mport = metrics.addresses[0][:2]
    http = aiohttp.ClientSession()
    try:
        url, murl = f"http://{host}:{port}", f"http://{mhost}:{mport}/metrics"
        yield Rig(control, engines, url, http, murl, gateway)
    finally:
        await http.close()
        for e in engines.values():
            e.release.set()
        await runner.cleanup()
        await metrics.cleanup()
        await http_to_engines.close()
        for e in engines.values():
            await e.stop()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with open_rig() as r:
        yield r


def request_body(path: str, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        base: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    else:
        base = {"model": MODEL, "prompt": "Hello"}
    return base | {"max_tokens": 3, "temperature": 0} | extra


def answer_text(path: str, choice: dict[str, Any]) -> str:
    if path == CHAT:
        part = choice.get("message") or choice.get("delta") or {}
        return str(part.get("content") or "")
    return str(choice["text"])


def token_text(path: str, events: list[Any]) -> str:
    return "".join(
        answer_text(path, c) for e in events if isinstance(e, dict) for c in e.get("choices", [])
    )


PATHS = [pytest.param(COMPLETIONS, id="completions"), pytest.param(CHAT, id="chat")]
STREAMED = [pytest.param(False, id="whole"), pytest.param(True, id="stream")]
