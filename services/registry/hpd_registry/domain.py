"""Registry domain: worker records, validation, the health state machine. Pure.

Nothing here touches Redis, gRPC or the clock: times come in as arguments.
Records round-trip through plain dicts (JSON in the store), never through protobuf.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpd_common.worker_model import Health, LoadReport, Stage, WorkerSpec


class DirectiveKind(enum.StrEnum):
    DRAIN = "DRAIN"
    SET_MAX_BATCH_SIZE = "SET_MAX_BATCH_SIZE"
    MIGRATE = "MIGRATE"
    THROTTLE = "THROTTLE"


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
