"""An emulated inference engine: one GPU worker's queue, KV memory and batch, timed by the
shared performance model and run faster than real time.

**Time.** The engine lives on *emulated* time: ``EmuTime.now_ms()`` is wall time since the
start multiplied by the time scale ``k``, and an operation that takes ``t`` emulated ms is a
wall sleep of ``t / k / 1000`` s. Every figure the engine reports (step times, TTFT, prefill
throughput) is in emulated units, so the control plane's estimates and the engine's figures
agree at any ``k``. (RPC round trips are not scaled: at ``k = 10`` a 2 ms call looks like
20 ms of emulated time, a pessimism the report inherits.)

**One GPU loop per worker**, as in a real engine that alternates prefill and decode:

* a FIFO prefill queue; a prefill of ``n`` tokens takes
  ``perfmodel.prefill_ms(model, gpu, tp, n)`` (the roofline, compute-bound for real prompts)
  and holds the prompt's KV (``n`` tokens) until the hand-off releases it;
* a decode batch (continuous batching): sequences join between steps while the batch is under
  its cap (``max_batch_size``, changeable by directive) and leave when they have produced their
  last token; one step of batch ``b`` holding ``C`` context tokens in total takes
  ``perfmodel.decode_step_ms(model, gpu, tp, b, C)`` (memory-bound: weights + all KV read
  once); to keep the event loop light, up to ``floor(tick / step)`` identical steps run as one
  sleep (``tick_wall_s x k`` emulated ms), never past the next sequence's completion;
* a queued prefill runs before the next decode chunk (decode stalls during a colocated or
  recompute prefill, the interference PD disaggregation exists to avoid).

**KV memory** in tokens: ``capacity = perfmodel.max_kv_tokens(...)``; a decode sequence
reserves ``prompt + output`` tokens at admission (as the scheduler reserves), a prefill holds
its prompt until released; an allocation that does not fit waits for frees. ``ballast`` tokens
(fault injection) occupy memory without doing work.

**Death.** :meth:`EmulatedEngine.kill` fails every waiting and running operation with
:class:`WorkerLost`, as a crashed engine's clients would see connection errors.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hpd_common import perfmodel
from hpd_common.gpus import GpuProfile
from hpd_common.kvformat import KvDtype
from hpd_common.worker_model import LoadReport
from hpd_sim.metrics import percentile

__all__ = [
    "DecodeResult",
    "EmuTime",
    "EmulatedEngine",
    "EngineSpec",
    "PrefillResult",
    "WorkerLost",
]


class WorkerLost(Exception):
    """The worker died (or was stopped) before the operation finished."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker {worker_id} is gone")
        self.worker_id = worker_id


