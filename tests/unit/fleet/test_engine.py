"""The emulated engine on a fake clock: times come from the performance model, KV memory
fills and frees, batching is continuous, and a killed engine fails its work."""

from __future__ import annotations

import asyncio

import pytest

from hpd_common import perfmodel
from hpd_common.gpus import gpu_profile
from hpd_common.kvformat import KvDtype
from hpd_fleet.engine import EmulatedEngine, EmuTime, EngineSpec, WorkerLost

LLAMA = perfmodel.MODELS["llama-3-8b"]


class FakeWall:
    """Wall time that moves only when someone sleeps."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        await asyncio.sleep(0)


def engine(
    gpu: str = "H100-SXM", scale: float = 10.0, capacity: int = 100_000, batch: int = 8
) -> tuple[EmulatedEngine, FakeWall]:
    wall = FakeWall()
    spec = EngineSpec(
        worker_id="w0",
        pool_id="p",
        model=LLAMA,
        gpu=gpu_profile(gpu),
        tp=1,
        kv_dtype=KvDtype.BF16,
        kv_capacity_tokens=capacity,
        max_batch_size=batch,
    )
    eng = EmulatedEngine(spec, EmuTime(scale, wall.monotonic, wall.sleep), tick_wall_s=0.001)
    eng.start()
    return eng, wall


@pytest.mark.parametrize(
    ("gpu", "tokens"),
    [
        pytest.param("H100-SXM", 1024, id="h100-1k"),
        pytest.param("A100-80G", 4096, id="a100-4k"),
        pytest.param("L4", 300, id="l4-300"),
    ],
)
async def test_prefill_takes_the_roofline_time_divided_by_the_time_scale(
    gpu: str, tokens: int
) -> None:
    eng, wall = engine(gpu, scale=10.0)
    res = await eng.prefill("r", tokens)
    want = perfmodel.prefill_ms(LLAMA, gpu_profile(gpu), 1, tokens)
    assert res.compute_ms == pytest.approx(want)
    assert wall.t == pytest.approx(want / 10.0 / 1000.0)
    assert eng.used_tokens == tokens  # the prompt's KV stays until released
    eng.release("r")
    assert eng.used_tokens == 0
    eng.kill()


async def test_a_lone_sequence_decodes_at_the_memory_bound_step_time() -> None:
    eng, _ = engine(scale=1.0)
    res = await eng.decode("r", 1000, 50)
    gpu = gpu_profile("H100-SXM")
    lo = perfmodel.decode_step_ms(LLAMA, gpu, 1, 1, 1000)
    hi = perfmodel.decode_step_ms(LLAMA, gpu, 1, 1, 1050)
    assert res.tokens == 50
    assert lo <= res.mean_step_ms <= hi
    assert res.finished_at_ms - res.joined_at_ms == pytest.approx(res.mean_step_ms * 50)
    eng.kill()


@pytest.mark.parametrize(
    ("cap", "together"),
    [pytest.param(1, False, id="cap-1-waits"), pytest.param(4, True, id="cap-4-batches")],
)
async def test_batching_is_bounded_by_the_batch_cap(cap: int, together: bool) -> None:
    eng, _ = engine(batch=cap)
    a, b = await asyncio.gather(eng.decode("a", 100, 20), eng.decode("b", 100, 20))
    if together:
        assert a.joined_at_ms == b.joined_at_ms
    else:
        assert b.joined_at_ms >= a.finished_at_ms
    eng.kill()


async def test_allocation_waits_for_memory_and_ballast_counts_as_used() -> None:
    eng, _ = engine(capacity=1000)
    await eng.allocate("a", 800)
    waiting = asyncio.ensure_future(eng.allocate("b", 300))
    await asyncio.sleep(0)
    assert not waiting.done() and eng.queue_depth() == 1
    eng.release("a")
    await waiting
    assert eng.used_tokens == 300
    eng.set_ballast(600)
    report = eng.load_report()
    assert report.kv_blocks_total == 1000 // 16
    assert report.kv_blocks_free == (1000 - 900) // 16
    assert report.memory_util == pytest.approx(0.9)
    eng.kill()


async def test_kill_fails_queued_and_running_work() -> None:
    eng, _ = engine(capacity=100)
    await eng.allocate("a", 100)
    blocked = asyncio.ensure_future(eng.allocate("b", 50))
    decoding = asyncio.ensure_future(eng.decode("c", 10, 10_000))
    await asyncio.sleep(0)
    eng.kill()
    for fut in (blocked, decoding):
        with pytest.raises(WorkerLost):
            await fut
    assert eng.died.is_set()
    with pytest.raises(WorkerLost):
        await eng.prefill("d", 10)
