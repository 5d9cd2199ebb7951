"""Speeds learned from outcomes, through the scheduler's API: a worker that runs slower
than it declares is planned at its measured speed, every replica learns the same figures
from the samples they share in Redis, and the estimates' error is exported."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict
from prometheus_client import REGISTRY

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import scheduler_pb2 as s
from hpd_scheduler.policy.learner import SpeedLearner
from hpd_scheduler.policy.learning import MIN_SAMPLES, prefill_key, queue_key
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.scheduler import IDLE, SchedulerHandle, own_scheduler, register, sched
from tests.support.servers import RegistryHandle


def _taken(learner: SpeedLearner, wid: str) -> int:
    """The prefill samples of ``wid`` the learner holds (queued or not)."""
    return sum(len(learner.samples.get(k(wid), [])) for k in (prefill_key, queue_key))


async def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def _pair(h: SchedulerHandle) -> tuple[str, str]:
    """One worker serving both stages and nothing else for its model (every plan is
    local on it: its TTFT is its prefill phase)."""
    p = h.registry.prefix
    wid = f"{p}-both"
    await register(
        h.registry, wid, IDLE, pool_id=f"{p}-pool", stages=(c.STAGE_PREFILL, c.STAGE_DECODE),
        gpu="H100-SXM", kv_gib=40, model="learn-model",
    )  # fmt: skip
    await h.settle([wid])
    return wid, "learn-model"


async def test_replicas_plan_a_slow_worker_at_the_speed_either_one_measured(
    redis_server: EmbeddedRedis, registry: RegistryHandle
) -> None:
    async with (
        own_scheduler(redis_server.url, registry, scheduler_id="a") as a,
        own_scheduler(redis_server.url, registry, scheduler_id="b") as b,
    ):
        assert a.service is not None and b.service is not None
        wid, model = await _pair(a)
        await b.settle([wid])
        await a.stub.Schedule(sched("ls-0", prompt=800, model=model), timeout=5)
        ws = a.service.fleet().worker(wid)
        assert ws is not None
        learner_a = a.service.observed.learner
        cap = ws.cap  # the declared speed (one request at a time: nothing queued ahead)
        # the engine really takes 50 ms per request plus 30x its declared compute
        for i in range(MIN_SAMPLES + 4):
            rid, prompt = f"ls-{i}", 800 if i == 0 else 400 + 150 * i
            if i:
                await a.stub.Schedule(sched(rid, prompt=prompt, model=model), timeout=5)
            ttft = 50.0 + 30.0 * cap.prefill_ms(prompt)
            await a.stub.ReportOutcome(
                s.ReportOutcomeRequest(
                    request_id=rid, success=True, ttft_ms=ttft, prefill_ms=ttft, tpot_ms=20
                ),
                timeout=5,
            )
            # learned in a batch, off the report's path (hpd_scheduler.learning_queue)
            taken = i + 1
            await _until(lambda: _taken(learner_a, wid) >= taken)  # noqa: B023
            if learner_a.prefill(wid) is not None:
                break
        learned_a = a.service.observed.learner.prefill(wid)
        assert learned_a is not None
        assert learned_a.scale > 4.0  # past the report's clamp
        # replica b never saw an outcome: it takes the samples from Redis
        learner_b = b.service.observed.learner
        await _until(lambda: learner_b.prefill(wid) == learned_a)
        await b.settle([wid])
        later = await b.stub.Schedule(sched("ls-b", prompt=800, model=model), timeout=5)
        rec = await b.stub.GetRouteRecord(s.GetRouteRecordRequest(request_id="ls-b"), timeout=5)
        notes = list(MessageToDict(rec.record.explanation).get("notes", []))
        assert any(n.startswith(f"prefill_speed:{wid}:learned:") for n in notes), notes
        e = later.plan.estimates
        assert e.prefill_wait_ms + e.prefill_ms == pytest.approx(
            50.0 + 30.0 * cap.prefill_ms(800), rel=0.05
        )
        # an operator sees it per worker
        hpd = Path(sys.executable).with_name("hpd")
        shown = await asyncio.create_subprocess_exec(
            str(hpd), "workers", "-o", "wide", "--registry", registry.target,
            "--scheduler", b.target, "--model", model,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await shown.communicate()
        assert shown.returncode == 0, err
        line = next(x for x in out.decode().splitlines() if x.startswith(wid))
        shown_as = (
            f"+ {learned_a.scale:.3g}x declared, {learned_a.queue_share:.2g} queued "
            f"({learned_a.samples})"
        )
        assert shown_as in line, out
        ratio = REGISTRY.get_sample_value(
            "hpd_scheduler_ttft_estimate_ratio_count", {"worker": wid, "tier": "standard"}
        )
        assert ratio is not None and ratio >= MIN_SAMPLES
