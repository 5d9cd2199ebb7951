"""`hpd gateway` over HTTP: the real Gateway and aiohttp app, in front of fake engines.

The fake engines are small aiohttp servers on 127.0.0.1 that answer like vLLM: ``/tokenize``
counts, ``/v1/completions`` and ``/v1/chat/completions`` answer whole or as server-sent
events, a request with ``kv_transfer_params: {"do_remote_decode": true}`` is a prefill that
returns the parameters for the decode, and a decode records what it was given. The gRPC
control plane is replaced by a recording fake with the methods the gateway calls.
"""

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

from hpd_common.kvchain import chain_hashes
from hpd_gateway.api import build_app
from hpd_gateway.control_client import ControlPlane
from hpd_gateway.engine_client import EngineHttp
from hpd_gateway.metrics import GatewayMetrics
from hpd_gateway.plan import RECOMPUTE, SAME_POOL, TRANSFER, Outcome, Plan, Step
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
        self.block = 0  # the engines' KV block size the fleet shows (0: none known)
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

    async def schedule(
        self, request_id: str, model: str, prompt_tokens: int, output_tokens: int, tier: str,
        prefix: tuple[int, ...] = (), block_tokens: int = 0,
    ) -> Plan:  # fmt: skip
        self.scheduled.append((request_id, model, prompt_tokens, output_tokens, tier))
        self.prefixes.append((prefix, block_tokens))
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
    app = build_app(gateway, max_body_bytes=max_body_bytes, max_concurrent=max_concurrent)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    http = aiohttp.ClientSession()
    try:
        yield Rig(control, engines, f"http://{host}:{port}", http)
    finally:
        await http.close()
        for e in engines.values():
            e.release.set()
        await runner.cleanup()
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