@dataclass(frozen=True, slots=True)
class EmuTime:
    """Emulated time: ``now_ms = (monotonic() - start) x 1000 x scale``; ``sleep_ms(t)``
    sleeps ``t / scale`` ms of wall time. ``monotonic`` and ``sleep`` are injected."""

    scale: float
    monotonic: Callable[[], float]
    sleep: Callable[[float], Awaitable[None]]
    start: float = 0.0

    def __post_init__(self) -> None:
        if not self.scale > 0 or not math.isfinite(self.scale):
            raise ValueError(f"time scale must be > 0, got {self.scale}")

    def now_ms(self) -> float:
        return (self.monotonic() - self.start) * 1000.0 * self.scale

    async def sleep_ms(self, emu_ms: float) -> None:
        await self.sleep(max(0.0, emu_ms) / 1000.0 / self.scale)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the emulated engine is: model, GPU, TP, KV dtype and memory, caps."""

    worker_id: str
    pool_id: str
    model: perfmodel.ModelSpec
    gpu: GpuProfile
    tp: int
    kv_dtype: KvDtype
    kv_capacity_tokens: int
    block_size_tokens: int = 16
    max_batch_size: int = 256
    queue_max: int = 256
    efficiency: perfmodel.Efficiency = perfmodel.DEFAULT_EFFICIENCY

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens <= 0:
            raise ValueError(f"{self.worker_id}: kv_capacity_tokens must be > 0")
        if self.max_batch_size < 1 or self.queue_max < 1 or self.block_size_tokens < 1:
            raise ValueError(f"{self.worker_id}: caps must be >= 1")

    def prefill_ms(self, tokens: int) -> float:
        return perfmodel.prefill_ms(self.model, self.gpu, self.tp, tokens, self.efficiency)

    def step_ms(self, batch: int, context_tokens: int) -> float:
        return perfmodel.decode_step_ms(
            self.model, self.gpu, self.tp, batch, context_tokens, self.efficiency, self.kv_dtype
        )

    def kv_bytes(self, tokens: int) -> int:
        return perfmodel.kv_bytes(self.model, tokens, self.kv_dtype)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """Emulated ms: waited in the queue, computed, and when it finished."""

    wait_ms: float
    compute_ms: float
    done_at_ms: float


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """Emulated ms: when the sequence joined the batch and finished; its tokens and the
    mean step time it saw."""

    joined_at_ms: float
    finished_at_ms: float
    tokens: int
    mean_step_ms: float


@dataclass(slots=True)
class _Prefill:
    tokens: int
    queued_at_ms: float
    done: asyncio.Future[PrefillResult]


@dataclass(slots=True)
class _Seq:
    request_id: str
    context: int
    remaining: int
    done: asyncio.Future[DecodeResult]
    joined_at_ms: float = 0.0
    produced: int = 0
    step_sum_ms: float = 0.0
    on_tokens: Callable[[int], None] | None = None


@dataclass(slots=True)
class _Waiter:
    request_id: str
    tokens: int
    done: asyncio.Future[None]


class EmulatedEngine:
    """One emulated worker (module docstring). Start with :meth:`start`."""

    def __init__(self, spec: EngineSpec, time: EmuTime, tick_wall_s: float = 0.01) -> None:
        self.spec = spec
        self.time = time
        self.tick_ms = tick_wall_s * 1000.0 * time.scale
        self.max_batch_size = spec.max_batch_size
        self.alive = False
        self.accepting = True
        self.ballast_tokens = 0
        self.used_tokens = 0
        self.prefills_done = 0
        self.decodes_done = 0
        self._held: dict[str, int] = {}
        self._prefills: collections.deque[_Prefill] = collections.deque()
        self._admit: collections.deque[_Seq] = collections.deque()
        self._batch: list[_Seq] = []
        self._mem_waiters: collections.deque[_Waiter] = collections.deque()
        self._steps: collections.deque[float] = collections.deque(maxlen=256)
        self._prefill_rate: collections.deque[tuple[int, float]] = collections.deque(maxlen=32)
        self._busy_ms = 0.0
        self._prefill_ms = 0.0
        self._busy_mark = (0.0, 0.0, 0.0)
        self._running_prefill = False
        self._wake = asyncio.Event()
        self.died = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self.alive = True
        self._task = asyncio.create_task(self._loop(), name=f"gpu-{self.worker_id}")

    def kill(self) -> None:
        """Crash: every pending and running operation fails with WorkerLost."""
        self.alive = False
        self.died.set()
        if self._task is not None:
            self._task.cancel()
            self._task = None
        lost = WorkerLost(self.worker_id)
        futures: list[asyncio.Future[object]] = []
        futures += [p.done for p in self._prefills]  # type: ignore[misc]
        futures += [s.done for s in self._admit]  # type: ignore[misc]
        futures += [s.done for s in self._batch]  # type: ignore[misc]
        futures += [w.done for w in self._mem_waiters]  # type: ignore[misc]
        for fut in futures:
            if not fut.done():
                fut.set_exception(lost)
                fut.exception()  # retrieved here: a caller that already left must not warn
        self._prefills.clear()
        self._admit.clear()
        self._batch.clear()
        self._mem_waiters.clear()

    async def stop(self) -> None:
        self.kill()

    def _check(self) -> None:
        if not self.alive:
            raise WorkerLost(self.worker_id)

    # -- memory -----------------------------------------------------------------------------

    @property
    def free_tokens(self) -> int:
        return max(0, self.spec.kv_capacity_tokens - self.used_tokens - self.ballast_tokens)

    def set_ballast(self, tokens: int) -> None:
        """Occupy ``tokens`` of KV memory with nothing (fault injection); 0 frees it."""
        self.ballast_tokens = max(0, min(tokens, self.spec.kv_capacity_tokens))
        self._grant()

    async def allocate(self, request_id: str, tokens: int) -> None:
        """Hold ``tokens`` of KV for ``request_id`` (waits, FIFO, until they fit). A request
        larger than the whole memory is granted when the memory is otherwise empty, so that
        it cannot wait forever (a real engine would preempt or refuse; the scheduler's
        reservation keeps this from happening)."""
        self._check()
        tokens = max(0, tokens)
        if not self._mem_waiters and self._fits(tokens):
            self._take(request_id, tokens)
            return
        waiter = _Waiter(request_id, tokens, asyncio.get_running_loop().create_future())
        self._mem_waiters.append(waiter)
        await waiter.done

    def _fits(self, tokens: int) -> bool:
        return tokens <= self.free_tokens or (self.used_tokens == 0 and self.ballast_tokens == 0)

    def _take(self, request_id: str, tokens: int) -> None:
        self.used_tokens += tokens
        self._held[request_id] = self._held.get(request_id, 0) + tokens

    def release(self, request_id: str) -> None:
        """Free every token ``request_id`` holds (idempotent)."""
        tokens = self._held.pop(request_id, 0)
        self.used_tokens = max(0, self.used_tokens - tokens)
        self._grant()

    def _grant(self) -> None:
        while self._mem_waiters:
            w = self._mem_waiters[0]
            if w.done.done():  # the caller gave up
                self._mem_waiters.popleft()
                continue
            if not self._fits(w.tokens):
                return
            self._mem_waiters.popleft()
            self._take(w.request_id, w.tokens)
            w.done.set_result(None)

    # -- work -------------------------------------------------------------------------------

    async def prefill(self, request_id: str, tokens: int, hold_kv: bool = True) -> PrefillResult:
        """Run a prefill of ``tokens`` on this GPU (queued FIFO). With ``hold_kv`` the prompt's
        KV is allocated first and stays held under ``request_id`` until :meth:`release`."""
        self._check()
        if hold_kv:
            await self.allocate(request_id, tokens)
        loop = asyncio.get_running_loop()
        job = _Prefill(tokens, self.time.now_ms(), loop.create_future())
        self._prefills.append(job)
        self._wake.set()
        return await job.done

    async def decode(
        self,
        request_id: str,
        context_tokens: int,
        new_tokens: int,
        on_tokens: Callable[[int], None] | None = None,
    ) -> DecodeResult:
        """Generate ``new_tokens`` tokens for a sequence whose KV (``context_tokens``) is
        already here (allocated by the caller). Returns when the last one is out;
        ``on_tokens(n)`` is called as each chunk of ``n`` tokens comes out (a stream's
        pace: the engine runs several identical steps as one sleep)."""
        self._check()
        loop = asyncio.get_running_loop()
        now = self.time.now_ms()
        if new_tokens <= 0:
            return DecodeResult(now, now, 0, 0.0)
        seq = _Seq(request_id, context_tokens, new_tokens, loop.create_future())
        seq.on_tokens = on_tokens
        self._admit.append(seq)
        self._wake.set()
        return await seq.done

    def queue_depth(self) -> int:
        """Work waiting for the GPU: queued prefills, sequences waiting to join the batch and
        allocations waiting for memory."""
        return len(self._prefills) + len(self._admit) + len(self._mem_waiters)

    async def _loop(self) -> None:
        while self.alive:
            if self._prefills:
                await self._run_prefill(self._prefills.popleft())
                continue
            self._join()
            if self._batch:
                await self._run_steps()
                continue
            self._wake.clear()
            await self._wake.wait()

    async def _run_prefill(self, job: _Prefill) -> None:
        start = self.time.now_ms()
        ms = self.spec.prefill_ms(job.tokens)
        self._running_prefill = True
        try:
            await self.time.sleep_ms(ms)
        finally:
            self._running_prefill = False
        end = self.time.now_ms()
        self._busy_ms += ms
        self._prefill_ms += ms
        self.prefills_done += 1
        if job.tokens > 0 and ms > 0:
            self._prefill_rate.append((job.tokens, ms))
        if not job.done.done():
            job.done.set_result(PrefillResult(start - job.queued_at_ms, ms, end))

    def _join(self) -> None:
        now = self.time.now_ms()
        while self._admit and len(self._batch) < self.max_batch_size:
            seq = self._admit.popleft()
            seq.joined_at_ms = now
            self._batch.append(seq)

    async def _run_steps(self) -> None:
        batch = self._batch
        ctx = sum(s.context + s.produced for s in batch)
        step = self.spec.step_ms(len(batch), ctx)
        n = max(1, int(self.tick_ms // step)) if step > 0 else 1
        n = min(n, min(s.remaining for s in batch))
        if self._admit and len(batch) < self.max_batch_size:
            n = 1  # someone is waiting to join: take them in at the next step
        await self.time.sleep_ms(step * n)
        self._busy_ms += step * n
        for _ in range(min(n, 8)):
            self._steps.append(step)
        now = self.time.now_ms()
        keep: list[_Seq] = []
        for s in batch:
            s.produced += n
            s.remaining -= n
            s.step_sum_ms += step * n
            if s.on_tokens is not None and not s.done.done():
                s.on_tokens(n)
            if s.remaining <= 0:
                self.decodes_done += 1
                if not s.done.done():
                    s.done.set_result(
                        DecodeResult(s.joined_at_ms, now, s.produced, s.step_sum_ms / s.produced)
                    )
            else:
                keep.append(s)
        self._batch = keep

    # -- load report ------------------------------------------------------------------------

    def load_report(self) -> LoadReport:
        """The engine's figures as a registry load report (emulated units; the client stamps
        the time)."""
        spec = self.spec
        now = self.time.now_ms()
        mark_t, mark_busy, mark_prefill = self._busy_mark
        window = now - mark_t
        util = min(1.0, (self._busy_ms - mark_busy) / window) if window > 0 else 0.0
        prefill_busy = min(1.0, (self._prefill_ms - mark_prefill) / window) if window > 0 else 0.0
        if window > 500.0:
            self._busy_mark = (now, self._busy_ms, self._prefill_ms)
        blocks_total = max(1, spec.kv_capacity_tokens // spec.block_size_tokens)
        used = self.used_tokens + self.ballast_tokens
        free_blocks = max(0, (spec.kv_capacity_tokens - used) // spec.block_size_tokens)
        steps = list(self._steps)
        tps = 0.0
        if self._prefill_rate:
            tokens = sum(t for t, _ in self._prefill_rate)
            ms = sum(m for _, m in self._prefill_rate)
            tps = tokens / ms * 1000.0 if ms > 0 else 0.0
        return LoadReport(
            gpu_util=util,
            memory_util=min(1.0, used / spec.kv_capacity_tokens),
            kv_blocks_free=min(free_blocks, blocks_total),
            kv_blocks_total=blocks_total,
            queue_depth=self.queue_depth(),
            queue_max=spec.queue_max,
            running_prefills=1 if self._running_prefill else 0,
            batch_size=len(self._batch),
            itl_p50_ms=percentile(steps, 50) if steps else 0.0,
            itl_p99_ms=percentile(steps, 99) if steps else 0.0,
            prefill_tokens_per_s=tps,
            prefill_busy=prefill_busy,
        )
