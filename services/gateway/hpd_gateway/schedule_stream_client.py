"""One `ScheduleStream` per gateway: every request's Schedule goes over it.

A unary `Schedule` per request costs the gateway and the scheduler a new HTTP/2 stream,
its headers and a call object each; over one long-lived bidirectional stream a request
is one message each way (`bench/schedule_rpc.py` measures both). Answers come back in
the order they are decided and are matched to their callers by request id.

When the stream breaks (scheduler restarted, connection lost), every caller still waiting
is told so (`StreamBroken`) and retries with a unary `Schedule` under the same request id,
which is safe (a decided id replays its plan); the next request opens a new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

import grpc

from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.logging import get_logger

log = get_logger("gateway.schedule_stream")


class StreamBroken(Exception):
    """The stream ended before this request was answered: retry it unary."""


class ScheduleStreamClient:
    """Requests in, answers matched by request id (module docstring)."""

    def __init__(self, stub: s_grpc.SchedulerServiceStub) -> None:
        self.stub = stub
        self._outbox: asyncio.Queue[s.ScheduleRequest | None] | None = None
        self._waiting: dict[str, deque[asyncio.Future[s.ScheduleStreamResponse]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._call: grpc.aio.StreamStreamCall | None = None

    async def schedule(self, req: s.ScheduleRequest, timeout_s: float) -> s.ScheduleStreamResponse:
        """The stream's answer for ``req``. Raises `StreamBroken` (retry unary) and
        `TimeoutError` (no answer within ``timeout_s``)."""
        self._ensure_open()
        assert self._outbox is not None
        fut: asyncio.Future[s.ScheduleStreamResponse] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(req.request_id, deque()).append(fut)
        self._outbox.put_nowait(req)
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        finally:
            waiters = self._waiting.get(req.request_id)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._waiting[req.request_id]

    def _ensure_open(self) -> None:
        if self._reader is not None and not self._reader.done():
            return
        outbox: asyncio.Queue[s.ScheduleRequest | None] = asyncio.Queue()
        self._outbox = outbox

        async def requests() -> AsyncIterator[s.ScheduleRequest]:
            while (req := await outbox.get()) is not None:
                yield req

        self._call = self.stub.ScheduleStream(requests())
        self._reader = asyncio.ensure_future(self._read(self._call))

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        why = "stream ended"
        try:
            async for answer in call:
                waiters = self._waiting.get(answer.request_id)
                if not waiters:
                    continue  # its caller gave up (timeout) meanwhile
                fut = waiters.popleft()
                if not waiters:
                    del self._waiting[answer.request_id]
                if not fut.done():
                    fut.set_result(answer)
        except grpc.aio.AioRpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
            log.info("schedule_stream_broken", reason=why)
        finally:
            self._outbox = None
            waiting, self._waiting = self._waiting, {}
            for waiters in waiting.values():
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(StreamBroken(why))

    async def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
