"""Validation of what workers send the registry: every field of a capability record, a
load report and a directive, each error naming the field's dotted path (`InvalidArgument`).
The model itself is `domain.py`."""

from __future__ import annotations

import math
from dataclasses import replace

from hpd_common.errors import InvalidArgument
from hpd_common.ids import check_id
from hpd_common.kvformat import KvFormatError
from hpd_common.worker_model import LoadReport, WorkerSpec
from hpd_registry.domain import (
    CLOCK_SKEW_MS,
    LABEL_KEY_RE,
    MAX_BATCH,
    MAX_COUNT,
    MAX_GPUS,
    MAX_KV_BYTES,
    MAX_LABELS,
    MAX_MS,
    MAX_REPORT_AGE_MS,
    Directive,
    DirectiveKind,
)


def check_text(path: str, value: str, max_len: int, required: bool = False) -> None:
    if required and not value:
        raise InvalidArgument(path, "is required")
    if len(value) > max_len:
        raise InvalidArgument(path, f"longer than {max_len} characters")
    if any(ord(c) < 32 for c in value):
        raise InvalidArgument(path, "contains control characters")


def check_number(path: str, value: float, low: float, high: float) -> None:
    if not math.isfinite(value):
        raise InvalidArgument(path, "must be a finite number")
    if not low <= value <= high:
        raise InvalidArgument(path, f"must be in [{low:g}, {high:g}], got {value:g}")


def check_figure(path: str, value: float, low: float, high: float) -> None:
    """An optional physical figure: 0 (not given) or within ``[low, high]``. The floor keeps
    out values (subnormal TFLOPs, say) that a fleet model would divide by."""
    check_number(path, value, 0, high)
    if value and value < low:
        raise InvalidArgument(
            path, f"must be 0 (not given) or in [{low:g}, {high:g}], got {value:g}"
        )


def check_endpoint(path: str, value: str) -> None:
    check_text(path, value, 256, required=True)
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidArgument(path, "must be host:port with a port in 1..65535")


def validate_spec(spec: WorkerSpec, known_gpu: bool) -> None:
    """Raises InvalidArgument naming the first invalid field of a capability record."""
    p = "capability."
    check_id(p + "worker_id", spec.worker_id)
    check_id(p + "pool_id", spec.pool_id)
    check_endpoint(p + "endpoint", spec.endpoint)
    if not spec.stages:
        raise InvalidArgument(p + "stages", "at least one stage is required")
    if len(set(spec.stages)) != len(spec.stages):
        raise InvalidArgument(p + "stages", "a stage is listed twice")
    check_text(p + "model_id", spec.model_id, 256, required=True)
    check_text(p + "model_revision", spec.model_revision, 128, required=True)
    check_text(p + "engine", spec.engine, 64, required=True)
    check_text(p + "engine_version", spec.engine_version, 64)
    check_text(p + "gpu_type", spec.gpu_type, 64, required=True)
    check_number(p + "gpu_count", spec.gpu_count, 1, MAX_GPUS)
    check_number(p + "tp_size", spec.tp_size, 1, MAX_GPUS)
    check_number(p + "pp_size", spec.pp_size, 1, MAX_GPUS)
    if spec.tp_size * spec.pp_size > spec.gpu_count:
        raise InvalidArgument(p + "tp_size", "tp_size x pp_size exceeds gpu_count")
    # a CPU core does about 0.05 TFLOPs and 10 GB/s; nothing that serves a model does less
    check_figure(p + "peak_tflops", spec.peak_tflops, 0.001, 100_000)
    check_figure(p + "hbm_gbps", spec.hbm_gbps, 0.1, 1_000_000)
    if not known_gpu and (spec.peak_tflops <= 0 or spec.hbm_gbps <= 0):
        raise InvalidArgument(
            p + "gpu_type", f"unknown GPU profile {spec.gpu_type!r}: give peak_tflops and hbm_gbps"
        )
    check_number(p + "kv_memory_total_bytes", spec.kv_memory_total_bytes, 1, MAX_KV_BYTES)
    check_number(p + "max_batch_size", spec.max_batch_size, 1, MAX_BATCH)
    kv = spec.kv_format
    try:
        kv.validate()
    except KvFormatError as exc:
        raise InvalidArgument(p + "kv_format." + exc.field, exc.message) from exc
    if kv.tp_size != spec.tp_size:
        raise InvalidArgument(p + "kv_format.tp_size", "must equal capability.tp_size")
    if kv.model_revision != spec.model_revision:
        raise InvalidArgument(
            p + "kv_format.model_revision", "must equal capability.model_revision"
        )
    check_text(p + "kv_format.attention_backend", kv.attention_backend, 64, required=True)
    net = spec.network
    check_text(p + "network.zone", net.zone, 128)
    check_text(p + "network.rack", net.rack, 128)
    check_text(p + "network.host", net.host, 253)
    check_figure(p + "network.nic_gbps", net.nic_gbps, 0.001, 100_000)
    if len(spec.labels) > MAX_LABELS:
        raise InvalidArgument(p + "labels", f"at most {MAX_LABELS} labels")
    for key, value in spec.labels:
        if not LABEL_KEY_RE.match(key):
            raise InvalidArgument(p + f"labels[{key!r}]", "key must be 1-63 of [A-Za-z0-9._/-]")
        check_text(p + f"labels[{key!r}]", value, 63)


