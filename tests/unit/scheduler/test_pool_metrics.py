"""The scheduler's per-pool gauges (what the alert rules watch), from a snapshot's views:
figured at scrape time, so a rebuild (up to every 20 ms) only hands its views over."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY, Gauge, generate_latest

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


def test_a_pool_that_left_is_not_in_the_scrape() -> None:
    metrics.export_pools([worker("g0", pool="gone"), worker("s0", pool="stays")])
    before = generate_latest().decode()
    metrics.export_pools([worker("s0", pool="stays")])
    after = generate_latest().decode()
    assert 'pool="gone"' in before and 'pool="stays"' in before
    assert 'pool="gone"' not in after
    stays = f'hpd_scheduler_pool_workers{{health="healthy",model="{MODEL}",pool="stays"}} 1.0'
    assert stays in after


def _counted(calls: dict[str, int], name: str, real: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        return real(*args, **kwargs)

    return call


def test_an_unchanged_rebuild_neither_clears_nor_relabels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fifty rebuilds of one snapshot: no gauge cleared, relabelled or removed (a scrape
    between a clear and the relabelling found the pools gone, too)."""
    calls: dict[str, int] = {}
    for name in ("clear", "labels", "remove"):
        monkeypatch.setattr(Gauge, name, _counted(calls, name, getattr(Gauge, name)))
    views = [worker("u0", pool="same", queue=2), worker("u1", pool="same", queue=1)]
    for _ in range(50):
        metrics.export_pools(views)
    assert calls == {}
    assert value("hpd_scheduler_pool_queue_depth", model=MODEL, pool="same") == 3


def test_the_pools_are_summed_at_scrape_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild only hands its views over; a scrape sums once, from the last ones."""
    calls: dict[str, int] = {}
    monkeypatch.setattr(metrics, "pool_figures", _counted(calls, "sum", metrics.pool_figures))
    for queue in range(50):
        metrics.export_pools([worker("v0", pool="last", queue=queue)])
    assert calls == {}
    assert value("hpd_scheduler_pool_queue_depth", model=MODEL, pool="last") == 49
    assert calls == {"sum": 1}
