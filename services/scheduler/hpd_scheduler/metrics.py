"""Prometheus metrics of the scheduler (served on the shared /metrics endpoint)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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


class PoolGauges(Collector):
    """The per-pool gauges (labels: model, pool), what an operator alerts on (a pool with
    no worker to take work, decode KV nearly full, a prefill queue growing), figured at
    scrape time from the worker views of the latest snapshot (:meth:`export`).

    A snapshot is rebuilt up to every 20 ms and scraped every few seconds: a rebuild only
    hands its views over (no label lookups, no clearing, no sums), and a scrape reports
    the pools and healths of that snapshot alone, so a pool that left (or a health no
    worker has any more) has no series and a dashboard shows no ghosts. A scrape (the
    metrics server's thread) reads the views once, as one tuple of frozen values."""

    def __init__(self) -> None:
        self._views: tuple[WorkerView, ...] = ()

    def export(self, views: Iterable[WorkerView]) -> None:
        self._views = tuple(views)

    def describe(self) -> Iterator[Metric]:
        return iter(_pool_families())

    def collect(self) -> Iterator[Metric]:
        families = _pool_families()
        workers, schedulable, kv_used, queue = families
        counts, pools = pool_figures(self._views)
        for (model, pool, health), n in counts.items():
            workers.add_metric([model, pool, health], n)
        for (model, pool), (sched, free, total, depth) in pools.items():
            schedulable.add_metric([model, pool], sched)
            used = 1.0 - free / total if total > 0 else 0.0
            kv_used.add_metric([model, pool], min(1.0, max(0.0, used)))
            queue.add_metric([model, pool], depth)
        return iter(families)


def _pool_families() -> tuple[
    GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily
]:
    return (
        GaugeMetricFamily(
            "hpd_scheduler_pool_workers",
            "Workers of a pool in the scheduler's snapshot, by health (healthy, suspect, "
            "unhealthy, draining, cordoned, expired).",
            labels=["model", "pool", "health"],
        ),
        GaugeMetricFamily(
            "hpd_scheduler_pool_schedulable_workers",
            "Workers of a pool that take new work (healthy or suspect).",
            labels=["model", "pool"],
        ),
        GaugeMetricFamily(
            "hpd_scheduler_pool_kv_used_ratio",
            "KV memory of a pool's schedulable workers in use or reserved, over their total "
            "(0..1).",
            labels=["model", "pool"],
        ),
        GaugeMetricFamily(
            "hpd_scheduler_pool_queue_depth",
            "Requests queued on a pool's workers, as their last load reports say.",
            labels=["model", "pool"],
        ),
    )


def pool_figures(
    views: Iterable[WorkerView],
) -> tuple[dict[tuple[str, str, str], int], dict[tuple[str, str], tuple[int, int, int, int]]]:
    """Per (model, pool, health) the workers; per (model, pool) the schedulable workers,
    their free and total KV bytes (``free = max(0, available - reserved)``; the gauge's
    ``kv_used_ratio = 1 - sum(free) / sum(total)``, 0 when they declare no KV) and the
    queue depth of all its workers' last reports."""
    counts: dict[tuple[str, str, str], int] = {}
    pools: dict[tuple[str, str], list[int]] = {}
    for v in views:
        key = (v.model_id, v.pool_id)
        health = str(v.health.value).lower()
        counts[(*key, health)] = counts.get((*key, health), 0) + 1
        agg = pools.setdefault(key, [0, 0, 0, 0])  # schedulable, free, total, queue
        if v.health in SCHEDULABLE_HEALTH:
            agg[0] += 1
            agg[1] += max(0, v.kv_available_bytes - v.pending_kv_bytes)
            agg[2] += v.kv_memory_total_bytes
        agg[3] += v.load.queue_depth if v.load is not None else 0
    return counts, {key: (agg[0], agg[1], agg[2], agg[3]) for key, agg in pools.items()}


POOL_GAUGES = PoolGauges()
REGISTRY.register(POOL_GAUGES)


def export_pools(views: Iterable[WorkerView]) -> None:
    """The per-pool gauges follow this snapshot's views from the next scrape on
    (:class:`PoolGauges`)."""
    POOL_GAUGES.export(views)


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