# -- TRANSFER ----------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", STREAMED)
@pytest.mark.parametrize("path", PATHS)
async def test_transfer_hands_kv_from_prefill_to_decode(
    rig: Rig, path: str, streamed: bool
) -> None:
    rig.use(rig.primary(TRANSFER, "d1", "p1"), fallback(RECOMPUTE, "d2"))
    sent = request_body(path, stream=streamed, ignore_eos=True)
    if streamed:
        _, events = await rig.stream(path, sent)
        assert events[-1] == "[DONE]"
        assert all("usage" not in e for e in events[:-1])  # the client did not ask for usage
        text = token_text(path, events)
    else:
        status, headers, answer = await rig.post(path, sent, {"x-request-id": "req-1"})
        assert status == 200
        assert headers["x-request-id"] == "req-1"
        assert "kv_transfer_params" not in answer
        assert answer["usage"]["completion_tokens"] == 3
        text = answer_text(path, answer["choices"][0])
    assert text == "d1-0 d1-1 d1-2 "

    [prefill] = rig["p1"].generations
    expected_prefill = {k: v for k, v in sent.items() if k != "stream_options"} | {
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    if path == CHAT:
        expected_prefill["max_completion_tokens"] = 1
    assert prefill == expected_prefill

    [decode] = rig["d1"].generations
    assert decode["kv_transfer_params"] == rig["p1"].params()
    assert decode["max_tokens"] == 3
    assert decode["stream"] is streamed
    assert decode.get("stream_options") == ({"include_usage": True} if streamed else None)
    assert rig["d2"].calls == []

    out = await rig.control.outcome()
    assert (out.success, out.mode, out.error_class, out.fallbacks) == (True, TRANSFER, "", 0)
    assert out.ttft_ms > 0
    assert out.prefill_ms > 0
    assert out.output_tokens == 3
    await rig.control.until(lambda: bool(rig.control.done))
    assert rig.control.done == [SESSION]
    assert rig.control.failed == []
    [(rid, model, prompt_tokens, output_tokens, tier)] = rig.control.scheduled
    assert (model, prompt_tokens, output_tokens, tier) == (MODEL, PROMPT_TOKENS, 3, "standard")
    assert rig.control.reports[0][0] == rid
    if not streamed:
        assert rid == "req-1"


@pytest.mark.parametrize("path", PATHS)
async def test_stream_passes_usage_when_the_client_asks(rig: Rig, path: str) -> None:
    rig.use(rig.primary(TRANSFER, "d1", "p1"))
    sent = request_body(path, stream=True, stream_options={"include_usage": True})
    _, events = await rig.stream(path, sent)
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"


# -- RECOMPUTE and SAME_POOL -------------------------------------------------------------------


@pytest.mark.parametrize("streamed", STREAMED)
@pytest.mark.parametrize("mode", [RECOMPUTE, SAME_POOL])
async def test_recompute_goes_straight_to_decode(rig: Rig, mode: str, streamed: bool) -> None:
    rig.use(rig.primary(mode, "d1"))
    sent = request_body(COMPLETIONS, stream=streamed)
    if streamed:
        _, events = await rig.stream(COMPLETIONS, sent)
        text = token_text(COMPLETIONS, events)
    else:
        status, _, answer = await rig.post(COMPLETIONS, sent)
        assert status == 200
        text = answer["choices"][0]["text"]
    assert text == "d1-0 d1-1 d1-2 "
    [decode] = rig["d1"].generations
    assert "kv_transfer_params" not in decode
    expected = sent | ({"stream_options": {"include_usage": True}} if streamed else {})
    assert decode == expected
    assert rig["p1"].generations == []
    out = await rig.control.outcome()
    assert (out.success, out.mode, out.fallbacks) == (True, mode, 0)
    assert out.ttft_ms > 0
    assert (rig.control.done, rig.control.failed) == ([], [])


# -- fallbacks ---------------------------------------------------------------------------------

# (failing engine, its behaviour, primary decode worker, cause, prefill ran)
FAILURES = [
    pytest.param("", "", "dead", "decode_connect_error", True, id="decode-refuses-connections"),
    pytest.param("d1", "error500", "d1", "decode_upstream_5xx", True, id="decode-answers-500"),
    pytest.param("p1", "error500", "d1", "prefill_upstream_5xx", False, id="prefill-answers-500"),
]  # fmt: skip


@pytest.mark.parametrize("streamed", STREAMED)
@pytest.mark.parametrize(("failing", "behaviour", "decode", "cause", "prefilled"), FAILURES)
async def test_a_failed_step_falls_back_to_the_next(
    rig: Rig,
    failing: str,
    behaviour: str,
    decode: str,
    cause: str,
    prefilled: bool,
    streamed: bool,
) -> None:
    if failing:
        rig[failing].behaviour = behaviour
    rig.use(rig.primary(TRANSFER, decode, "p1"), fallback(RECOMPUTE, "d2"))
    sent = request_body(COMPLETIONS, stream=streamed)
    if streamed:
        _, events = await rig.stream(COMPLETIONS, sent)
        assert events[-1] == "[DONE]"
        text = token_text(COMPLETIONS, events)
    else:
        status, _, answer = await rig.post(COMPLETIONS, sent)
        assert status == 200
        text = answer["choices"][0]["text"]
    assert text == "d2-0 d2-1 d2-2 "
    [served] = rig["d2"].generations
    assert "kv_transfer_params" not in served
    out = await rig.control.outcome()
    assert (out.success, out.mode, out.error_class, out.fallbacks) == (
        True,
        RECOMPUTE,
        cause,
        1,
    )
    await rig.control.until(lambda: bool(rig.control.failed))
    assert rig.control.failed == [(SESSION, cause, prefilled)]
    assert rig.control.done == []


async def test_a_transfer_fallback_resolves_its_workers_and_skips_one_that_left(rig: Rig) -> None:
    rig.use(
        rig.primary(TRANSFER, "dead", "p1"),
        fallback(TRANSFER, "gone", "p1"),
        fallback(TRANSFER, "d2", "p1"),
    )
    status, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
    assert status == 200
    assert answer["choices"][0]["text"] == "d2-0 d2-1 d2-2 "
    [decode] = rig["d2"].generations
    assert decode["kv_transfer_params"] == rig["p1"].params()
    assert len(rig["p1"].generations) == 2  # the primary's prefill and the fallback's
    out = await rig.control.outcome()
    assert (out.success, out.mode, out.error_class, out.fallbacks) == (
        True,
        TRANSFER,
        "decode_connect_error",
        1,
    )
    # the broker session belongs to the primary step only
    await rig.control.until(lambda: bool(rig.control.failed))
    assert rig.control.failed == [(SESSION, "decode_connect_error", True)]
    assert rig.control.done == []


@pytest.mark.parametrize("path", PATHS)
async def test_a_failure_mid_stream_ends_the_stream_without_restarting(rig: Rig, path: str) -> None:
    rig["d1"].behaviour = "drop"
    rig["d1"].tokens = 5
    rig.use(rig.primary(RECOMPUTE, "d1"), fallback(RECOMPUTE, "d2"))
    status, events = await rig.stream(path, request_body(path, stream=True, max_tokens=5))
    assert status == 200
    assert token_text(path, events) == "d1-0 d1-1 "
    *tokens, error, done = events
    assert len(tokens) == 2
    assert set(error) == {"error"}
    assert error["error"]["type"] == "server_error"
    assert error["error"]["code"] == "upstream_error"
    assert error["error"]["param"] is None
    assert "decode_connect_error" in error["error"]["message"]
    assert done == "[DONE]"
    assert rig["d2"].calls == []
    out = await rig.control.outcome()
    assert (out.success, out.mode, out.error_class, out.fallbacks) == (
        False,
        RECOMPUTE,
        "decode_connect_error",
        0,
    )


async def test_a_failure_mid_stream_after_a_transfer_completes_the_session_first(
    rig: Rig,
) -> None:
    rig["d1"].behaviour = "drop"
    rig["d1"].tokens = 5
    rig.use(rig.primary(TRANSFER, "d1", "p1"), fallback(RECOMPUTE, "d2"))
    _, events = await rig.stream(COMPLETIONS, request_body(COMPLETIONS, stream=True))
    assert events[-1] == "[DONE]"
    assert "error" in events[-2]
    assert rig["d2"].calls == []
    await rig.control.outcome()
    await rig.control.until(lambda: bool(rig.control.done))
    assert rig.control.done == [SESSION]


@pytest.mark.parametrize("streamed", STREAMED)
async def test_every_step_failing_is_502(rig: Rig, streamed: bool) -> None:
    rig["d2"].behaviour = "error500"
    rig.use(rig.primary(TRANSFER, "dead", "p1"), fallback(RECOMPUTE, "d2"))
    status, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS, stream=streamed))
    assert status == 502
    assert set(answer) == {"error"}
    err = answer["error"]
    assert (err["type"], err["code"], err["param"]) == ("server_error", "upstream_error", None)
    assert "decode_connect_error" in err["message"]
    # the plan, then one re-plan under a request id of its own: both reported failed
    await rig.control.until(lambda: len(rig.control.reports) == 2)
    (rid1, first), (rid2, second) = sorted(rig.control.reports, key=lambda r: r[0])
    assert rid2 == rid1 + ":replan"
    assert len(rig.control.scheduled) == 2
    for out in (first, second):
        assert (out.success, out.error_class, out.status) == (False, "decode_connect_error", 502)
    assert second.fallbacks == 4  # two steps of each plan


