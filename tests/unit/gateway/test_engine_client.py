"""The gateway's engine client against a raw TCP engine that drops connections unanswered
(as an engine closing an idle keep-alive connection does the moment a request arrives)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from hpd_gateway.engine_client import EngineHttp, UpstreamError


class DroppingEngine:
    """Reads each request; drops the first ``drops`` connections without a byte of answer,
    answers the rest with ``body`` (JSON, or an SSE stream when ``sse``)."""

    def __init__(self, drops: int, sse: bool = False) -> None:
        self.drops = drops
        self.sse = sse
        self.connections = 0
        self.server: asyncio.Server | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        if self.connections <= self.drops:
            writer.transport.abort()  # no answer at all
            return
        if self.sse:
            events = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Content-Length: %d\r\n\r\n" % len(events) + events
            )
        else:
            payload = json.dumps({"ok": True}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(payload) + payload
            )
        await writer.drain()
        writer.close()


@pytest.fixture
async def client() -> AsyncIterator[EngineHttp]:
    http = EngineHttp(connect_timeout_s=2.0, read_timeout_s=5.0)
    await http.start()
    yield http
    await http.close()


async def serve(engine: DroppingEngine) -> None:
    engine.server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)


async def test_a_request_dropped_unanswered_is_sent_once_more(client: EngineHttp) -> None:
    engine = DroppingEngine(drops=1)
    await serve(engine)
    assert await client.post_json(engine.endpoint, "/v1/completions", {"x": 1}) == {"ok": True}
    assert engine.connections == 2


async def test_an_engine_that_keeps_dropping_fails_the_step_after_one_retry(
    client: EngineHttp,
) -> None:
    engine = DroppingEngine(drops=10)
    await serve(engine)
    with pytest.raises(UpstreamError) as err:
        await client.post_json(engine.endpoint, "/v1/completions", {"x": 1})
    assert err.value.cause == "connect_error" and engine.connections == 2


async def test_a_stream_dropped_before_its_answer_is_sent_once_more(client: EngineHttp) -> None:
    engine = DroppingEngine(drops=1, sse=True)
    await serve(engine)
    got = [e async for e in client.stream(engine.endpoint, "/v1/completions", {"stream": True})]
    assert got == [b'{"choices": [{"text": "a"}]}', None]
    assert engine.connections == 2


async def test_a_refused_connection_is_not_retried(client: EngineHttp) -> None:
    engine = DroppingEngine(drops=0)
    await serve(engine)
    endpoint = engine.endpoint
    assert engine.server is not None
    engine.server.close()
    await engine.server.wait_closed()
    with pytest.raises(UpstreamError) as err:
        await client.post_json(endpoint, "/v1/completions", {"x": 1})
    assert err.value.cause == "connect_error" and engine.connections == 0