def validate_load(path: str, load: LoadReport, now_ms: int) -> None:
    """Raises InvalidArgument naming the first invalid field of a load report."""
    p = path + "."
    check_number(p + "gpu_util", load.gpu_util, 0, 1)
    check_number(p + "memory_util", load.memory_util, 0, 1)
    for name in ("kv_blocks_free", "kv_blocks_total"):
        check_number(p + name, getattr(load, name), 0, 1 << 40)
    if load.kv_blocks_free > load.kv_blocks_total:
        raise InvalidArgument(p + "kv_blocks_free", "exceeds kv_blocks_total")
    for name in ("queue_depth", "queue_max", "running_prefills", "batch_size"):
        check_number(p + name, getattr(load, name), 0, MAX_COUNT)
    check_number(p + "itl_p50_ms", load.itl_p50_ms, 0, MAX_MS)
    check_number(p + "itl_p99_ms", load.itl_p99_ms, 0, MAX_MS)
    if load.itl_p99_ms and load.itl_p50_ms > load.itl_p99_ms:
        raise InvalidArgument(p + "itl_p50_ms", "exceeds itl_p99_ms")
    check_number(p + "itl_trend_ms_per_s", load.itl_trend_ms_per_s, -MAX_MS, MAX_MS)
    check_number(p + "prefill_tokens_per_s", load.prefill_tokens_per_s, 0, 1e9)
    check_number(p + "prefix_cache_hit_rate", load.prefix_cache_hit_rate, 0, 1)
    check_number(p + "prefill_busy", load.prefill_busy, 0, 1)
    if load.reported_at_ms:
        if load.reported_at_ms > now_ms + CLOCK_SKEW_MS:
            raise InvalidArgument(p + "reported_at_unix_ms", "is in the future")
        if load.reported_at_ms < now_ms - MAX_REPORT_AGE_MS:
            raise InvalidArgument(p + "reported_at_unix_ms", "is more than an hour old")


def stamp_load(load: LoadReport, now_ms: int) -> LoadReport:
    """Fills reported_at with the receive time when the worker left it 0."""
    return load if load.reported_at_ms else replace(load, reported_at_ms=now_ms)


def validate_directive(d: Directive) -> None:
    p = "directive."
    check_text(p + "reason", d.reason, 512)
    check_text(p + "issuer", d.issuer, 64)
    if d.kind is DirectiveKind.SET_MAX_BATCH_SIZE:
        check_number(p + "max_batch_size", d.max_batch_size, 1, MAX_BATCH)
    if d.kind is DirectiveKind.MIGRATE:
        check_id(p + "target_worker_id", d.target_worker_id)
    if d.kind in (DirectiveKind.MIGRATE, DirectiveKind.THROTTLE):
        check_number(p + "fraction", d.fraction, 0, 1)
