"""Prometheus metrics of the scheduler (served on the shared /metrics endpoint)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from .policy.domain import SCHEDULABLE_HEALTH, WorkerView

DECISIONS = Counter(
    "hpd_scheduler_decisions_total", "Schedule answers by decision and mode.", ["decision", "mode"]
)
REJECTIONS = Counter(
    "hpd_scheduler_rejections_total", "Refused requests by class.", ["reject_class"]
)
RESERVATION_CONFLICTS = Counter(
    "hpd_scheduler_reservation_conflicts_total",
    "Plans whose decode worker was fully reserved by the time the reservation ran (re-planned).",
)
REPLAYS = Counter("hpd_scheduler_replays_total", "Schedule retries answered with the stored plan.")
BROKER_FALLBACKS = Counter(
    "hpd_scheduler_broker_fallbacks_total",
    "Transfer plans turned into recompute because the KV broker refused.",
    ["reason"],
)
FLEET_REBUILD_SECONDS = Histogram(
    "hpd_scheduler_fleet_rebuild_seconds",
    "Time to rebuild the fleet snapshot from the informer's view.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
FLEET_WORKERS = Gauge("hpd_scheduler_fleet_workers", "Workers in the current snapshot.")
VIEW_AGE_SECONDS = Gauge("hpd_scheduler_view_age_seconds", "Age of the fleet view.")
DIRECTIVES_SENT = Counter(
    "hpd_scheduler_directives_sent_total", "Directives sent through the registry.", ["kind"]
)
OUTCOMES = Counter("hpd_scheduler_outcomes_total", "Reported outcomes.", ["success"])
GROUP_COMMIT_BATCH = Histogram(
    "hpd_scheduler_group_commit_batch_size",
    "Schedule reservations written per script call (group commit).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4, 10, 40)
TTFT_ESTIMATE_RATIO = Histogram(
    "hpd_scheduler_ttft_estimate_ratio",
    "Measured TTFT over the plan's estimate, per prefill worker and tier (1 = exact).",
    ["worker", "tier"],
    buckets=_RATIO_BUCKETS,
)
TPOT_ESTIMATE_RATIO = Histogram(
    "hpd_scheduler_tpot_estimate_ratio",
    "Measured TPOT over the plan's estimate, per decode worker and tier (1 = exact).",
    ["worker", "tier"],
    buckets=_RATIO_BUCKETS,
)
LEARNED_PREFILL_FIXED_MS = Gauge(
    "hpd_scheduler_learned_prefill_fixed_ms",
    "A worker's learned fixed cost per prefill request (ms; absent until learned).",
    ["worker"],
)
LEARNED_PREFILL_SCALE = Gauge(
    "hpd_scheduler_learned_prefill_scale",
    "A worker's learned prefill compute time over its declared one (1 = as declared).",
    ["worker"],
)
LEARNED_PREFILL_QUEUE_SHARE = Gauge(
    "hpd_scheduler_learned_prefill_queue_share",
    "The share of a request's fixed prefill cost each request queued ahead adds (1 = one "
    "request at a time; less: the engine batches prefills).",
    ["worker"],
)


LEARNED_DECODE_SCALE = Gauge(
    "hpd_scheduler_learned_decode_scale",
    "A worker's learned decode step read time over its declared one (1 = as declared).",
    ["worker"],
)
LEARNED_DECODE_SEQ_MS = Gauge(
    "hpd_scheduler_learned_decode_seq_ms",
    "A worker's learned decode step cost per sequence in the batch (ms).",
    ["worker"],
)


# Per pool, from each fleet snapshot (labels: model, pool): what an operator alerts on
# (a pool with no worker to take work, decode KV nearly full, a prefill queue growing).
POOL_WORKERS = Gauge(
    "hpd_scheduler_pool_workers",
    "Workers of a pool in the scheduler's snapshot, by health (healthy, suspect, unhealthy, "
    "draining, cordoned, expired).",
    ["model", "pool", "health"],
)
POOL_SCHEDULABLE = Gauge(
    "hpd_scheduler_pool_schedulable_workers",
    "Workers of a pool that take new work (healthy or suspect).",
    ["model", "pool"],
)
POOL_KV_USED_RATIO = Gauge(
    "hpd_scheduler_pool_kv_used_ratio",
    "KV memory of a pool's schedulable workers in use or reserved, over their total (0..1).",
    ["model", "pool"],
)
POOL_QUEUE_DEPTH = Gauge(
    "hpd_scheduler_pool_queue_depth",
    "Requests queued on a pool's workers, as their last load reports say.",
    ["model", "pool"],
)


def export_pools(views: Iterable[WorkerView]) -> None:
    """The per-pool gauges from one snapshot's worker views: every series of a pool that
    left (or a health no worker has any more) is dropped, so a dashboard shows no ghosts.
    ``kv_used_ratio``: ``1 - sum(available - reserved) / sum(total)`` over the schedulable
    workers (0 when they declare no KV)."""
    counts: dict[tuple[str, str, str], int] = {}
    pools: dict[tuple[str, str], list[float]] = {}
    for v in views:
        key = (v.model_id, v.pool_id)
        health = str(v.health.value).lower()
        counts[(*key, health)] = counts.get((*key, health), 0) + 1
        agg = pools.setdefault(key, [0.0, 0.0, 0.0, 0.0])  # schedulable, free, total, queue
        if v.health in SCHEDULABLE_HEALTH:
            agg[0] += 1
            agg[1] += max(0, v.kv_available_bytes - v.pending_kv_bytes)
            agg[2] += v.kv_memory_total_bytes
        agg[3] += v.load.queue_depth if v.load is not None else 0
    for gauge in (POOL_WORKERS, POOL_SCHEDULABLE, POOL_KV_USED_RATIO, POOL_QUEUE_DEPTH):
        gauge.clear()
    for (model, pool, health), n in counts.items():
        POOL_WORKERS.labels(model=model, pool=pool, health=health).set(n)
    for (model, pool), (sched, free, total, queue) in pools.items():
        POOL_SCHEDULABLE.labels(model=model, pool=pool).set(sched)
        used = 1.0 - free / total if total > 0 else 0.0
        POOL_KV_USED_RATIO.labels(model=model, pool=pool).set(min(1.0, max(0.0, used)))
        POOL_QUEUE_DEPTH.labels(model=model, pool=pool).set(queue)


def export_learned(fits: Mapping[str, Any]) -> None:
    """The learner's fits (``learning.Fit``: the prefill under ``p:<worker>``, the decode
    step under ``d:<worker>``) as gauges."""
    for key, f in fits.items():
        if key.startswith("p:"):
            LEARNED_PREFILL_FIXED_MS.labels(worker=key[2:]).set(f.fixed_ms)
            LEARNED_PREFILL_SCALE.labels(worker=key[2:]).set(f.scale)
            LEARNED_PREFILL_QUEUE_SHARE.labels(worker=key[2:]).set(f.queue_share)
        elif key.startswith("d:"):
            LEARNED_DECODE_SCALE.labels(worker=key[2:]).set(f.scale)
            LEARNED_DECODE_SEQ_MS.labels(worker=key[2:]).set(f.fixed_ms)
