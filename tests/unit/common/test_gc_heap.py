"""A service's start-up heap is frozen once it serves (hpd_common.server), and every garbage
collection of a process that exports metrics is timed (hpd_common.metrics)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from hpd_common import metrics
from hpd_common.server import FREEZE_ENV, freeze_startup_heap


class _Node:
    me: object = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test session's heap is not a service's: leave it collectable


def test_the_start_up_heap_is_frozen_after_one_collection(unfrozen: None) -> None:
    kept: list[object] = [object()]  # start-up state the service keeps
    cycle = _Node()
    cycle.me = cycle  # garbage only a collection frees
    gone = weakref.ref(cycle)
    del cycle
    was_enabled = gc.isenabled()
    gc.disable()  # so that only freeze_startup_heap's own collection can free the cycle
    try:
        frozen = freeze_startup_heap()
    finally:
        if was_enabled:
            gc.enable()
    # frozen objects still die when their last reference goes (another thread may drop
    # one meanwhile), so the count can only have fallen since
    assert frozen > 0 and 0 < gc.get_freeze_count() <= frozen
    # what was kept is in the permanent generation, out of every collection's walk
    assert not any(o is kept for o in gc.get_objects())
    # what was garbage was collected first, not frozen (a frozen cycle would still be
    # reachable from the permanent generation and its weak reference alive)
    assert gone() is None


def test_hpd_gc_freeze_0_leaves_the_heap_alone(
    unfrozen: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FREEZE_ENV, "0")
    assert freeze_startup_heap() == 0
    assert gc.get_freeze_count() == 0


def test_collections_are_timed_by_generation() -> None:
    def total(generation: str) -> float:
        return float(metrics.GC_PAUSE_SECONDS.labels(generation)._sum.get())

    installed = metrics._on_gc in gc.callbacks
    try:
        metrics.watch_gc()
        metrics.watch_gc()  # once only
        assert gc.callbacks.count(metrics._on_gc) == 1
        before = total("2")
        gc.collect()
        assert total("2") > before
    finally:
        if not installed:
            gc.callbacks.remove(metrics._on_gc)
