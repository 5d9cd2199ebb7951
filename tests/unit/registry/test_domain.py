"""Registry domain: validation of every capability and load field, and the health machine."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from hpd_common.errors import InvalidArgument
from hpd_common.kvformat import KvDtype, KvFormat, KvLayout
from hpd_common.worker_model import Health, LoadReport, NetworkLocation, Stage, WorkerSpec
from hpd_registry.domain import WorkerRecord, WorkerState, derive_health, summarize_pools
from hpd_registry.validation import validate_load, validate_spec

NOW = 1_700_000_000_000


def spec(**changes: Any) -> WorkerSpec:
    kv_changes = changes.pop("kv", {})
    base = WorkerSpec(
        worker_id="w-1",
        pool_id="h100-prefill",
        endpoint="10.0.0.1:8000",
        stages=(Stage.PREFILL,),
        model_id="llama-3-8b",
        model_revision="rev-a",
        engine="vllm",
        engine_version="0.9",
        gpu_type="H100-SXM",
        gpu_count=2,
        tp_size=2,
        pp_size=1,
        peak_tflops=0.0,
        hbm_gbps=0.0,
        kv_memory_total_bytes=40 * 2**30,
        max_batch_size=256,
        kv_format=KvFormat(
            KvDtype.BF16, KvLayout.PAGED_NHD, 16, 32, 8, 128, 2, "flash_attn", "rev-a"
        ),
        network=NetworkLocation("z1", "r1", "h1", 200.0),
        labels=(("tier", "gold"),),
    )
    if kv_changes:
        base = replace(base, kv_format=replace(base.kv_format, **kv_changes))
    return replace(base, **changes)


def test_valid_spec_passes() -> None:
    validate_spec(spec(), known_gpu=True)


BAD_SPECS = [
    pytest.param({"worker_id": ""}, "capability.worker_id", id="worker_id-empty"),
    pytest.param({"worker_id": "x" * 129}, "capability.worker_id", id="worker_id-too-long"),
    pytest.param({"worker_id": "a b"}, "capability.worker_id", id="worker_id-space"),
    pytest.param({"pool_id": ""}, "capability.pool_id", id="pool_id-empty"),
    pytest.param({"endpoint": ""}, "capability.endpoint", id="endpoint-empty"),
    pytest.param({"endpoint": "host"}, "capability.endpoint", id="endpoint-no-port"),
    pytest.param({"endpoint": "host:0"}, "capability.endpoint", id="endpoint-port-0"),
    pytest.param({"endpoint": "host:70000"}, "capability.endpoint", id="endpoint-port-big"),
    pytest.param({"stages": ()}, "capability.stages", id="stages-empty"),
    pytest.param({"stages": (Stage.DECODE, Stage.DECODE)}, "capability.stages", id="stages-dup"),
    pytest.param({"model_id": ""}, "capability.model_id", id="model_id-empty"),
    pytest.param({"model_revision": ""}, "capability.model_revision", id="revision-empty"),
    pytest.param({"engine": ""}, "capability.engine", id="engine-empty"),
    pytest.param({"engine_version": "v" * 65}, "capability.engine_version", id="engine-ver-long"),
    pytest.param({"gpu_type": ""}, "capability.gpu_type", id="gpu_type-empty"),
    pytest.param({"gpu_count": 0}, "capability.gpu_count", id="gpu_count-0"),
    pytest.param({"gpu_count": 5000}, "capability.gpu_count", id="gpu_count-huge"),
    pytest.param({"tp_size": 0}, "capability.tp_size", id="tp-0"),
    pytest.param({"tp_size": 4}, "capability.tp_size", id="tp-exceeds-gpus"),
    pytest.param({"pp_size": 0}, "capability.pp_size", id="pp-0"),
    pytest.param({"peak_tflops": math.nan}, "capability.peak_tflops", id="tflops-nan"),
    pytest.param({"peak_tflops": -1.0}, "capability.peak_tflops", id="tflops-negative"),
    pytest.param({"hbm_gbps": math.inf}, "capability.hbm_gbps", id="hbm-inf"),
    pytest.param({"kv_memory_total_bytes": 0}, "capability.kv_memory_total_bytes", id="kv-mem-0"),
    pytest.param({"max_batch_size": 0}, "capability.max_batch_size", id="batch-0"),
    pytest.param({"max_batch_size": 10**6}, "capability.max_batch_size", id="batch-huge"),
    pytest.param(
        {"kv": {"block_size_tokens": 24}},
        "capability.kv_format.block_size_tokens",
        id="kv-block-not-pow2",
    ),
    pytest.param({"kv": {"num_layers": 0}}, "capability.kv_format.num_layers", id="kv-layers-0"),
    pytest.param({"kv": {"num_kv_heads": 0}}, "capability.kv_format.num_kv_heads", id="kv-heads-0"),
    pytest.param({"kv": {"head_dim": 0}}, "capability.kv_format.head_dim", id="kv-head-dim-0"),
    pytest.param({"kv": {"tp_size": 3}}, "capability.kv_format.tp_size", id="kv-tp-uneven"),
    pytest.param({"kv": {"tp_size": 1}}, "capability.kv_format.tp_size", id="kv-tp-differs"),
    pytest.param(
        {"kv": {"model_revision": "rev-b"}},
        "capability.kv_format.model_revision",
        id="kv-revision-differs",
    ),
    pytest.param(
        {"kv": {"attention_backend": " "}},
        "capability.kv_format.attention_backend",
        id="kv-backend-blank",
    ),
    pytest.param(
        {"network": NetworkLocation(nic_gbps=-1)}, "capability.network.nic_gbps", id="nic-negative"
    ),
    pytest.param(
        {"network": NetworkLocation(zone="z" * 129)}, "capability.network.zone", id="zone-long"
    ),
    pytest.param({"labels": (("bad key", "v"),)}, "capability.labels['bad key']", id="label-key"),
    pytest.param({"labels": (("k", "v" * 64),)}, "capability.labels['k']", id="label-value-long"),
    pytest.param(
        {"labels": tuple((f"k{i}", "v") for i in range(65))},
        "capability.labels",
        id="too-many-labels",
    ),
]


@pytest.mark.parametrize(("changes", "field"), BAD_SPECS)
def test_invalid_spec_names_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_spec(spec(**changes), known_gpu=True)
    assert err.value.field == field


def test_unknown_gpu_needs_explicit_figures() -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_spec(spec(gpu_type="X9000"), known_gpu=False)
    assert err.value.field == "capability.gpu_type"
    validate_spec(spec(gpu_type="X9000", peak_tflops=500.0, hbm_gbps=3000.0), known_gpu=False)


BAD_LOADS = [
    pytest.param({"gpu_util": 1.5}, "load.gpu_util", id="gpu-util-over-1"),
    pytest.param({"gpu_util": math.nan}, "load.gpu_util", id="gpu-util-nan"),
    pytest.param({"memory_util": -0.1}, "load.memory_util", id="mem-util-negative"),
    pytest.param(
        {"kv_blocks_free": 11, "kv_blocks_total": 10},
        "load.kv_blocks_free",
        id="free-exceeds-total",
    ),
    pytest.param({"queue_depth": -1}, "load.queue_depth", id="queue-negative"),
    pytest.param({"queue_max": 10**8}, "load.queue_max", id="queue-max-huge"),
    pytest.param({"running_prefills": -2}, "load.running_prefills", id="prefills-negative"),
    pytest.param({"batch_size": 10**8}, "load.batch_size", id="batch-huge"),
    pytest.param({"itl_p50_ms": -1.0}, "load.itl_p50_ms", id="itl-p50-negative"),
    pytest.param({"itl_p99_ms": math.inf}, "load.itl_p99_ms", id="itl-p99-inf"),
    pytest.param({"itl_p50_ms": 50.0, "itl_p99_ms": 40.0}, "load.itl_p50_ms", id="p50-over-p99"),
    pytest.param({"itl_trend_ms_per_s": math.nan}, "load.itl_trend_ms_per_s", id="trend-nan"),
    pytest.param({"prefill_tokens_per_s": -5.0}, "load.prefill_tokens_per_s", id="tps-negative"),
    pytest.param({"prefill_busy": 1.5}, "load.prefill_busy", id="prefill-busy-over-1"),
    pytest.param({"prefill_busy": math.nan}, "load.prefill_busy", id="prefill-busy-nan"),
    pytest.param({"reported_at_ms": NOW + 120_000}, "load.reported_at_unix_ms", id="future"),
    pytest.param({"reported_at_ms": NOW - 7_200_000}, "load.reported_at_unix_ms", id="ancient"),
]


@pytest.mark.parametrize(("changes", "field"), BAD_LOADS)
def test_invalid_load_names_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_load("load", LoadReport(**changes), NOW)
    assert err.value.field == field


def test_valid_load_passes() -> None:
    validate_load(
        "load",
        LoadReport(
            gpu_util=0.5,
            kv_blocks_free=5,
            kv_blocks_total=10,
            itl_p50_ms=20,
            itl_p99_ms=30,
            reported_at_ms=NOW - 10,
        ),
        NOW,
    )


def state(**changes: Any) -> WorkerState:
    base = WorkerState(
        registered_at_ms=NOW - 10_000,
        last_heartbeat_ms=NOW - 100,
        lease_expires_at_ms=NOW + 9_000,
        lease_ttl_ms=10_000,
    )
    return replace(base, **changes)


HEALTH_CASES = [
    pytest.param({}, Health.HEALTHY, id="healthy"),
    pytest.param({"lease_expires_at_ms": NOW - 1}, Health.EXPIRED, id="lease-past-expired"),
    pytest.param({"lease_expires_at_ms": NOW}, Health.HEALTHY, id="lease-at-now-still-live"),
    pytest.param({"unhealthy": True}, Health.UNHEALTHY, id="reported-unhealthy"),
    pytest.param({"suspect": True}, Health.SUSPECT, id="flagged-suspect"),
    pytest.param(
        {"last_heartbeat_ms": NOW - 2 * 3333 - 1}, Health.SUSPECT, id="two-intervals-missed"
    ),
    pytest.param(
        {"last_heartbeat_ms": NOW - 2 * 3333}, Health.HEALTHY, id="exactly-two-intervals-not-yet"
    ),
    pytest.param({"draining": True}, Health.DRAINING, id="draining"),
    pytest.param({"cordoned": True}, Health.CORDONED, id="cordoned"),
    pytest.param({"draining": True, "cordoned": True}, Health.DRAINING, id="drain-beats-cordon"),
    pytest.param({"suspect": True, "draining": True}, Health.SUSPECT, id="suspect-beats-drain"),
    pytest.param(
        {"unhealthy": True, "suspect": True}, Health.UNHEALTHY, id="unhealthy-beats-suspect"
    ),
    pytest.param(
        {"unhealthy": True, "lease_expires_at_ms": NOW - 1}, Health.EXPIRED, id="expired-beats-all"
    ),
]


@pytest.mark.parametrize(("changes", "expected"), HEALTH_CASES)
def test_health_precedence(changes: dict[str, Any], expected: Health) -> None:
    assert derive_health(state(**changes), NOW, heartbeat_interval_ms=3333) is expected


def test_pool_summary_aggregates() -> None:
    a = WorkerRecord(spec(worker_id="a"), state(), LoadReport(gpu_util=0.2, queue_depth=3), 1)
    b = WorkerRecord(spec(worker_id="b"), state(cordoned=True), LoadReport(gpu_util=0.6), 2)
    c = WorkerRecord(spec(worker_id="c", pool_id="other"), state(), None, 3)
    pools = summarize_pools([a, b, c], NOW)
    assert [p.pool_id for p in pools] == ["h100-prefill", "other"]
    p = pools[0]
    assert p.worker_count == 2
    assert p.workers_by_health == {"HEALTHY": 1, "CORDONED": 1}
    assert p.gpu_util_mean == pytest.approx(0.4)
    assert p.queue_depth_total == 3
    assert p.gpu_count == 4
    assert pools[1].gpu_util_mean == 0.0