@pytest.mark.parametrize("streamed", STREAMED)
@pytest.mark.parametrize("status_4xx", [400, 404, 422])
async def test_an_engine_4xx_goes_back_to_the_client_without_fallback(
    rig: Rig, status_4xx: int, streamed: bool
) -> None:
    rig["d1"].behaviour = "error4xx"
    rig["d1"].status_4xx = status_4xx
    rig.use(rig.primary(RECOMPUTE, "d1"), fallback(RECOMPUTE, "d2"))
    status, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS, stream=streamed))
    assert status == status_4xx
    assert set(answer) == {"error"}
    assert answer["error"]["type"] == "invalid_request_error"
    assert "d1 says no" in answer["error"]["message"]
    assert rig["d2"].calls == []
    out = await rig.control.outcome()
    assert (out.success, out.status, out.fallbacks) == (False, status_4xx, 0)


# -- errors before any engine runs -------------------------------------------------------------

SCHEDULER_REFUSALS = [
    pytest.param(GatewayError(429, "the fleet is saturated", type_="rate_limit_error",
                              code="rate_limited", retry_after_s=1), id="saturated-429"),
    pytest.param(GatewayError(503, "the control plane is unavailable", type_="server_error",
                              code="unavailable", retry_after_s=1), id="unavailable-503"),
    pytest.param(GatewayError(504, "the scheduler did not answer in time",
                              type_="server_error"), id="deadline-504"),
    pytest.param(GatewayError(404, "no worker", code="model_not_found", param="model"),
                 id="no-worker-404"),
]  # fmt: skip


