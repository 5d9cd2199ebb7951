"""The emulated fleet over HTTP: every emulated worker answers on a port of its own with the
protocol a vLLM engine speaks, so ``hpd gateway`` runs plans on emulated engines exactly as
it runs them on real ones (one code path for both).

What each worker serves (vLLM 0.32's OpenAI server, as ``REAL_ENGINES.md`` records it):

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, whole or streamed (SSE, one
  event per token, ``stream_options.include_usage``), with ``max_tokens`` (or
  ``max_completion_tokens``) tokens out; the text is a placeholder, the timing is the
  engine's (``hpd_fleet.engine``);
* NIXL's hand-off through ``kv_transfer_params``: a request with ``do_remote_decode``
  prefills, keeps the prompt's KV and answers one token with ``do_remote_prefill`` params
  naming this engine (``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
  ``remote_host``/``remote_port``, ``remote_num_tokens``); a request carrying those params
  pulls the KV from the named engine over the fleet's link model (the time the cluster's
  link takes for the prompt's KV bytes), frees it there, and decodes. A pull from an
  engine that died or no longer holds the KV fails the request with a 500, as a failed
  NIXL read does, and the gateway walks its fallback chain. Held KV that nobody pulls is
  freed after ``KV_HOLD_S`` (vLLM's abort timeout does the same);
* ``POST /tokenize``: a token-id prompt is its own ids; text is one token per
  whitespace-separated word (ids from a CRC of the word), chat adds
  ``CHAT_TOKENS_PER_MESSAGE`` per message as a template does;
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` with vLLM's names
  (``vllm:num_requests_running``/``_waiting``, ``vllm:kv_cache_usage_perc``,
  ``vllm:cache_config_info``, ``vllm:prompt_tokens_by_source_total{source=...}``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total``).

A killed worker (``Fleet.kill``) stops listening and drops every open connection, as a
crashed engine's clients see it: a refused connection, or a stream cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from hpd_common.logging import get_logger
from hpd_gateway.protocol import sse_event
from hpd_gateway.tokens import CHAT_TOKENS_PER_MESSAGE  # the gateway's estimate is the same

from .engine import WorkerLost
from .engine_metrics import Counters, EngineMetrics
from .fleet import EmulatedWorker, Fleet, advertised_host

__all__ = ["CHAT_TOKENS_PER_MESSAGE", "KV_HOLD_S", "FleetHttp", "prompt_ids"]

log = get_logger("fleet.http")

KV_HOLD_S = 60.0
"""Wall seconds a prefilled prompt's KV waits for its decode engine to pull it."""
_VOCAB = 32_000


class _BadRequest(Exception):
    pass


def _word_id(word: str) -> int:
    return zlib.crc32(word.encode()) % _VOCAB


