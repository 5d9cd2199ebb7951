"""Reading WatchWorkers streams event by event (the registry batches events per message)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc


class EventReader:
    """Flattens a WatchWorkers call into single events."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self._buffer: list[Any] = []

    async def read(self, timeout: float = 5.0) -> Any:
        while not self._buffer:
            msg = await asyncio.wait_for(self.call.read(), timeout)
            assert msg is not grpc.aio.EOF, "watch stream ended"
            self._buffer.extend(msg.events)
        return self._buffer.pop(0)

    async def next(self, want: int, worker_id: str = "", timeout: float = 5.0) -> Any:
        """The next event of type `want` (for `worker_id`, if given)."""
        deadline = time.monotonic() + timeout
        while True:
            ev = await self.read(max(0.01, deadline - time.monotonic()))
            if ev.type == want and (not worker_id or ev.worker_id == worker_id):
                return ev

    def cancel(self) -> None:
        self.call.cancel()
