"""The built-in plugin types. Each docstring states its formula; scores are in [0, 1]. The
filters have a room of their own (``filters.py``); they are registered here with the rest.

Seed-faithful scorers carry a ``seed-`` prefix and reproduce seed 001's shapes (with the
normalisations ``factors.py`` documents); the others are our capacity-aware replacements:
they measure load in time on the worker's own hardware and compare it with the request's
tier budgets.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from .admission import HardTtftFilter, TpotAdmissionFilter, TtftAdmissionFilter
from .capacity import confidence
from .domain import Role
from .errors import InvalidInputError
from .factors import (
    batch_score,
    itl_score,
    memory_score,
    seed_compute_score,
    seed_load_score,
    seed_network_score,
    seed_queue_score,
)
from .filters import (
    DecodeMemoryFilter,
    ExecutionGateFilter,
    LabelSelectorFilter,
    ProbeFilter,
    QueueCapacityFilter,
    StalenessFilter,
)
from .framework import (
    Candidate,
    Picker,
    PluginRegistry,
    RequestContext,
    Scorer,
    T,
)

__all__ = [
    "REGISTRY",
    "DecodeMemoryFilter",
    "ExecutionGateFilter",
    "LabelSelectorFilter",
    "ProbeFilter",
    "QueueCapacityFilter",
    "StalenessFilter",
]

REGISTRY = PluginRegistry()
"""The default registry holding every built-in plugin type."""

_PREFILL = frozenset({Role.PREFILL})
_DECODE = frozenset({Role.DECODE})


# -- scorers --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SeedComputeParams:
    """``max_gpus``: the GPU count whose sqrt normalises the seed's raw compute value."""

    max_gpus: int = 8

    def __post_init__(self) -> None:
        if self.max_gpus < 1:
            raise InvalidInputError("max_gpus", f"must be >= 1, got {self.max_gpus}")


class SeedComputeScorer(Scorer):
    """Seed compute factor: GPU-name table x (0.85 if TP > 1) x sqrt(GPUs) / sqrt(max_gpus)."""

    type_name: ClassVar[str] = "seed-compute-scorer"
    Params = SeedComputeParams

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        v = c.ws.view
        return seed_compute_score(v.gpu_type, v.tp_size, v.gpu_count, self.params.max_gpus)


class CapacityComputeScorer(Scorer):
    """``prefill tokens/s of this worker (perf model x observed) / the fastest eligible
    prefill worker's``, capped at 1: the model-specific speed, not a GPU-name table."""

    type_name: ClassVar[str] = "capacity-compute-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        index = ctx.prefill_index
        best = index.max_prefill_tps if index is not None and index.max_prefill_tps > 0 else 0.0
        tps = c.ws.cap.prefill_tps / c.ws.m_p
        if best <= 0:
            return 1.0
        return min(1.0, tps / best)


class SeedLoadScorer(Scorer):
    """Seed load factor ``1 - (0.6 gpu_util + 0.4 mem_util)``; 0.5 without a report."""

    type_name: ClassVar[str] = "seed-load-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        load = c.ws.view.load
        if load is None:
            return 0.5
        return seed_load_score(load.gpu_util, load.memory_util)


class WorkLoadScorer(Scorer):
    """Capacity-normalised load: the request's TTFT on this worker, ``wait + prefill`` in ms
    of the worker's own throughput, against the tier's TTFT target:
    ``ttft / (ttft + wait_ms + run_ms)``. An H100 with 8 queued beats an L4 with 6."""

    type_name: ClassVar[str] = "work-load-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        budget = ctx.tier.ttft_ms
        return budget / (budget + c.wait_ms + c.run_ms)


class SeedQueueScorer(Scorer):
    """Seed queue factor ``1 - min(queue / max_queue, 1)`` (reservations count as queued)."""

    type_name: ClassVar[str] = "seed-queue-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        return seed_queue_score(c.ws.queue_depth(), c.ws.queue_max)


class QueueWaitScorer(Scorer):
    """Queue wait in ms of this worker's own work against the tier's queue budget:
    ``budget / (budget + wait_ms)``."""

    type_name: ClassVar[str] = "queue-wait-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        budget = ctx.tier.queue_budget_ms
        return budget / (budget + c.wait_ms)


