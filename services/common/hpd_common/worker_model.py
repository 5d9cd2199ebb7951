"""The worker model every layer shares: what a worker declares about itself (its spec: the
stages it serves, model, engine, GPUs, KV format, where it is attached) and its load report.

One type each, used as is by the agent that sends them, the registry that validates and
stores them, the informer that follows them, the policy core that decides over them and
the simulator that makes them up. Pure: no I/O, no clock (times come in as arguments).

Units are in the names: ``_ms`` milliseconds, ``_s`` seconds, ``_gbps`` 10^9 bit/s,
``_util`` a fraction in [0, 1].
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpd_common.kvformat import KvDtype, KvFormat, KvLayout

__all__ = [
    "ASSUMED_NIC_GBPS",
    "Health",
    "LoadReport",
    "NetworkLocation",
    "Stage",
    "WorkerSpec",
]


class Stage(enum.StrEnum):
    """A stage a worker declares it serves (its spec lists one or both)."""

    PREFILL = "prefill"
    DECODE = "decode"


class Health(enum.StrEnum):
    """A worker's health as the registry derives it (``hpd_registry.domain.derive_health``).

    Precedence when several apply: EXPIRED > UNHEALTHY > SUSPECT > DRAINING > CORDONED. Only
    HEALTHY and SUSPECT workers receive new work; SUSPECT ones (a missed heartbeat) are kept
    but their stale report lowers their score. The planner names the others in lower case
    when it says why it passed a worker over.
    """

    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"
    EXPIRED = "EXPIRED"
    DRAINING = "DRAINING"
    CORDONED = "CORDONED"
    UNHEALTHY = "UNHEALTHY"


ASSUMED_NIC_GBPS = 100.0
"""A worker's NIC bandwidth when it declares none (``nic_gbps`` 0): a common datacenter
NIC, the figure the policy's link model prices a transfer with until told otherwise."""


@dataclass(frozen=True, slots=True)
class NetworkLocation:
    """Where a worker is attached: zone / rack / host and its NIC bandwidth (0: not
    declared, priced at :data:`ASSUMED_NIC_GBPS`)."""

    zone: str = ""
    rack: str = ""
    host: str = ""
    nic_gbps: float = 0.0

    @property
    def nic_or_assumed_gbps(self) -> float:
        return self.nic_gbps if self.nic_gbps > 0 else ASSUMED_NIC_GBPS


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """What a worker declares about itself (the proto WorkerCapability). Built by name; the
    defaults are what a worker that says nothing of them means (one GPU, no pipeline
    stages, ``peak_tflops`` / ``hbm_gbps`` 0: the GPU profile table's figures)."""

    worker_id: str
    pool_id: str
    endpoint: str
    stages: tuple[Stage, ...]
    model_id: str
    model_revision: str = ""
    engine: str = ""
    engine_version: str = ""
    gpu_type: str
    gpu_count: int = 1
    tp_size: int = 1
    pp_size: int = 1
    peak_tflops: float = 0.0
    hbm_gbps: float = 0.0
    kv_memory_total_bytes: int
    max_batch_size: int
    kv_format: KvFormat
    network: NetworkLocation = NetworkLocation()
    labels: tuple[tuple[str, str], ...] = ()
    max_context_tokens: int = 0  # prompt + output the engine accepts; 0 = not stated

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
            "max_context_tokens": self.max_context_tokens,
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
            max_context_tokens=int(d.get("max_context_tokens") or 0),
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
    """A worker's own account of its load, taken at ``reported_at_ms``.

    Zero means "not reported" for the throughput and latency figures; ``queue_max`` 0 means
    the worker declared no bound on its queue. ``reported_at_ms`` is on the sender's clock
    (wall clock from an agent, stamped by the registry when missing; simulated time in the
    simulator): only differences between it and a ``now`` on the same clock matter.

    The field order is the registry's stored binary form (``hpd_registry.store``): new
    fields go at the end.
    """

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
    prefill_busy: float = 0.0

    @property
    def reported_at_s(self) -> float:
        return self.reported_at_ms / 1000.0

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> LoadReport:
        known = LoadReport.__dataclass_fields__
        return LoadReport(**{k: v for k, v in d.items() if k in known})
