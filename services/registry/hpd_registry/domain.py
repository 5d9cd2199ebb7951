"""Registry domain: worker records, validation, the health state machine. Pure.

Nothing here touches Redis, gRPC or the clock: times come in as arguments.
Records round-trip through plain dicts (JSON in the store), never through protobuf.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hpd_common.errors import InvalidArgument
from hpd_common.kvformat import KvDtype, KvFormat, KvFormatError, KvLayout


class Stage(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Health(enum.StrEnum):
    """Precedence when several apply: EXPIRED > UNHEALTHY > SUSPECT > DRAINING > CORDONED."""

    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"
    EXPIRED = "EXPIRED"
    DRAINING = "DRAINING"
    CORDONED = "CORDONED"
    UNHEALTHY = "UNHEALTHY"


class DirectiveKind(enum.StrEnum):
    DRAIN = "DRAIN"
    SET_MAX_BATCH_SIZE = "SET_MAX_BATCH_SIZE"
    MIGRATE = "MIGRATE"
    THROTTLE = "THROTTLE"


ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9._/\-]{1,63}$")
MAX_LABELS = 64
MAX_GPUS = 1024
MAX_BATCH = 65_536
MAX_KV_BYTES = 1 << 50
MAX_COUNT = 10_000_000
MAX_MS = 1e7
CLOCK_SKEW_MS = 60_000
MAX_REPORT_AGE_MS = 3_600_000


@dataclass(frozen=True, slots=True)
class NetworkLocation:
    zone: str = ""
    rack: str = ""
    host: str = ""
    nic_gbps: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker declares about itself (the proto WorkerCapability)."""

    worker_id: str
    pool_id: str
    endpoint: str
    stages: tuple[Stage, ...]
    model_id: str
    model_revision: str
    engine: str
    engine_version: str
    gpu_type: str
    gpu_count: int
    tp_size: int
    pp_size: int
    peak_tflops: float
    hbm_gbps: float
    kv_memory_total_bytes: int
    max_batch_size: int
    kv_format: KvFormat
    network: NetworkLocation = NetworkLocation()
    labels: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        kv = self.kv_format
        return {
            "worker_id": self.worker_id,
            "pool_id": self.pool_id,
            "endpoint": self.endpoint,
            "stages": [s.value for s in self.stages],
            "model_id": self.model_id,
            "model_revision": self.model_revision,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "gpu_type": self.gpu_type,
            "gpu_count": self.gpu_count,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "peak_tflops": self.peak_tflops,
            "hbm_gbps": self.hbm_gbps,
            "kv_memory_total_bytes": self.kv_memory_total_bytes,
            "max_batch_size": self.max_batch_size,
            "kv_format": {
                "dtype": kv.dtype.value,
                "layout": kv.layout.value,
                "block_size_tokens": kv.block_size_tokens,
                "num_layers": kv.num_layers,
                "num_kv_heads": kv.num_kv_heads,
                "head_dim": kv.head_dim,
                "tp_size": kv.tp_size,
                "attention_backend": kv.attention_backend,
                "model_revision": kv.model_revision,
            },
            "network": {
                "zone": self.network.zone,
                "rack": self.network.rack,
                "host": self.network.host,
                "nic_gbps": self.network.nic_gbps,
            },
            "labels": dict(self.labels),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> WorkerSpec:
        kv = d["kv_format"]
        net = d.get("network") or {}
        return WorkerSpec(
            worker_id=d["worker_id"],
            pool_id=d["pool_id"],
            endpoint=d["endpoint"],
            stages=tuple(Stage(s) for s in d["stages"]),
            model_id=d["model_id"],
            model_revision=d["model_revision"],
            engine=d["engine"],
            engine_version=d.get("engine_version", ""),
            gpu_type=d["gpu_type"],
            gpu_count=int(d["gpu_count"]),
            tp_size=int(d["tp_size"]),
            pp_size=int(d["pp_size"]),
            peak_tflops=float(d["peak_tflops"]),
            hbm_gbps=float(d["hbm_gbps"]),
            kv_memory_total_bytes=int(d["kv_memory_total_bytes"]),
            max_batch_size=int(d["max_batch_size"]),
            kv_format=KvFormat(
                dtype=KvDtype(kv["dtype"]),
                layout=KvLayout(kv["layout"]),
                block_size_tokens=int(kv["block_size_tokens"]),
                num_layers=int(kv["num_layers"]),
                num_kv_heads=int(kv["num_kv_heads"]),
                head_dim=int(kv["head_dim"]),
                tp_size=int(kv["tp_size"]),
                attention_backend=kv["attention_backend"],
                model_revision=kv["model_revision"],
            ),
            network=NetworkLocation(
                zone=net.get("zone", ""),
                rack=net.get("rack", ""),
                host=net.get("host", ""),
                nic_gbps=float(net.get("nic_gbps", 0.0)),
            ),
            labels=tuple(sorted((str(k), str(v)) for k, v in (d.get("labels") or {}).items())),
        )


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A worker's own account of its load; `reported_at_ms` is when it took the figures."""

    gpu_util: float = 0.0
    memory_util: float = 0.0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    queue_depth: int = 0
    queue_max: int = 0
    running_prefills: int = 0
    batch_size: int = 0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0
    itl_trend_ms_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    reported_at_ms: int = 0
    prefix_cache_hit_rate: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> LoadReport:
        known = LoadReport.__dataclass_fields__
        return LoadReport(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True, slots=True)
class WorkerState:
    """Liveness and administrative state the registry keeps for a worker."""

    registered_at_ms: int
    last_heartbeat_ms: int
    lease_expires_at_ms: int
    lease_ttl_ms: int
    suspect: bool = False
    unhealthy: bool = False
    unhealthy_reason: str = ""
    draining: bool = False
    cordoned: bool = False
    admin_reason: str = ""


def flag_health(*, unhealthy: bool, suspect: bool, draining: bool, cordoned: bool) -> Health:
    """The precedence of a live worker's flags: UNHEALTHY > SUSPECT > DRAINING > CORDONED."""
    if unhealthy:
        return Health.UNHEALTHY
    if suspect:
        return Health.SUSPECT
    if draining:
        return Health.DRAINING
    if cordoned:
        return Health.CORDONED
    return Health.HEALTHY


def derive_health(state: WorkerState, now_ms: int, heartbeat_interval_ms: int) -> Health:
    """The single health value from the state's parts, by precedence (EXPIRED first).

    SUSPECT when the sweeper flagged it (two missed intervals or a stale load report)
    or when, at `now_ms`, more than two heartbeat intervals have passed since the last.
    """
    if state.lease_expires_at_ms < now_ms:
        return Health.EXPIRED
    return flag_health(
        unhealthy=state.unhealthy,
        suspect=state.suspect or now_ms - state.last_heartbeat_ms > 2 * heartbeat_interval_ms,
        draining=state.draining,
        cordoned=state.cordoned,
    )


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    spec: WorkerSpec
    state: WorkerState
    load: LoadReport | None
    revision: int

    def health(self, now_ms: int, heartbeat_interval_ms: int) -> Health:
        return derive_health(self.state, now_ms, heartbeat_interval_ms)

    def health_reason(self, health: Health) -> str:
        if health is Health.UNHEALTHY:
            return self.state.unhealthy_reason
        if health in (Health.DRAINING, Health.CORDONED):
            return self.state.admin_reason
        if health is Health.SUSPECT:
            return "missed_heartbeats_or_stale_load"
        return ""


@dataclass(frozen=True, slots=True)
class Directive:
    kind: DirectiveKind
    directive_id: str = ""
    max_batch_size: int = 0
    target_worker_id: str = ""
    fraction: float = 0.0
    reason: str = ""
    created_at_ms: int = 0
    issuer: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "directive_id": self.directive_id,
            "max_batch_size": self.max_batch_size,
            "target_worker_id": self.target_worker_id,
            "fraction": self.fraction,
            "reason": self.reason,
            "created_at_ms": self.created_at_ms,
            "issuer": self.issuer,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Directive:
        return Directive(
            kind=DirectiveKind(d["kind"]),
            directive_id=d.get("directive_id", ""),
            max_batch_size=int(d.get("max_batch_size", 0)),
            target_worker_id=d.get("target_worker_id", ""),
            fraction=float(d.get("fraction", 0.0)),
            reason=d.get("reason", ""),
            created_at_ms=int(d.get("created_at_ms", 0)),
            issuer=d.get("issuer", ""),
        )


@dataclass(frozen=True, slots=True)
class WorkerFilter:
    pool_id: str = ""
    model_id: str = ""
    stage: Stage | None = None
    health: Health | None = None
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, rec: WorkerRecord, health: Health) -> bool:
        spec = rec.spec
        if self.pool_id and spec.pool_id != self.pool_id:
            return False
        if self.model_id and spec.model_id != self.model_id:
            return False
        if self.stage is not None and self.stage not in spec.stages:
            return False
        if self.health is not None and health is not self.health:
            return False
        have = dict(spec.labels)
        return all(have.get(k) == v for k, v in self.labels)