@pytest.mark.parametrize("refusal", SCHEDULER_REFUSALS)
async def test_a_scheduler_refusal_is_answered_in_openai_shape(
    rig: Rig, refusal: GatewayError
) -> None:
    rig.control.schedule_error = refusal
    status, headers, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
    assert status == refusal.status
    assert answer == refusal.body()
    if refusal.retry_after_s:
        assert headers["Retry-After"] == str(refusal.retry_after_s)
    else:
        assert "Retry-After" not in headers
    assert rig["d1"].calls == rig["d2"].calls == []
    assert len(rig.control.scheduled) == 1
    await asyncio.sleep(0.01)
    assert rig.control.reports == []  # nothing was planned: nothing to report


async def test_an_unknown_model_is_404_naming_the_model(rig: Rig) -> None:
    rig.use(rig.primary(RECOMPUTE, "d1"))
    status, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS, model="nope"))
    assert status == 404
    assert answer["error"]["param"] == "model"
    assert answer["error"]["code"] == "model_not_found"
    assert rig.control.scheduled == []
    assert rig["p1"].calls == []


@pytest.mark.parametrize(
    ("behaviour", "status", "code"),
    [
        pytest.param("error500", 502, "upstream_error", id="tokenizer-5xx"),
        pytest.param("error4xx", 400, "invalid_value", id="tokenizer-4xx"),
    ],
)
async def test_a_tokenizer_failure_stops_before_scheduling(
    rig: Rig, behaviour: str, status: int, code: str
) -> None:
    rig["p1"].tokenize_behaviour = behaviour
    rig.control.tokenizers = [closed_port(), rig["p1"].endpoint]
    rig.use(rig.primary(RECOMPUTE, "d1"))
    got, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
    assert (got, answer["error"]["code"]) == (status, code)
    assert rig.control.scheduled == []
    assert [path for path, _ in rig["p1"].calls] == ["/tokenize"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        pytest.param(COMPLETIONS, b'{"model": "tiny", "prompt": ', "body", id="malformed-json"),
        pytest.param(COMPLETIONS, b"[]", "body", id="not-an-object"),
        pytest.param(COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens",
                     id="max-tokens-zero"),
        pytest.param(COMPLETIONS, {"model": MODEL}, "prompt", id="prompt-missing"),
        pytest.param(CHAT, {"model": MODEL, "messages": [{"content": "x"}]}, "messages[0].role",
                     id="chat-role-missing"),
        pytest.param(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                            "kv_transfer_params": {}}, "kv_transfer_params",
                     id="client-kv-transfer-params"),
    ],
)  # fmt: skip
async def test_a_bad_body_is_400_naming_the_field(
    rig: Rig, path: str, body: dict[str, Any] | bytes, param: str
) -> None:
    status, headers, answer = await rig.post(path, body, {"x-request-id": "bad-1"})
    assert status == 400
    assert answer["error"]["param"] == param
    assert answer["error"]["type"] == "invalid_request_error"
    assert headers["x-request-id"] == "bad-1"
    assert rig.control.scheduled == []
    assert rig["p1"].calls == []


async def test_a_body_over_the_limit_is_413() -> None:
    async with open_rig(max_body_bytes=1024) as rig:
        rig.use(rig.primary(RECOMPUTE, "d1"))
        status, _, answer = await rig.post(
            COMPLETIONS, request_body(COMPLETIONS, prompt="x" * 2048)
        )
        assert status == 413
        assert (answer["error"]["param"], answer["error"]["code"]) == ("body", "body_too_large")
        assert rig["p1"].calls == []
        # a body under the limit is served
        status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
        assert status == 200


