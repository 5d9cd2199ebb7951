"""The scheduler's per-pool gauges (what the alert rules watch), from a snapshot's views."""

from __future__ import annotations

from prometheus_client import REGISTRY

from hpd_scheduler import metrics
from hpd_scheduler.policy.domain import Health
from tests.unit.policy.builders import MODEL, worker


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_pool_gauges_count_health_kv_and_queues() -> None:
    metrics.export_pools(
        [
            worker("a0", pool="a", kv_total_gib=40, kv_free_gib=10, queue=3),
            worker("a1", pool="a", kv_free_gib=30, queue=1, health=Health.SUSPECT),
            worker("a2", pool="a", kv_total_gib=40, kv_free_gib=40, health=Health.DRAINING),
            worker("b0", pool="b", health=Health.UNHEALTHY, queue=5),
        ]
    )
    a, b = {"model": MODEL, "pool": "a"}, {"model": MODEL, "pool": "b"}
    assert value("hpd_scheduler_pool_workers", **a, health="healthy") == 1
    assert value("hpd_scheduler_pool_workers", **a, health="suspect") == 1
    assert value("hpd_scheduler_pool_workers", **a, health="draining") == 1
    assert value("hpd_scheduler_pool_schedulable_workers", **a) == 2
    assert value("hpd_scheduler_pool_schedulable_workers", **b) == 0  # the alert's case
    # the schedulable ones: 40 of 80 GiB free; the draining worker's memory does not count
    assert value("hpd_scheduler_pool_kv_used_ratio", **a) == 0.5
    assert value("hpd_scheduler_pool_kv_used_ratio", **b) == 0.0
    assert value("hpd_scheduler_pool_queue_depth", **a) == 4
    assert value("hpd_scheduler_pool_queue_depth", **b) == 5


def test_a_pool_that_left_leaves_no_series() -> None:
    metrics.export_pools([worker("c0", pool="gone"), worker("d0", pool="stays")])
    metrics.export_pools([worker("d0", pool="stays", health=Health.CORDONED)])
    gone = {"model": MODEL, "pool": "gone"}
    stays = {"model": MODEL, "pool": "stays"}
    assert value("hpd_scheduler_pool_schedulable_workers", **gone) is None
    assert value("hpd_scheduler_pool_workers", **stays, health="healthy") is None
    assert value("hpd_scheduler_pool_workers", **stays, health="cordoned") == 1
    assert value("hpd_scheduler_pool_schedulable_workers", **stays) == 0