@dataclass(slots=True)
class PoolSummary:
    pool_id: str
    model_id: str
    stages: tuple[Stage, ...]
    gpu_type: str
    worker_count: int = 0
    workers_by_health: dict[str, int] = field(default_factory=dict)
    kv_memory_total_bytes: int = 0
    gpu_count: int = 0
    peak_tflops_total: float = 0.0
    gpu_util_mean: float = 0.0
    memory_util_mean: float = 0.0
    queue_depth_total: int = 0
    batch_size_total: int = 0
    max_batch_size_total: int = 0


def heartbeat_interval_of(state: WorkerState) -> int:
    """A worker heartbeats every third of its own lease."""
    return max(1, state.lease_ttl_ms // 3)


def summarize_pools(records: Iterable[WorkerRecord], now_ms: int) -> list[PoolSummary]:
    """Per-pool aggregates; utilisation means are over workers that reported load; each
    worker's health is judged by its own heartbeat interval."""
    pools: dict[str, PoolSummary] = {}
    reported: dict[str, int] = {}
    for rec in records:
        spec = rec.spec
        pool = pools.get(spec.pool_id)
        if pool is None:
            pool = pools[spec.pool_id] = PoolSummary(
                spec.pool_id, spec.model_id, spec.stages, spec.gpu_type
            )
            reported[spec.pool_id] = 0
        health = rec.health(now_ms, heartbeat_interval_of(rec.state))
        pool.worker_count += 1
        pool.workers_by_health[health.value] = pool.workers_by_health.get(health.value, 0) + 1
        pool.kv_memory_total_bytes += spec.kv_memory_total_bytes
        pool.gpu_count += spec.gpu_count
        pool.peak_tflops_total += spec.peak_tflops * spec.gpu_count
        pool.max_batch_size_total += spec.max_batch_size
        if rec.load is not None:
            reported[spec.pool_id] += 1
            pool.gpu_util_mean += rec.load.gpu_util
            pool.memory_util_mean += rec.load.memory_util
            pool.queue_depth_total += rec.load.queue_depth
            pool.batch_size_total += rec.load.batch_size
    for pool_id, pool in pools.items():
        n = reported[pool_id]
        if n:
            pool.gpu_util_mean /= n
            pool.memory_util_mean /= n
    return sorted(pools.values(), key=lambda p: p.pool_id)


# ---------------------------------------------------------------------------------------------
# Validation: every field, with its dotted path in the error.


def check_id(path: str, value: str) -> None:
    if not value:
        raise InvalidArgument(path, "is required")
    if not ID_RE.match(value):
        raise InvalidArgument(path, "must be 1-128 characters of [A-Za-z0-9._:-]")


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
