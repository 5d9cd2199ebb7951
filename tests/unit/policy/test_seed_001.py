"""Seed 001: factor shapes and weights, the decode memory gate, imbalance and rebalancing,
adaptive batch size, including the boundaries."""

from __future__ import annotations

import pytest

from hpd_scheduler.policy import builtin_profile
from hpd_scheduler.policy.balance import (
    BatchChange,
    adapt_batch_size,
    detect_imbalance,
    rebalance_plan,
)
from hpd_scheduler.policy.errors import InvalidInputError
from hpd_scheduler.policy.factors import (
    SEED_DECODE_WEIGHTS,
    SEED_PREFILL_WEIGHTS,
    batch_score,
    itl_score,
    memory_gate_ok,
    memory_score,
    seed_compute_score,
    seed_load_score,
    seed_network_score,
    seed_queue_score,
)


def test_seed_weights_are_the_profile_defaults() -> None:
    assert SEED_PREFILL_WEIGHTS == {
        "compute": 0.30,
        "load": 0.25,
        "queue": 0.20,
        "network": 0.15,
        "model": 0.10,
    }
    assert SEED_DECODE_WEIGHTS == {
        "itl": 0.35,
        "memory": 0.25,
        "batch": 0.20,
        "bandwidth": 0.15,
        "network": 0.05,
    }
    seed = builtin_profile("seed")
    assert seed.prefill.weights() == SEED_PREFILL_WEIGHTS
    assert seed.decode.weights() == SEED_DECODE_WEIGHTS
    default = builtin_profile("default")
    for name, weight in SEED_PREFILL_WEIGHTS.items():
        key = {"model": "cache"}.get(name, name)
        assert default.prefill.weights()[key] == weight
    for name, weight in SEED_DECODE_WEIGHTS.items():
        assert default.decode.weights()[name] == weight


@pytest.mark.parametrize(
    ("available", "kv", "ok"),
    [
        pytest.param(120, 100, True, id="exactly-1.2x-passes"),
        pytest.param(119.99, 100, False, id="just-below-1.2x-excluded"),
        pytest.param(500, 100, True, id="ample"),
    ],
)
def test_decode_memory_gate(available: float, kv: float, ok: bool) -> None:
    assert memory_gate_ok(available, kv) is ok


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        pytest.param(1.0, 0.0, id="below-1.2"),
        pytest.param(1.2, 0.0, id="at-1.2"),
        pytest.param(1.6, 0.25, id="mid-first-segment"),
        pytest.param(2.0, 0.5, id="at-2"),
        pytest.param(4.0, 0.75, id="mid-second-segment"),
        pytest.param(6.0, 1.0, id="saturates-at-6"),
        pytest.param(60.0, 1.0, id="capped"),
    ],
)
def test_memory_score_shape(ratio: float, expected: float) -> None:
    assert memory_score(ratio * 1000, 1000) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("current", "expected"),
    [
        pytest.param(70, 1.0, id="ideal-at-70pct"),
        pytest.param(35, 0.5, id="half-ideal"),
        pytest.param(0, 0.0, id="empty"),
        pytest.param(140, 0.0, id="twice-ideal"),
        pytest.param(100, 1 - 30 / 70, id="full"),
    ],
)
def test_batch_score_shape(current: int, expected: float) -> None:
    assert batch_score(current, 100) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("itl", "expected_raw"),
    [
        pytest.param(0.0, 1.2, id="zero-itl-max-reward"),
        pytest.param(25.0, 1.1, id="half-target"),
        pytest.param(50.0, 1.0, id="at-target"),
        pytest.param(75.0, 0.5, id="1.5x-target"),
        pytest.param(100.0, 0.0, id="2x-target"),
        pytest.param(150.0, 0.0, id="beyond"),
    ],
)
def test_itl_score_is_seed_shape_over_1_2(itl: float, expected_raw: float) -> None:
    assert itl_score(itl, 50.0) == pytest.approx(expected_raw / 1.2)


