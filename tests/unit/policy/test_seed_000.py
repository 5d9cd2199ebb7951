"""Seed 000's test cases, every assertion, same inputs and outputs, through the dict adapters
(which run on the typed core)."""

from __future__ import annotations

from typing import Any

import pytest

from hpd_scheduler.policy.errors import InvalidInputError

from .seed000 import (
    build_route_record,
    choose_handoff_mode,
    classify_resource_need,
    evaluate_pool_capability,
    plan_route_with_fallback,
    select_serving_action,
)

REQUEST: dict[str, Any] = {
    "stage": "decode",
    "model_revision": "rev-a",
    "kv_dtype": "float16",
    "kv_layout": "paged-v1",
    "required_memory_gb": 8,
}
PRIMARY_POOL: dict[str, Any] = {
    "pool_id": "decode-a",
    "supported_stages": ["decode"],
    "model_revision": "rev-a",
    "kv_dtype": "float16",
    "kv_layout": "paged-v1",
    "available_memory_gb": 16,
    "healthy": True,
}


def test_resource_need_classification() -> None:
    assert (
        classify_resource_need({"prompt_tokens": 3000, "decode_tokens": 64}, 2048, 256) == "prefill"
    )
    assert (
        classify_resource_need({"prompt_tokens": 128, "decode_tokens": 512}, 2048, 256) == "decode"
    )
    assert (
        classify_resource_need({"prompt_tokens": 800, "decode_tokens": 128}, 2048, 256) == "shared"
    )


@pytest.mark.parametrize(
    ("prompt", "decode", "expected"),
    [
        pytest.param(2048, 64, "shared", id="prompt-exactly-at-threshold-is-not-long"),
        pytest.param(2049, 256, "prefill", id="prompt-just-over-decode-at-threshold"),
        pytest.param(128, 256, "shared", id="decode-exactly-at-threshold-is-not-long"),
        pytest.param(2048, 257, "decode", id="decode-just-over-prompt-at-threshold"),
        pytest.param(3000, 512, "shared", id="both-long-is-shared"),
    ],
)
def test_classification_boundaries(prompt: int, decode: int, expected: str) -> None:
    assert (
        classify_resource_need({"prompt_tokens": prompt, "decode_tokens": decode}, 2048, 256)
        == expected
    )


def test_handoff_mode_selection() -> None:
    fast_link = choose_handoff_mode(link_gbps=200, cache_transfer_mb=100, recompute_ms=12)
    assert fast_link == {"mode": "transfer", "transfer_ms": 4.0, "recompute_ms": 12}
    slow_link = choose_handoff_mode(link_gbps=25, cache_transfer_mb=100, recompute_ms=12)
    assert slow_link["mode"] == "recompute"


def test_handoff_tie_transfers() -> None:
    assert (
        choose_handoff_mode(link_gbps=200, cache_transfer_mb=100, recompute_ms=4)["mode"]
        == "transfer"
    )


@pytest.mark.parametrize(
    ("gbps", "mb", "recompute", "field"),
    [
        pytest.param(0, 100, 12, "link_gbps", id="zero-link"),
        pytest.param(-1, 100, 12, "link_gbps", id="negative-link"),
        pytest.param(200, -1, 12, "cache_transfer_mb", id="negative-size"),
        pytest.param(200, 100, -1, "recompute_ms", id="negative-recompute"),
    ],
)
def test_handoff_bad_input_raises_typed_error(
    gbps: float, mb: float, recompute: float, field: str
) -> None:
    with pytest.raises(InvalidInputError) as info:
        choose_handoff_mode(link_gbps=gbps, cache_transfer_mb=mb, recompute_ms=recompute)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_pool_capability_matrix() -> None:
    compatible = evaluate_pool_capability(REQUEST, PRIMARY_POOL)
    assert compatible["can_execute"] is True and compatible["can_accept_kv"] is True

    layout_mismatch = evaluate_pool_capability(REQUEST, {**PRIMARY_POOL, "kv_layout": "contiguous"})
    assert layout_mismatch["can_execute"] is True
    assert layout_mismatch["can_accept_kv"] is False
    assert "kv_layout_mismatch" in layout_mismatch["reasons"]  # type: ignore[operator]

    unhealthy = evaluate_pool_capability(REQUEST, {**PRIMARY_POOL, "healthy": False})
    assert unhealthy["can_execute"] is False


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        pytest.param({"supported_stages": ["prefill"]}, "unsupported_stage", id="stage"),
        pytest.param({"model_revision": "rev-b"}, "model_revision_mismatch", id="revision"),
        pytest.param({"available_memory_gb": 7}, "insufficient_memory", id="memory"),
        pytest.param({"healthy": False}, "unhealthy", id="health"),
    ],
)
def test_execution_gate_reasons(change: dict[str, Any], reason: str) -> None:
    cap = evaluate_pool_capability(REQUEST, {**PRIMARY_POOL, **change})
    assert cap["can_execute"] is False
    assert cap["can_accept_kv"] is False
    assert reason in cap["reasons"]  # type: ignore[operator]