class SeedNetworkScorer(Scorer):
    """Seed network factor ``max(0, 1 - transfer_ms / 100)``; 0.5 when the partner is not
    known yet (the seed's default)."""

    type_name: ClassVar[str] = "seed-network-scorer"
    pairwise: ClassVar[bool] = True

    def score_pair(self, c: Candidate, transfer_ms: float | None, ctx: RequestContext) -> float:
        if transfer_ms is None:
            return 0.5
        return seed_network_score(transfer_ms)


@dataclass(frozen=True, slots=True)
class LinkParams:
    """``budget_fraction``: share of the tier's TTFT target the hand-off may use."""

    budget_fraction: float = 0.25

    def __post_init__(self) -> None:
        if not 0 < self.budget_fraction <= 1:
            raise InvalidInputError("budget_fraction", "must be in (0, 1]")


class LinkTransferScorer(Scorer):
    """The hand-off over the pair's real link (bytes x 8 / Gb/s + latency + conversion)
    against a share of the tier's TTFT: ``B / (B + transfer_ms)``, ``B = ttft x fraction``;
    1 when nothing crosses a link, 0.5 when the partner is unknown."""

    type_name: ClassVar[str] = "link-transfer-scorer"
    Params = LinkParams
    pairwise: ClassVar[bool] = True

    def score_pair(self, c: Candidate, transfer_ms: float | None, ctx: RequestContext) -> float:
        if transfer_ms is None:
            return 0.5
        budget = ctx.tier.ttft_ms * self.params.budget_fraction
        return budget / (budget + transfer_ms) if transfer_ms > 0 else 1.0


class SeedModelScorer(Scorer):
    """Seed model factor: 1 when the model (and pinned revision) is loaded, 0.5 when only a
    different revision is (it could load it). The index only holds workers with the model."""

    type_name: ClassVar[str] = "seed-model-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        rev = ctx.request.model_revision
        return 1.0 if not rev or c.ws.view.model_revision == rev else 0.5


class PrefixCacheScorer(Scorer):
    """Prefix cache factor. With the prompt's block chain (``Request.prefix_blocks``): the
    share of the prompt this worker's engine holds, ``cached_tokens / prompt_tokens`` (cache
    affinity; the load and queue scorers and the TTFT estimate, which already counts only
    uncached tokens, weigh it against the wait a popular worker builds up, so a hot prefix
    spreads once its holder's queue costs more than the tokens it saves). Without a chain,
    the seed's hint rule: 1 when the worker or its pool is named in the prefix hints, 0.5
    when hints name others, 1 for everyone without hints."""

    type_name: ClassVar[str] = "prefix-cache-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        req = ctx.request
        if req.prefix_blocks:
            return c.cached_tokens / req.prompt_tokens if req.prompt_tokens > 0 else 0.0
        hints = ctx.request.prefix_hints
        if not hints:
            return 1.0
        return 1.0 if c.ws.worker_id in hints or c.ws.pool_id in hints else 0.5


@dataclass(frozen=True, slots=True)
class SeedItlParams:
    """``target_ms``: the seed's one global ITL target."""

    target_ms: float = 50.0

    def __post_init__(self) -> None:
        if not self.target_ms > 0:
            raise InvalidInputError("target_ms", "must be > 0")


class SeedItlScorer(Scorer):
    """Seed ITL factor on the current ITL (reported p50, else the perf model's step) with
    one global target (50 ms), divided by 1.2 (``factors.itl_score``)."""

    type_name: ClassVar[str] = "seed-itl-scorer"
    Params = SeedItlParams
    roles: ClassVar[frozenset[Role]] = _DECODE

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        itl = c.ws.itl_p50_ms if c.ws.itl_p50_ms > 0 else c.ws.step_ms()
        return itl_score(itl, self.params.target_ms)


class TierItlScorer(Scorer):
    """ITL factor with the seed's shape but per tier and predictive: the worker's step time
    with this request (and its queue) admitted, from its own HBM bandwidth and KV, against the
    tier's TPOT target."""

    type_name: ClassVar[str] = "tier-itl-scorer"
    roles: ClassVar[frozenset[Role]] = _DECODE

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        return itl_score(c.step_ms, ctx.tier.tpot_ms)