def prompt_ids(body: Mapping[str, Any]) -> list[int]:
    """The prompt's token ids as this engine counts them (module docstring)."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise _BadRequest("messages must be a list")
        ids: list[int] = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            ids += [_word_id(w) for w in str(content or "").split()]
            ids += [1] * CHAT_TOKENS_PER_MESSAGE
        return ids
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list):
        prompt = prompt[0] if len(prompt) == 1 and isinstance(prompt[0], str) else None
    if not isinstance(prompt, str):
        raise _BadRequest("prompt must be a string or a list of token ids")
    return [_word_id(w) for w in prompt.split()]


def _max_tokens(body: Mapping[str, Any]) -> int:
    raw = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if raw is None:
        raw = 16
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        raise _BadRequest("max_tokens must be a positive integer")
    return raw


@dataclass(slots=True)
class _Held:
    tokens: int
    kv_bytes: int
    expiry: asyncio.TimerHandle | None = None


class _WorkerServer:
    """One emulated worker's HTTP face (module docstring)."""

    def __init__(
        self,
        fleet: Fleet,
        worker: EmulatedWorker,
        sock: socket.socket,
        peers: Mapping[str, _WorkerServer],
        host: str,
    ) -> None:
        self.fleet = fleet
        self.peers = peers
        self.worker = worker
        self.sock = sock
        self.host, self.port = host, sock.getsockname()[1]  # host: the name callers use
        self.counters = Counters()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineMetrics(worker, self.counters))
        self.held: dict[str, _Held] = {}
        self.runner: web.AppRunner | None = None
        self._open: set[asyncio.Transport] = set()
        """The transports of requests being answered (a crash cuts them)."""
        self._watch: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self) -> None:
        self.runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()
        self._watch = asyncio.create_task(self._on_death())

    async def stop(self) -> None:
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()  # (not when the watch itself stops the server: see _on_death)
        for held in self.held.values():
            if held.expiry is not None:
                held.expiry.cancel()
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()

    async def _on_death(self) -> None:
        """A crash: stop listening and cut every open connection."""
        await self.worker.engine.died.wait()
        for transport in list(self._open):
            transport.abort()
        await self.stop()

    # -- routes -----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.worker.engine.alive else 503)

    async def models(self, request: web.Request) -> web.Response:
        model = self.worker.view.model_id
        return web.json_response(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "hpd"}]}
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), content_type="text/plain", charset="utf-8"
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise _BadRequest("the body must be a JSON object")
            ids = prompt_ids(body)
        except (ValueError, _BadRequest) as exc:
            return _error(400, str(exc))
        return web.json_response({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise _BadRequest("the body must be a JSON object")
            n_prompt = len(prompt_ids(body))
            _max_tokens(body)  # checked here, used by the reply
            kv = body.get("kv_transfer_params")
            if kv is not None and not isinstance(kv, dict):
                raise _BadRequest("kv_transfer_params must be an object")
        except (ValueError, _BadRequest) as exc:
            return _error(400, str(exc))
        if body.get("model") not in (None, self.worker.view.model_id):
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        chat = request.path.endswith("/chat/completions")
        reply = _Reply(request, body, chat, self.worker.view.model_id, n_prompt)
        transport = request.transport
        if isinstance(transport, asyncio.Transport):
            self._open.add(transport)
        try:
            if kv and kv.get("do_remote_decode"):
                return await self._prefill_only(reply)
            return await self._serve(reply, kv if kv and kv.get("do_remote_prefill") else None)
        except WorkerLost:
            if request.transport is not None:
                request.transport.abort()  # a crashed engine answers nothing
            raise web.HTTPServiceUnavailable() from None
        finally:
            if isinstance(transport, asyncio.Transport):
                self._open.discard(transport)

    # -- the hand-off -----------------------------------------------------------------------

    async def _prefill_only(self, reply: _Reply) -> web.StreamResponse:
        eng = self.worker.engine
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = reply.prompt_tokens
        self.counters.running += 1
        try:
            await eng.prefill(rid, n)  # allocates and keeps the prompt's KV
        except BaseException:
            eng.release(rid)
            raise
        finally:
            self.counters.running -= 1
        self.counters.prompt_by_source["local_compute"] += n
        self.counters.generation += 1
        self.counters.success += 1
        held = _Held(n, eng.spec.kv_bytes(n))
        held.expiry = asyncio.get_running_loop().call_later(KV_HOLD_S, self._expire, rid)
        self.held[rid] = held
        block = eng.spec.block_size_tokens
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.worker.worker_id,
            "remote_request_id": rid,
            "remote_block_ids": [list(range((n + block - 1) // block))],
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_num_tokens": n,
            "tp_size": self.worker.view.tp_size,
        }
        return reply.whole(1, params)

    def _expire(self, rid: str) -> None:
        if self.held.pop(rid, None) is not None:
            self.worker.engine.release(rid)

    def take(self, rid: str) -> _Held | None:
        """Hand the KV of prefilled ``rid`` over (None when it is not held here)."""
        held = self.held.pop(rid, None)
        if held is not None and held.expiry is not None:
            held.expiry.cancel()
        return held

    async def _pull(self, params: Mapping[str, Any]) -> None:
        """Pull the prompt's KV from the engine ``params`` name, over the fleet's link."""
        src_id = str(params.get("remote_engine_id", ""))
        remote = str(params.get("remote_request_id", ""))
        src = self.fleet.get(src_id)
        server = self.peers.get(src_id)
        held = server.take(remote) if server else None
        if src is None or server is None or held is None or not src.engine.alive:
            raise _PullFailed(f"no KV for {remote!r} on {src_id!r}")
        try:
            ms = Fleet.transfer_ms(self.fleet.link(src_id, self.worker.worker_id), held.kv_bytes)
            pulled = asyncio.ensure_future(self.fleet.time.sleep_ms(ms))
            died = asyncio.ensure_future(src.engine.died.wait())
            try:
                await asyncio.wait([pulled, died], return_when=asyncio.FIRST_COMPLETED)
            finally:
                died.cancel()
                pulled.cancel()
            if not src.engine.alive:
                raise _PullFailed(f"{src_id} died during the transfer")
        finally:
            src.engine.release(remote)
        self.counters.kv_bytes_pulled += held.kv_bytes

    async def _serve(self, reply: _Reply, pull: Mapping[str, Any] | None) -> web.StreamResponse:
        eng = self.worker.engine
        rid = f"cmpl-{uuid.uuid4().hex}"
        n, out = reply.prompt_tokens, reply.max_tokens
        self.counters.running += 1
        try:
            await eng.allocate(rid, n + out)
            if pull is not None:
                try:
                    await self._pull(pull)
                except _PullFailed as exc:
                    return _error(500, f"KV transfer failed: {exc}", "server_error")
                self.counters.prompt_by_source["external_kv_transfer"] += n
            else:
                await eng.prefill(rid, n, hold_kv=False)
                self.counters.prompt_by_source["local_compute"] += n
            if not reply.stream:
                await eng.decode(rid, n, out - 1)
                self.counters.generation += out
                self.counters.success += 1
                return reply.whole(out, None)
            return await self._stream(reply, rid, n, out)
        finally:
            self.counters.running -= 1
            eng.release(rid)

    async def _stream(self, reply: _Reply, rid: str, n: int, out: int) -> web.StreamResponse:
        resp = await reply.start_stream()
        queue: asyncio.Queue[int] = asyncio.Queue()
        await resp.write(reply.token_event(first=True))  # the prefill's token
        self.counters.generation += 1
        decode = asyncio.ensure_future(
            self.worker.engine.decode(rid, n, out - 1, on_tokens=queue.put_nowait)
        )
        try:
            sent = 1
            while sent < out:
                if decode.done() and queue.empty():
                    decode.result()  # raises WorkerLost when the engine died
                    break
                getter = asyncio.ensure_future(queue.get())
                try:
                    await asyncio.wait([getter, decode], return_when=asyncio.FIRST_COMPLETED)
                finally:  # also when this handler is cancelled (the client or the site went)
                    got = getter.done()
                    if not got:
                        getter.cancel()
                if not got:
                    continue
                k = getter.result()
                await resp.write(reply.token_event(tokens=k))
                sent += k
                self.counters.generation += k
            await decode
        finally:
            if not decode.done():
                decode.cancel()
            with contextlib.suppress(BaseException):
                await decode  # retrieved: a crash's WorkerLost is not left unseen
        await resp.write(reply.final_events(out))
        self.counters.success += 1
        await resp.write_eof()
        return resp


class _PullFailed(Exception):
    pass


class _Reply:
    """The OpenAI shapes of one request's answer (completions or chat)."""

    def __init__(
        self, request: web.Request, body: Mapping[str, Any], chat: bool, model: str, n: int
    ) -> None:
        self.request = request
        self.chat = chat
        self.model = model
        self.prompt_tokens = n
        self.max_tokens = _max_tokens(body)
        self.stream = bool(body.get("stream"))
        opts = body.get("stream_options")
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _usage(self, out: int) -> dict[str, int]:
        n = self.prompt_tokens
        return {"prompt_tokens": n, "completion_tokens": out, "total_tokens": n + out}

    def whole(self, out: int, kv: Mapping[str, Any] | None) -> web.Response:
        text = " tok" * out
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(out),
        }
        if kv is not None:
            body["kv_transfer_params"] = dict(kv)
        return web.json_response(body)

    async def start_stream(self) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(self.request)
        return resp

    def _event(self, choices: Iterable[Mapping[str, Any]], **extra: Any) -> bytes:
        event = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": list(choices),
            **extra,
        }
        return sse_event(event)

    def token_event(self, first: bool = False, tokens: int = 1) -> bytes:
        """One event carrying ``tokens`` tokens: the engine emulation runs the steps of one
        tick as one sleep, and an event per tick keeps a fleet's worth of streams cheap for
        the one process that runs every engine, the control plane and the clients (the usage
        chunk carries the exact count, as vLLM's does)."""
        text = " tok" * tokens
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        return self._event([choice])

    def final_events(self, out: int) -> bytes:
        if self.chat:
            last: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": "length"}
        else:
            last = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        data = self._event([last])
        if self.include_usage:
            data += self._event([], usage=self._usage(out))
        return data + sse_event("[DONE]")


def _error(status: int, message: str, type_: str = "BadRequestError") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": type_, "param": None, "code": status}},
        status=status,
    )


class FleetHttp:
    """Binds a port per worker of ``fleet`` on ``host`` (before the fleet registers, so each
    worker's capability names its real endpoint), then serves them all (module docstring).
    Workers register as ``<advertise>:<port>`` (:func:`~hpd_fleet.fleet.advertised_host`)."""

    def __init__(self, fleet: Fleet, host: str = "127.0.0.1", advertise: str = "") -> None:
        name = advertised_host(host, advertise)
        self.fleet = fleet
        self.servers: dict[str, _WorkerServer] = {}
        """Every worker's server: where a decode finds the engine that holds the KV it pulls
        (the emulation's stand-in for NIXL's side channel)."""
        for w in fleet:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            self.servers[w.worker_id] = _WorkerServer(fleet, w, sock, self.servers, name)
        fleet.set_endpoints({wid: srv.endpoint for wid, srv in self.servers.items()})

    def endpoint(self, worker_id: str) -> str:
        return self.servers[worker_id].endpoint

    async def start(self) -> None:
        for srv in self.servers.values():
            await srv.start()

    async def stop(self) -> None:
        for srv in self.servers.values():
            await srv.stop()
            with contextlib.suppress(OSError):
                srv.sock.close()