def test_dtype_mismatch_is_kv_only() -> None:
    cap = evaluate_pool_capability(REQUEST, {**PRIMARY_POOL, "kv_dtype": "bfloat16"})
    assert cap == {
        "pool_id": "decode-a",
        "can_execute": True,
        "can_accept_kv": False,
        "reasons": ["kv_dtype_mismatch"],
    }


def test_fallback_replanning() -> None:
    recompute = plan_route_with_fallback(
        REQUEST, {**PRIMARY_POOL, "kv_layout": "contiguous"}, [], "transfer"
    )
    assert recompute["selected_pool"] == "decode-a"
    assert recompute["execution_mode"] == "recompute"
    assert recompute["decision"] == "primary"

    fallback = {**PRIMARY_POOL, "pool_id": "decode-b"}
    rerouted = plan_route_with_fallback(
        REQUEST, {**PRIMARY_POOL, "healthy": False}, [fallback], "transfer"
    )
    assert rerouted["selected_pool"] == "decode-b"
    assert rerouted["decision"] == "reroute"

    rejected = plan_route_with_fallback(
        REQUEST, {**PRIMARY_POOL, "available_memory_gb": 2}, [], "transfer"
    )
    assert rejected["decision"] == "reject"
    assert rejected["selected_pool"] == "none"


def test_reject_lists_every_rejected_pool() -> None:
    second = {**PRIMARY_POOL, "pool_id": "decode-b", "model_revision": "rev-z"}
    rejected = plan_route_with_fallback(
        REQUEST, {**PRIMARY_POOL, "healthy": False}, [second], "transfer"
    )
    assert rejected["reasons"] == ["no_executable_pool"]
    assert rejected["rejected_pools"] == {
        "decode-a": ["unhealthy"],
        "decode-b": ["model_revision_mismatch"],
    }


def test_preferred_handoff_must_be_known() -> None:
    with pytest.raises(InvalidInputError):
        plan_route_with_fallback(REQUEST, PRIMARY_POOL, [], "teleport")


def test_serving_action_policy() -> None:
    memory_action = select_serving_action(
        memory_pressure=0.92, queue_delay_ms=20, slo_queue_budget_ms=80
    )
    assert memory_action == {"action": "fallback_to_shared", "protect": "residency"}
    latency_action = select_serving_action(
        memory_pressure=0.4, queue_delay_ms=120, slo_queue_budget_ms=80
    )
    assert latency_action == {"action": "route_or_throttle", "protect": "latency"}


@pytest.mark.parametrize(
    ("pressure", "delay", "expected"),
    [
        pytest.param(0.9, 20, "keep_heterogeneous_route", id="pressure-exactly-0.9-not-taken"),
        pytest.param(0.95, 500, "fallback_to_shared", id="memory-before-queue"),
        pytest.param(0.4, 80, "keep_heterogeneous_route", id="delay-exactly-budget"),
    ],
)
def test_serving_action_boundaries(pressure: float, delay: float, expected: str) -> None:
    assert select_serving_action(pressure, delay, 80)["action"] == expected


def test_route_record_contract() -> None:
    route = plan_route_with_fallback(REQUEST, PRIMARY_POOL, [], "transfer")
    action = select_serving_action(memory_pressure=0.4, queue_delay_ms=120, slo_queue_budget_ms=80)
    record = build_route_record({"resource_need": "decode"}, route, action)
    assert record == {
        "resource_need": "decode",
        "selected_pool": "decode-a",
        "execution_mode": "transfer",
        "route_decision": "primary",
        "service_action": "route_or_throttle",
        "protect": "latency",
    }
