"""The simulated cluster's moving parts (``hpd_sim.engine`` runs them): a shared link
(:class:`Pipe`, processor sharing) and one engine's state (:class:`SimWorker`: its queues,
batch, KV memory, step times and utilisation)."""

from __future__ import annotations

from collections import deque

from hpd_common.gpus import GpuProfile
from hpd_scheduler.policy import WorkerView

__all__ = ["ITL_WINDOW", "Pipe", "SimWorker"]

ITL_WINDOW = 32
"""Decode steps a worker's reported ITL percentiles are taken over."""


class Pipe:
    """A shared link: concurrent transfers split ``gbps`` equally (processor sharing)."""

    __slots__ = ("active", "bits_per_s", "last_s", "version")

    def __init__(self, gbps: float) -> None:
        self.bits_per_s = gbps * 1e9
        self.active: dict[int, float] = {}
        self.last_s = 0.0
        self.version = 0

    def advance(self, now: float) -> None:
        n = len(self.active)
        if n:
            done = (now - self.last_s) * self.bits_per_s / n
            if done > 0:
                act = self.active
                for k in act:
                    act[k] -= done
        self.last_s = now

    def next_finish(self, now: float) -> float:
        n = len(self.active)
        return now + max(0.0, min(self.active.values())) * n / self.bits_per_s


class SimWorker:
    """One simulated engine (see the module docstring)."""

    __slots__ = (
        "active",
        "admit_q",
        "admitted",
        "batch",
        "bpt",
        "busy",
        "busy_since",
        "busy_total",
        "ctx",
        "d_scale",
        "d_seq_ms",
        "dtype",
        "finish_heap",
        "gpu",
        "idx",
        "in_prefill",
        "iter_batch",
        "iter_kind",
        "iter_payload",
        "itl",
        "joiners",
        "kv_cap",
        "kv_used",
        "max_batch",
        "p_budget",
        "p_fixed_ms",
        "p_scale",
        "p_share",
        "pduty",
        "pduty_t",
        "pending_kv",
        "pending_reqs",
        "planned_n",
        "planned_tokens",
        "prefill_q",
        "step_count",
        "step_ends",
        "step_start",
        "tp",
        "util",
        "util_t",
        "view",
    )

    def __init__(
        self,
        idx: int,
        view: WorkerView,
        gpu: GpuProfile,
        actual: tuple[float, float, float, float, float, int] = (1.0, 0.0, 1.0, 0.0, 1.0, 0),
    ) -> None:
        self.idx = idx
        self.view = view
        self.gpu = gpu
        # how the engine really runs against its declaration (a cluster pool's ``actual``):
        # prefill compute x p_scale + p_fixed_ms (each further prompt of a batched prefill
        # iteration p_share of it, the iteration at most p_budget prompt tokens; 0: one
        # prompt an iteration), decode step x d_scale + d_seq_ms per sequence
        self.p_scale, self.p_fixed_ms, self.d_scale, self.d_seq_ms, self.p_share = actual[:5]
        self.p_budget = actual[5]
        self.dtype = view.kv_format.dtype
        self.active = False
        self.tp = view.tp_size
        self.bpt = view.kv_format.bytes_per_token()
        self.kv_cap = view.kv_memory_total_bytes // self.bpt if self.bpt else 0
        self.kv_used = 0
        self.max_batch = view.max_batch_size
        self.admit_q: deque[int] = deque()
        self.prefill_q: deque[int] = deque()
        self.joiners: list[int] = []
        self.admitted = 0
        self.batch = 0
        self.ctx = 0
        self.finish_heap: list[tuple[int, int]] = []
        self.step_count = 0
        self.step_ends: list[float] = []
        self.step_start = 0.0
        self.busy = False
        self.iter_kind = 0
        self.iter_payload = -1
        self.iter_batch: list[int] = []
        self.itl: deque[float] = deque(maxlen=ITL_WINDOW)
        self.pending_kv = 0
        self.pending_reqs = 0
        # prefills planned here and not done, and their prompt tokens (what the scheduler
        # service counts of its own plans: reservations until the prefill is due)
        self.planned_n = 0
        self.planned_tokens = 0
        self.busy_since = 0.0
        self.busy_total = 0.0
        self.util = 0.0
        self.util_t = 0.0
        self.in_prefill = False
        self.pduty = 0.0
        self.pduty_t = 0.0
