"""WorkerClient.stop: a deregistration the registry misses is tried again, so a gone
engine is not planned on until its lease lapses; a worker already gone is not an error."""

from __future__ import annotations

import random
from typing import Any

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hpd_agent.worker_client import ClientTiming, WorkerClient
from hpd_common.clock import SystemClock


class FakeRegistry:
    def __init__(self, answers: list[grpc.StatusCode | None]) -> None:
        self.answers = answers
        self.calls = 0

    async def DeregisterWorker(self, req: Any, timeout: float) -> None:
        self.calls += 1
        code = self.answers.pop(0)
        if code is not None:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")


def client(registry: FakeRegistry) -> WorkerClient:
    channel: Any = grpc.aio.insecure_channel("127.0.0.1:1")
    wc = WorkerClient(
        c.WorkerCapability(worker_id="w0"),
        channel,
        None,
        lambda: None,
        SystemClock(),
        random.Random(1),
        timing=ClientTiming(min_backoff_s=0.001, max_backoff_s=0.002),
    )
    wc._registry = registry
    wc.credential = "cred"
    return wc


@pytest.mark.parametrize(
    ("answers", "calls"),
    [
        ([None], 1),
        ([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None], 3),
        ([grpc.StatusCode.UNAVAILABLE] * 3, 3),  # then the lease takes it out
        ([grpc.StatusCode.NOT_FOUND], 1),  # already gone
        ([grpc.StatusCode.INVALID_ARGUMENT], 1),  # not worth repeating
    ],
)
async def test_stop_deregisters_and_retries_a_busy_registry(
    answers: list[grpc.StatusCode | None], calls: int
) -> None:
    registry = FakeRegistry(list(answers))
    wc = client(registry)
    await wc.stop(deregister=True)
    assert registry.calls == calls
    assert not wc.alive


async def test_stop_without_deregistering_says_nothing() -> None:
    registry = FakeRegistry([])
    wc = client(registry)
    await wc.stop(deregister=False)
    assert registry.calls == 0
