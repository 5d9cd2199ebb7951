"""Fault specs and the client's backoff."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpd_agent.worker_client import ClientTiming
from hpd_fleet.faults import Fault, parse_fault


@pytest.mark.parametrize(
    ("kind", "spec", "want"),
    [
        pytest.param("kill_worker", "auto", Fault("kill_worker", "auto", 0.0, 1.0), id="kill-auto"),
        pytest.param("kill_worker", "w-3", Fault("kill_worker", "w-3", 0.0, 1.0), id="kill-named"),
        pytest.param("slow_link", "a>b", Fault("slow_link", "a>b", 10.0, 1.0), id="link-default"),
        pytest.param("slow_link", "a>b=4", Fault("slow_link", "a>b", 4.0, 1.0), id="link-factor"),
        pytest.param("fill_pool", "", Fault("fill_pool", "auto", 0.97, 1.0), id="fill-auto"),
        pytest.param("stop_redis", "5", Fault("stop_redis", "redis", 5.0, 1.0), id="redis-5s"),
        pytest.param("stop_redis", "auto", Fault("stop_redis", "redis", 3.0, 1.0), id="redis-3s"),
    ],
)
def test_parse_fault(kind: str, spec: str, want: Fault) -> None:
    assert parse_fault(kind, spec, 1.0) == want


@pytest.mark.parametrize(
    ("kind", "at"),
    [pytest.param("melt_gpu", 0.0, id="kind"), pytest.param("kill_worker", -1, id="at")],
)
def test_bad_fault_is_refused(kind: str, at: float) -> None:
    with pytest.raises(ValueError):
        Fault(kind, at_s=at)


@given(attempt=st.integers(0, 100), seed=st.integers(0, 2**32))
def test_backoff_is_jittered_and_capped(attempt: int, seed: int) -> None:
    t = ClientTiming(min_backoff_s=0.05, max_backoff_s=2.0)
    base = min(2.0, 0.05 * 2**attempt)
    assert base / 2 <= t.backoff_s(attempt, random.Random(seed)) <= base