def test_other_seed_factors() -> None:
    assert seed_load_score(0.5, 0.5) == pytest.approx(0.5)
    assert seed_load_score(1.0, 1.0) == 0.0
    assert seed_queue_score(8, 16) == pytest.approx(0.5)
    assert seed_queue_score(40, 16) == 0.0
    assert seed_network_score(25.0) == pytest.approx(0.75)
    assert seed_network_score(150.0) == 0.0
    # H100 x 8 GPUs with TP: 1.0 x 0.85 x sqrt(8) / sqrt(8)
    assert seed_compute_score("H100", 8, 8) == pytest.approx(0.85)
    assert seed_compute_score("A10", 1, 1) == pytest.approx(0.30 / 8**0.5)
    assert seed_compute_score("unknown-gpu", 1, 8) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        pytest.param([0.6, 0.3], False, id="spread-exactly-0.3"),
        pytest.param([0.61, 0.3], True, id="spread-just-over-0.3"),
        pytest.param([0.9, 0.85], False, id="max-exactly-0.9"),
        pytest.param([0.91, 0.9], True, id="max-just-over-0.9"),
        pytest.param([0.95], False, id="single-worker-never"),
        pytest.param([], False, id="empty"),
        pytest.param([0.5, 0.5, 0.5], False, id="balanced"),
    ],
)
def test_detect_imbalance(loads: list[float], expected: bool) -> None:
    assert detect_imbalance(loads) is expected


def test_rebalance_plan_moves_from_busiest_to_idlest() -> None:
    plan = rebalance_plan({"a": 0.9, "b": 0.5, "c": 0.1}, queued={"a": 20})
    assert plan.imbalanced
    assert plan.mean_load == pytest.approx(0.5)
    assert len(plan.moves) == 1
    move = plan.moves[0]
    assert (move.src, move.dst) == ("a", "c")
    assert move.work == pytest.approx(0.4)
    assert move.fraction == pytest.approx(0.4 / 0.9)
    assert move.requests == 9  # ceil(0.444 x 20)


def test_rebalance_plan_weighs_capacity() -> None:
    # a fast worker at 0.8 holds 4x the work of a slow one at 0.8
    plan = rebalance_plan({"fast": 0.8, "slow": 0.2}, capacities={"fast": 4.0, "slow": 1.0})
    assert plan.mean_load == pytest.approx((0.8 * 4 + 0.2) / 5)
    (move,) = plan.moves
    assert (move.src, move.dst) == ("fast", "slow")
    assert move.work == pytest.approx((plan.mean_load - 0.2) * 1.0)


def test_rebalance_plan_balanced_is_empty() -> None:
    plan = rebalance_plan({"a": 0.5, "b": 0.4})
    assert not plan.imbalanced and plan.moves == ()


def test_rebalance_plan_rejects_zero_capacity() -> None:
    with pytest.raises(InvalidInputError):
        rebalance_plan({"a": 0.9, "b": 0.1}, capacities={"a": 0.0})


@pytest.mark.parametrize(
    ("itl_p99", "queue", "current", "hard", "expected", "change"),
    [
        pytest.param(61.0, 0, 100, 200, 90, BatchChange.DECREASE, id="above-1.2x-shrinks"),
        pytest.param(60.0, 0, 100, 200, 100, BatchChange.KEEP, id="exactly-1.2x-keeps"),
        pytest.param(
            39.0, 11, 100, 200, 110, BatchChange.INCREASE, id="below-0.8x-with-backlog-grows"
        ),
        pytest.param(40.0, 11, 100, 200, 100, BatchChange.KEEP, id="exactly-0.8x-keeps"),
        pytest.param(39.0, 10, 100, 200, 100, BatchChange.KEEP, id="queue-exactly-10-keeps"),
        pytest.param(39.0, 50, 100, 105, 105, BatchChange.INCREASE, id="capped-at-hard-max"),
        pytest.param(39.0, 50, 100, 100, 100, BatchChange.KEEP, id="already-at-hard-max"),
        pytest.param(500.0, 0, 1, 8, 1, BatchChange.DECREASE, id="never-below-one"),
    ],
)
def test_adaptive_batch_size(
    itl_p99: float, queue: int, current: int, hard: int, expected: int, change: BatchChange
) -> None:
    rec = adapt_batch_size(current, hard, itl_p99, 50.0, queue)
    assert rec.max_batch_size == expected
    assert rec.change is change


def test_adaptive_batch_size_bad_target() -> None:
    with pytest.raises(InvalidInputError):
        adapt_batch_size(10, 20, 30.0, 0.0, 5)