async def test_requests_past_max_concurrent_are_429() -> None:
    async with open_rig(max_concurrent=1) as rig:
        rig["d1"].behaviour = "hold"
        rig.use(rig.primary(RECOMPUTE, "d1"))
        first = asyncio.create_task(rig.post(COMPLETIONS, request_body(COMPLETIONS)))
        await asyncio.wait_for(rig["d1"].entered.wait(), 2)
        status, headers, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert answer["error"]["type"] == "rate_limit_error"
        assert len(rig.control.scheduled) == 1
        rig["d1"].release.set()
        status, _, _ = await asyncio.wait_for(first, 2)
        assert status == 200
        # the slot is free again
        status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
        assert status == 200


# -- tiers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "tier"),
    [
        pytest.param({}, "bronze", id="default"),
        pytest.param({"x-hpd-tier": "premium"}, "premium", id="header"),
        pytest.param({"Authorization": "Bearer key-1"}, "gold", id="api-key"),
        pytest.param({"Authorization": "Bearer other"}, "bronze", id="unknown-key"),
        pytest.param({"Authorization": "Bearer key-1", "x-hpd-tier": "premium"}, "premium",
                     id="header-over-key"),
    ],
)  # fmt: skip
async def test_the_tier_comes_from_header_then_key_then_default(
    headers: dict[str, str], tier: str
) -> None:
    config = GatewayConfig(default_tier="bronze", api_key_tiers=(("key-1", "gold"),))
    async with open_rig(config=config) as rig:
        rig.use(rig.primary(RECOMPUTE, "d1"))
        status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS), headers)
        assert status == 200
        assert rig.control.scheduled[0][4] == tier


# -- the other routes --------------------------------------------------------------------------


async def test_models_lists_the_fleets_models(rig: Rig) -> None:
    async with rig.http.get(rig.url + "/v1/models") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [(MODEL, "model")]


@pytest.mark.parametrize(
    ("age_s", "status"),
    [
        pytest.param(0.25, 200, id="fresh"),
        pytest.param(30.0, 503, id="stale"),
        pytest.param(float("inf"), 503, id="never-synced"),
    ],
)
async def test_health_follows_the_fleet_views_age(rig: Rig, age_s: float, status: int) -> None:
    rig.control.fleet.age = age_s
    async with rig.http.get(rig.url + "/health") as resp:
        assert resp.status == status
        body = await resp.json()
    if status == 200:
        assert body == {"status": "ok", "fleet_age_s": age_s}
    else:
        assert body["error"]["code"] == "unavailable"


