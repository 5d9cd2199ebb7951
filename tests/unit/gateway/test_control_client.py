"""ControlPlane.report: an outcome the control plane could not take is sent again while it
answers UNAVAILABLE or misses the deadline (the scheduler attaches an outcome once), within
the report budget; other refusals are not repeated."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from hpd_gateway.control_client import ControlPlane
from hpd_gateway.plan import Outcome


class FakeScheduler:
    def __init__(self, answers: list[grpc.StatusCode | None]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def ReportOutcome(
        self, req: Any, timeout: float, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        assert ("x-request-id", req.request_id) in metadata  # the scheduler's logs join
        self.calls.append(req.request_id)
        code = self.answers.pop(0) if self.answers else None
        if code is not None:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")


@pytest.mark.parametrize(
    ("answers", "budget_s", "calls"),
    [
        ([None], 30.0, 1),
        ([grpc.StatusCode.UNAVAILABLE] * 3 + [None], 30.0, 4),
        ([grpc.StatusCode.DEADLINE_EXCEEDED, None], 30.0, 2),
        ([grpc.StatusCode.UNAVAILABLE] * 50, 0.5, 3),  # 0.1 + 0.2 s backoff, then given up
        ([grpc.StatusCode.PERMISSION_DENIED], 30.0, 1),
        ([grpc.StatusCode.NOT_FOUND], 30.0, 1),
    ],
)
async def test_an_outcome_is_reported_again_while_the_plane_is_away(
    answers: list[grpc.StatusCode | None], budget_s: float, calls: int
) -> None:
    plane = ControlPlane("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", report_budget_s=budget_s)
    fake = FakeScheduler(list(answers))
    plane._stubs = [fake]
    try:
        await plane.report("r-1", Outcome(success=True, mode="transfer", ttft_ms=12.0))
    finally:
        await plane.close()
    assert fake.calls == ["r-1"] * calls
