"""Protobuf <-> registry domain. The only registry module besides `api` that sees protobuf."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hpd_common.errors import InvalidArgument
from hpd_common.kvformat import KvDtype, KvFormat, KvLayout
from hpd_common.worker_model import Health, LoadReport, NetworkLocation, Stage, WorkerSpec
from hpd_registry.domain import Directive, DirectiveKind, PoolSummary, WorkerRecord

T = TypeVar("T")

STAGE_FROM_PB = {c.STAGE_PREFILL: Stage.PREFILL, c.STAGE_DECODE: Stage.DECODE}
STAGE_TO_PB = {v: k for k, v in STAGE_FROM_PB.items()}
DTYPE_FROM_PB = {
    c.KV_DTYPE_FP32: KvDtype.FP32,
    c.KV_DTYPE_FP16: KvDtype.FP16,
    c.KV_DTYPE_BF16: KvDtype.BF16,
    c.KV_DTYPE_FP8_E4M3: KvDtype.FP8_E4M3,
    c.KV_DTYPE_FP8_E5M2: KvDtype.FP8_E5M2,
    c.KV_DTYPE_INT8: KvDtype.INT8,
}
DTYPE_TO_PB = {v: k for k, v in DTYPE_FROM_PB.items()}
LAYOUT_FROM_PB = {
    c.KV_LAYOUT_PAGED_NHD: KvLayout.PAGED_NHD,
    c.KV_LAYOUT_PAGED_HND: KvLayout.PAGED_HND,
    c.KV_LAYOUT_CONTIGUOUS: KvLayout.CONTIGUOUS,
}
LAYOUT_TO_PB = {v: k for k, v in LAYOUT_FROM_PB.items()}
HEALTH_TO_PB = {
    Health.HEALTHY: c.HEALTH_STATE_HEALTHY,
    Health.SUSPECT: c.HEALTH_STATE_SUSPECT,
    Health.EXPIRED: c.HEALTH_STATE_EXPIRED,
    Health.DRAINING: c.HEALTH_STATE_DRAINING,
    Health.CORDONED: c.HEALTH_STATE_CORDONED,
    Health.UNHEALTHY: c.HEALTH_STATE_UNHEALTHY,
}
HEALTH_FROM_PB = {v: k for k, v in HEALTH_TO_PB.items()}
DIRECTIVE_FROM_PB = {
    c.DIRECTIVE_KIND_DRAIN: DirectiveKind.DRAIN,
    c.DIRECTIVE_KIND_SET_MAX_BATCH_SIZE: DirectiveKind.SET_MAX_BATCH_SIZE,
    c.DIRECTIVE_KIND_MIGRATE: DirectiveKind.MIGRATE,
    c.DIRECTIVE_KIND_THROTTLE: DirectiveKind.THROTTLE,
}
DIRECTIVE_TO_PB = {v: k for k, v in DIRECTIVE_FROM_PB.items()}


def enum_value(path: str, table: Mapping[Any, T], value: int) -> T:
    """The domain value for a proto enum value; UNSPECIFIED or unknown is INVALID_ARGUMENT."""
    if value not in table:
        raise InvalidArgument(path, "must be set to a known value (not UNSPECIFIED)")
    return table[value]


def kv_format_from_pb(m: c.KvFormat, path: str) -> KvFormat:
    return KvFormat(
        dtype=enum_value(f"{path}.dtype", DTYPE_FROM_PB, m.dtype),
        layout=enum_value(f"{path}.layout", LAYOUT_FROM_PB, m.layout),
        block_size_tokens=m.block_size_tokens,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        tp_size=m.tp_size,
        attention_backend=m.attention_backend,
        model_revision=m.model_revision,
    )


def kv_format_to_pb(kv: KvFormat) -> c.KvFormat:
    return c.KvFormat(
        dtype=DTYPE_TO_PB[kv.dtype],
        layout=LAYOUT_TO_PB[kv.layout],
        block_size_tokens=kv.block_size_tokens,
        num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        tp_size=kv.tp_size,
        attention_backend=kv.attention_backend,
        model_revision=kv.model_revision,
    )


def spec_from_pb(m: c.WorkerCapability) -> WorkerSpec:
    p = "capability"
    stages = tuple(enum_value(f"{p}.stages", STAGE_FROM_PB, s) for s in m.stages)
    if not m.HasField("kv_format"):
        raise InvalidArgument(f"{p}.kv_format", "is required")
    kv = kv_format_from_pb(m.kv_format, f"{p}.kv_format")
    return WorkerSpec(
        worker_id=m.worker_id,
        pool_id=m.pool_id,
        endpoint=m.endpoint,
        stages=stages,
        model_id=m.model_id,
        model_revision=m.model_revision,
        engine=m.engine,
        engine_version=m.engine_version,
        gpu_type=m.gpu_type,
        gpu_count=m.gpu_count,
        tp_size=m.tp_size,
        pp_size=m.pp_size or 1,
        peak_tflops=m.peak_tflops,
        hbm_gbps=m.hbm_gbps,
        kv_memory_total_bytes=m.kv_memory_total_bytes,
        max_batch_size=m.max_batch_size,
        max_context_tokens=m.max_context_tokens,
        kv_format=kv,
        network=NetworkLocation(
            zone=m.network.zone,
            rack=m.network.rack,
            host=m.network.host,
            nic_gbps=m.network.nic_gbps,
        ),
        labels=tuple(sorted(m.labels.items())),
    )


def spec_to_pb(s: WorkerSpec) -> c.WorkerCapability:
    return c.WorkerCapability(
        worker_id=s.worker_id,
        pool_id=s.pool_id,
        endpoint=s.endpoint,
        stages=[STAGE_TO_PB[x] for x in s.stages],
        model_id=s.model_id,
        model_revision=s.model_revision,
        engine=s.engine,
        engine_version=s.engine_version,
        gpu_type=s.gpu_type,
        gpu_count=s.gpu_count,
        tp_size=s.tp_size,
        pp_size=s.pp_size,
        peak_tflops=s.peak_tflops,
        hbm_gbps=s.hbm_gbps,
        kv_memory_total_bytes=s.kv_memory_total_bytes,
        max_batch_size=s.max_batch_size,
        max_context_tokens=s.max_context_tokens,
        kv_format=kv_format_to_pb(s.kv_format),
        network=c.NetworkLocation(
            zone=s.network.zone,
            rack=s.network.rack,
            host=s.network.host,
            nic_gbps=s.network.nic_gbps,
        ),
        labels=dict(s.labels),
    )


def load_from_pb(m: c.LoadReport) -> LoadReport:
    return LoadReport(
        gpu_util=m.gpu_util,
        memory_util=m.memory_util,
        kv_blocks_free=m.kv_blocks_free,
        kv_blocks_total=m.kv_blocks_total,
        queue_depth=m.queue_depth,
        queue_max=m.queue_max,
        running_prefills=m.running_prefills,
        batch_size=m.batch_size,
        itl_p50_ms=m.itl_p50_ms,
        itl_p99_ms=m.itl_p99_ms,
        itl_trend_ms_per_s=m.itl_trend_ms_per_s,
        prefill_tokens_per_s=m.prefill_tokens_per_s,
        reported_at_ms=m.reported_at_unix_ms,
        prefix_cache_hit_rate=m.prefix_cache_hit_rate,
        prefill_busy=m.prefill_busy,
    )


def load_to_pb(x: LoadReport) -> c.LoadReport:
    return c.LoadReport(
        gpu_util=x.gpu_util,
        memory_util=x.memory_util,
        kv_blocks_free=x.kv_blocks_free,
        kv_blocks_total=x.kv_blocks_total,
        queue_depth=x.queue_depth,
        queue_max=x.queue_max,
        running_prefills=x.running_prefills,
        batch_size=x.batch_size,
        itl_p50_ms=x.itl_p50_ms,
        itl_p99_ms=x.itl_p99_ms,
        itl_trend_ms_per_s=x.itl_trend_ms_per_s,
        prefill_tokens_per_s=x.prefill_tokens_per_s,
        reported_at_unix_ms=x.reported_at_ms,
        prefix_cache_hit_rate=x.prefix_cache_hit_rate,
        prefill_busy=x.prefill_busy,
    )


def worker_to_pb(rec: WorkerRecord, health: Health) -> c.Worker:
    st = rec.state
    w = c.Worker(
        capability=spec_to_pb(rec.spec),
        status=c.WorkerStatus(
            health=HEALTH_TO_PB[health],
            health_reason=rec.health_reason(health),
            draining=st.draining,
            cordoned=st.cordoned,
            registered_at_unix_ms=st.registered_at_ms,
            last_heartbeat_unix_ms=st.last_heartbeat_ms,
            lease_expires_at_unix_ms=st.lease_expires_at_ms,
            lease_ttl_ms=st.lease_ttl_ms,
        ),
        revision=rec.revision,
    )
    if rec.load is not None:
        w.load.CopyFrom(load_to_pb(rec.load))
    return w


def directive_from_pb(m: c.Directive) -> Directive:
    kind = enum_value("directive.kind", DIRECTIVE_FROM_PB, m.kind)
    return Directive(
        kind=kind,
        max_batch_size=m.max_batch_size,
        target_worker_id=m.target_worker_id,
        fraction=m.fraction,
        reason=m.reason,
        issuer=m.issuer,
    )


def directive_to_pb(d: Directive) -> c.Directive:
    return c.Directive(
        directive_id=d.directive_id,
        kind=DIRECTIVE_TO_PB[d.kind],
        max_batch_size=d.max_batch_size,
        target_worker_id=d.target_worker_id,
        fraction=d.fraction,
        reason=d.reason,
        created_at_unix_ms=d.created_at_ms,
        issuer=d.issuer,
    )


def pool_to_pb(p: PoolSummary) -> c.PoolSummary:
    return c.PoolSummary(
        pool_id=p.pool_id,
        model_id=p.model_id,
        stages=[STAGE_TO_PB[s] for s in p.stages],
        gpu_type=p.gpu_type,
        worker_count=p.worker_count,
        workers_by_health=p.workers_by_health,
        kv_memory_total_bytes=p.kv_memory_total_bytes,
        gpu_count=p.gpu_count,
        peak_tflops_total=p.peak_tflops_total,
        gpu_util_mean=p.gpu_util_mean,
        memory_util_mean=p.memory_util_mean,
        queue_depth_total=p.queue_depth_total,
        batch_size_total=p.batch_size_total,
        max_batch_size_total=p.max_batch_size_total,
    )


def reported_health(value: int, path: str) -> str:
    """'' (no change), 'ok' or 'bad' from the reported_health field."""
    if value == c.HEALTH_STATE_UNSPECIFIED:
        return ""
    if value == c.HEALTH_STATE_HEALTHY:
        return "ok"
    if value == c.HEALTH_STATE_UNHEALTHY:
        return "bad"
    raise InvalidArgument(path, "a worker may report only HEALTHY or UNHEALTHY")


WATCH_TYPES = {
    "snapshot": r.WATCH_EVENT_TYPE_SNAPSHOT,
    "snapshot_end": r.WATCH_EVENT_TYPE_SNAPSHOT_END,
    "put": r.WATCH_EVENT_TYPE_PUT,
    "load": r.WATCH_EVENT_TYPE_LOAD,
    "delete": r.WATCH_EVENT_TYPE_DELETE,
    "resync": r.WATCH_EVENT_TYPE_RESYNC,
    "bookmark": r.WATCH_EVENT_TYPE_BOOKMARK,
}