class MemoryScorer(Scorer):
    """Seed memory factor on ``(available KV - reservations) / request KV``: 0 below 1.2,
    linear to 0.5 at 2, to 1 at 6 (``factors.memory_score``)."""

    type_name: ClassVar[str] = "memory-scorer"
    roles: ClassVar[frozenset[Role]] = _DECODE

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        return memory_score(c.ws.available_kv(), c.kv_need)


class BatchScorer(Scorer):
    """Seed batch factor: ideal batch at 70 % of max, ``1 - |batch - ideal| / ideal``
    (reservations count into the batch)."""

    type_name: ClassVar[str] = "batch-scorer"
    roles: ClassVar[frozenset[Role]] = _DECODE

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        ws = c.ws
        return batch_score(ws.batch + ws.live_reqs, ws.view.max_batch_size)


class BandwidthScorer(Scorer):
    """Memory bandwidth factor: the worker's total HBM GB/s over the best eligible decode
    worker's, scaled by ``1 - 0.5 gpu_util`` (bandwidth already in use is not on offer)."""

    type_name: ClassVar[str] = "bandwidth-scorer"
    roles: ClassVar[frozenset[Role]] = _DECODE

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        index = ctx.decode_index
        best = index.max_hbm_gbps if index is not None else 0.0
        if best <= 0:
            return 1.0
        util = c.ws.gpu_util
        return min(1.0, c.ws.cap.hbm_gbps_total / best) * (1.0 - 0.5 * util)


class StalenessScorer(Scorer):
    """Confidence in the worker's load report: 1 while fresh, falling linearly to 0 between
    the fleet's ``fresh_s`` and ``stale_s`` (``capacity.confidence``), evaluated at the
    decision's ``now``."""

    type_name: ClassVar[str] = "staleness-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        return confidence(c.ws.reported_at_s, ctx.now_s, ctx.fleet.staleness)


class BlindLoadScorer(Scorer):
    """Capacity-blind least-loaded: ``1 / (1 + queue + 4 x KV used share)``, the same for an
    L4 and an H100 (the baseline plain least-loaded routers implement)."""

    type_name: ClassVar[str] = "blind-load-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        ws = c.ws
        return 1.0 / (1.0 + ws.queue_depth() + 4.0 * ws.kv_used_fraction())


class UniformScorer(Scorer):
    """Always 1: no preference (round-robin and random baselines)."""

    type_name: ClassVar[str] = "uniform-scorer"

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        return 1.0


# -- pickers --------------------------------------------------------------------------------


class MaxScorePicker(Picker[T]):
    """Highest score first; ties by id (deterministic)."""

    type_name: ClassVar[str] = "max-score-picker"

    def rank(self, items: Sequence[T], rng: random.Random) -> list[T]:
        return sorted(items, key=lambda it: (-it.score, it.tiebreak))


class RandomPicker(Picker[T]):
    """Uniformly random order from the injected RNG (the random baseline)."""

    type_name: ClassVar[str] = "random-picker"

    def rank(self, items: Sequence[T], rng: random.Random) -> list[T]:
        out = list(items)
        rng.shuffle(out)
        return out


class RoundRobinPicker(Picker[T]):
    """Keeps the preselection order (a rotating window): the round-robin baseline."""

    type_name: ClassVar[str] = "round-robin-picker"

    def rank(self, items: Sequence[T], rng: random.Random) -> list[T]:
        return list(items)


# Registered by call, not by decorator: a decorated class cannot be compiled (hpd_common.native).
for _plugin in (
    ExecutionGateFilter, DecodeMemoryFilter, QueueCapacityFilter, StalenessFilter,
    LabelSelectorFilter, ProbeFilter, SeedComputeScorer, CapacityComputeScorer, SeedLoadScorer,
    WorkLoadScorer, SeedQueueScorer, QueueWaitScorer, SeedNetworkScorer, LinkTransferScorer,
    SeedModelScorer, PrefixCacheScorer, SeedItlScorer, TierItlScorer, MemoryScorer, BatchScorer,
    BandwidthScorer, StalenessScorer, BlindLoadScorer, UniformScorer, MaxScorePicker,
    RandomPicker, RoundRobinPicker, HardTtftFilter, TtftAdmissionFilter, TpotAdmissionFilter,
):  # fmt: skip
    REGISTRY.register(_plugin)