async def test_metrics_count_requests(rig: Rig) -> None:
    rig.use(rig.primary(RECOMPUTE, "d1"))
    status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
    assert status == 200
    async with rig.http.get(rig.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert 'hpd_gateway_requests_total{mode="recompute",status="200"} 1.0' in text


async def test_an_unknown_route_is_404_in_openai_shape(rig: Rig) -> None:
    status, _, answer = await rig.post("/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404
    assert answer["error"]["code"] == "not_found"


# -- client hang-up ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [RECOMPUTE, TRANSFER])
async def test_a_client_hanging_up_cancels_the_engine_request(rig: Rig, mode: str) -> None:
    rig["d1"].behaviour = "hang"
    rig.use(rig.primary(mode, "d1", "p1" if mode == TRANSFER else ""))
    url = rig.url + COMPLETIONS
    async with rig.http.post(url, json=request_body(COMPLETIONS, stream=True)) as resp:
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readline(), 2)
        assert first.startswith(b"data: ")
        assert "d1-0" in json.loads(first[len(b"data: ") :])["choices"][0]["text"]
        resp.close()
    await asyncio.wait_for(rig["d1"].cancelled.wait(), 2)
    out = await rig.control.outcome()
    assert out.success is False
    assert rig["d2"].calls == []


# -- mends found by these tests ---------------------------------------------------------------


async def test_a_session_whose_kv_arrived_is_not_failed_by_a_later_drop(rig: Rig) -> None:
    rig["d1"].behaviour = "drop"
    rig["d1"].tokens = 5
    rig.use(rig.primary(TRANSFER, "d1", "p1"), fallback(RECOMPUTE, "d2"))
    await rig.stream(COMPLETIONS, request_body(COMPLETIONS, stream=True))
    await rig.control.outcome()
    await rig.control.until(lambda: bool(rig.control.done))
    await asyncio.sleep(0.05)
    assert rig.control.failed == []


async def test_retry_after_is_the_refusals_own() -> None:
    async with open_rig() as rig:
        rig.control.schedule_error = GatewayError(429, "busy", retry_after_s=5)
        status, headers, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
        assert status == 429 and headers["Retry-After"] == "5"


async def test_the_engines_get_the_model_id_that_was_scheduled(rig: Rig) -> None:
    rig.use(rig.primary(RECOMPUTE, "d1"))
    status, _, _ = await rig.post(COMPLETIONS, {**request_body(COMPLETIONS), "model": f" {MODEL} "})
    assert status == 200
    assert rig["d1"].generations[-1]["model"] == MODEL


async def test_the_prompts_block_chain_goes_with_the_schedule(rig: Rig) -> None:
    """The engine's /tokenize gives the prompt's token ids; keyed at the fleet's KV block
    size they travel with Schedule, so the scheduler can plan on the engine holding them."""
    rig.use(rig.primary(TRANSFER, "d1", "p1"))
    rig.control.block = 3
    status, _, _ = await rig.post("/v1/completions", request_body("/v1/completions"))
    assert status == 200
    [(prefix, block)] = rig.control.prefixes
    assert block == 3
    assert prefix == chain_hashes(list(range(PROMPT_TOKENS)), 3)  # 7 tokens: 2 full blocks
    # no known block size: no chain (and nothing else changes)
    rig.control.block = 0
    status, _, _ = await rig.post("/v1/completions", request_body("/v1/completions"))
    assert status == 200 and rig.control.prefixes[-1] == ((), 0)


async def test_a_token_id_prompt_is_counted_as_sent_without_a_tokenize_call(rig: Rig) -> None:
    """Token ids need no tokenizer: the gateway counts them and keys their blocks itself,
    with no round trip to an engine's /tokenize."""
    rig.use(rig.primary(TRANSFER, "d1", "p1"))
    rig.control.block = 4
    ids = list(range(100, 110))
    body = {**request_body(COMPLETIONS), "prompt": ids}
    status, _, _ = await rig.post(COMPLETIONS, body)
    assert status == 200
    assert "/tokenize" not in [path for path, _ in rig["p1"].calls]
    assert rig.control.scheduled[-1][2] == len(ids)
    assert rig.control.prefixes[-1] == (chain_hashes(ids, 4), 4)


@pytest.mark.parametrize(
    ("mode", "streamed"), [(TRANSFER, False), (TRANSFER, True), (RECOMPUTE, True)]
)
async def test_the_answer_says_where_the_gateways_own_time_went(
    rig: Rig, mode: str, streamed: bool
) -> None:
    """A W3C Server-Timing header carries the gateway's tokenize and schedule steps (and a
    transfer's prefill call) in milliseconds; the metrics count the same steps."""
    primary = rig.primary(TRANSFER, "d1", "p1") if mode == TRANSFER else rig.primary(mode, "d1")
    rig.use(primary)
    body = request_body(COMPLETIONS, stream=streamed)
    async with rig.http.post(rig.url + COMPLETIONS, json=body) as resp:
        assert resp.status == 200
        header = resp.headers["Server-Timing"]
        await resp.read()
    steps = {}
    for part in header.split(", "):
        name, dur = part.split(";dur=")
        steps[name] = float(dur)
    expected = {"tokenize", "schedule"} | ({"prefill"} if mode == TRANSFER else set())
    assert set(steps) == expected, header
    assert all(v >= 0 for v in steps.values())
    assert steps.get("prefill", 1.0) > 0
    async with rig.http.get(rig.url + "/metrics") as resp:
        text = await resp.text()
    assert 'hpd_gateway_phase_seconds_count{phase="schedule"} 1.0' in text
    assert 'hpd_gateway_phase_seconds_count{phase="tokenize"} 1.0' in text
