"""Prometheus metrics of the scheduler (served on the shared /metrics endpoint)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
