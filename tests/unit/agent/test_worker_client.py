"""WorkerClient.stop: a deregistration the registry misses is tried again, so a gone
engine is not planned on until its lease lapses; a worker already gone is not an error."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hpd_agent.directive_acks import MAX_ACKS_PER_REPORT, DirectiveAcks
from hpd_agent.worker_client import ClientTiming, WorkerClient
from hpd_common.clock import SystemClock


class FakeRegistry:
    """Answers each DeregisterWorker with the next code of ``answers`` (None: OK); once
    they run out, with ``then`` for ever."""

    def __init__(
        self, answers: list[grpc.StatusCode | None], then: grpc.StatusCode | None = None
    ) -> None:
        self.answers = answers
        self.then = then
        self.calls = 0

    async def DeregisterWorker(self, req: Any, timeout: float) -> None:
        self.calls += 1
        code = self.answers.pop(0) if self.answers else self.then
        if code is not None:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")


def client(registry: FakeRegistry, budget_s: float = 10.0, lease_ms: int = 0) -> WorkerClient:
    channel: Any = grpc.aio.insecure_channel("127.0.0.1:1")
    wc = WorkerClient(
        c.WorkerCapability(worker_id="w0"),
        channel,
        None,
        lambda: None,
        SystemClock(),
        random.Random(1),
        timing=ClientTiming(min_backoff_s=0.001, max_backoff_s=0.002, retry_budget_s=budget_s),
    )
    wc._registry = registry
    wc.credential = "cred"
    wc.lease_ttl_ms = lease_ms  # 0: the budget is retry_budget_s
    return wc


@pytest.mark.parametrize(
    ("answers", "calls"),
    [
        ([None], 1),
        ([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None], 3),
        ([grpc.StatusCode.UNAVAILABLE] * 20 + [None], 21),  # a long stall: still said
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


async def test_a_registry_away_for_the_whole_budget_is_left_to_the_lease() -> None:
    registry = FakeRegistry([], then=grpc.StatusCode.UNAVAILABLE)
    wc = client(registry, budget_s=0.05)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await wc.stop(deregister=True)
    assert registry.calls > 3  # tried for the budget, not a fixed count
    assert loop.time() - t0 < 1.0  # and then gave up: the lease takes the worker out
    assert not wc.alive


async def test_a_lease_longer_than_the_budget_is_the_budget() -> None:
    """Retried for one lease when that is longer than the retry budget: the worker would
    stay listed that long anyway, and a registry that stalled grants its lease a grace."""
    registry = FakeRegistry([], then=grpc.StatusCode.UNAVAILABLE)
    wc = client(registry, budget_s=0.001, lease_ms=200)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await wc.stop(deregister=True)
    # backoffs of at most 2 ms: tried for about the lease, far past the 1 ms budget
    assert loop.time() - t0 >= 0.15
    assert registry.calls > 10


async def test_stop_without_deregistering_says_nothing() -> None:
    registry = FakeRegistry([])
    wc = client(registry)
    await wc.stop(deregister=False)
    assert registry.calls == 0


async def test_a_redelivered_directive_is_acked_again_and_applied_once() -> None:
    applied: list[str] = []
    wc = client(FakeRegistry([]))
    wc._on_directive = lambda d: applied.append(d.directive_id)
    d = c.Directive(directive_id="d-1", kind=c.DIRECTIVE_KIND_DRAIN, reason="x")
    wc._apply(d)
    assert list(wc._report(first=False).acked_directive_ids) == ["d-1"]
    wc._apply(d)  # the ack was lost with its report: the registry sent it again
    assert applied == ["d-1"]
    assert list(wc._report(first=False).acked_directive_ids) == ["d-1"]
    assert list(wc._report(first=False).acked_directive_ids) == []


def test_acks_are_handed_out_once_and_bounded_per_report() -> None:
    acks = DirectiveAcks()
    assert all(acks.take(f"d-{i}") for i in range(MAX_ACKS_PER_REPORT + 3))
    assert not acks.take("d-0")  # a redelivery: acked again, not new
    first = acks.due()
    assert len(first) == MAX_ACKS_PER_REPORT and first[0] == "d-0"
    assert acks.due() == ["d-256", "d-257", "d-258", "d-0"]
    assert acks.due() == []
    assert acks.take("")  # no id: always new, nothing to ack
    assert acks.due() == []
