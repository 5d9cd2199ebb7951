"""Cluster descriptions for the simulator: pools of GPUs, their KV formats, the links between
them and their prices, read from YAML and validated with the offending key named.

A cluster document::

    name: default
    model: llama-3-8b                 # a model of hpd_common.perfmodel.MODELS, or its
                                      # numbers: {name, params_b, num_layers, num_kv_heads,
                                      # head_dim, hidden_size}
    efficiency: {prefill_mfu: 0.5, decode_mbu: 0.7, tp_efficiency: 0.9}   # optional
    defaults: {memory_fraction: 0.9, max_batch_size: 256, nic_gbps: 200}
    pools:
      - id: h100-prefill-a            # unique pool id
        gpu: H100-SXM                 # a GPU profile (hpd_common.gpus), or its figures:
                                      # {name, peak_tflops, hbm_gbps, hbm_gib, price_per_hour}
        count: 2                      # workers in the pool
        tp: 1                         # GPUs per worker (tensor parallel degree)
        stage: prefill                # prefill | decode | both
        zone: a
        rack: a1
        kv: {dtype: bf16, layout: paged_nhd, block_size: 16}   # optional
        price_per_gpu_hour: 6.9       # optional, default from the GPU table
        kv_connector: true            # optional; false: its engines run no KV connector
                                      # (plain engines: no transfer in or out, label
                                      # kv-role=none as `hpd agent --kv-role none` sets)
        prefill_batch_tokens: 0       # optional: prompt tokens one prefill iteration takes
                                      # (vLLM's max_num_batched_tokens; 0: one prompt an
                                      # iteration, the prompts that fit whole otherwise)
        actual:                       # optional: how its engines really run against what
          prefill_scale: 1.0          # they declare (the GPU above): prefill compute x,
          prefill_fixed_ms: 0.0       # + ms per prefill, decode step x. The scheduler sees
          decode_scale: 1.0           # the declaration and learns the rest from outcomes
          decode_seq_ms: 0.0          # + ms per sequence in a decode step
          prefill_queue_share: 1.0    # each further prompt of a batched prefill iteration
                                      # adds this share of prefill_fixed_ms (0-1)
    links:                            # the policy core's LinkModel document
      classes: {cross_zone: {gbps: 25, latency_ms: 2.0}}
      pools: [{src: h100-prefill-a, dst: l40s-decode-b, gbps: 50, latency_ms: 1.0}]

Pipes (what transfers contend for): a pool-pair override is one pipe per (source pool,
destination pool); a locality class is one pipe per (class, source zone, destination zone),
so every transfer from zone a to zone b shares the one cross-zone pipe. A pipe's capacity is
the link's Gb/s (NIC-capped as the LinkModel caps it); concurrent transfers share it equally.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from hpd_common import perfmodel
from hpd_common.gpus import GpuProfile, UnknownGpuError, gpu_profile
from hpd_common.kvformat import KvDtype, KvFormat, KvLayout
from hpd_scheduler.policy import (
    LinkModel,
    Locality,
    NetworkLocation,
    Stage,
    WorkerSpec,
    WorkerView,
    declared_stages,
)
from hpd_scheduler.policy.links import locality

__all__ = [
    "ClusterError",
    "ClusterSpec",
    "PoolSpec",
    "default_cluster_path",
    "load_cluster",
    "parse_cluster",
]


class ClusterError(ValueError):
    """A bad cluster document; ``key`` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool: ``count`` identical workers of ``tp`` GPUs each."""

    pool_id: str
    gpu: GpuProfile
    count: int
    tp: int
    stage: Stage
    zone: str = ""
    rack: str = ""
    kv_dtype: KvDtype = KvDtype.BF16
    kv_layout: KvLayout = KvLayout.PAGED_NHD
    block_size: int = 16
    nic_gbps: float = 200.0
    max_batch_size: int = 256
    memory_fraction: float = 0.9
    price_per_gpu_hour: float = 0.0
    kv_connector: bool = True
    prefill_scale: float = 1.0
    prefill_fixed_ms: float = 0.0
    decode_scale: float = 1.0
    decode_seq_ms: float = 0.0
    prefill_queue_share: float = 1.0
    prefill_batch_tokens: int = 0

    @property
    def labels(self) -> dict[str, str]:
        """The labels its workers register with (the pool; ``kv-role: none`` without a KV
        connector, as an agent sets for such an engine)."""
        out = {"pool": self.pool_id}
        if not self.kv_connector:
            out["kv-role"] = "none"
        return out

    @property
    def gpus(self) -> int:
        """GPUs in the pool: count x tp."""
        return self.count * self.tp


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A validated cluster: model, efficiency, pools and the link model."""

    name: str
    model: perfmodel.ModelSpec
    pools: tuple[PoolSpec, ...]
    links: LinkModel = field(default_factory=LinkModel)
    efficiency: perfmodel.Efficiency = perfmodel.DEFAULT_EFFICIENCY

    @property
    def gpus(self) -> int:
        """Total GPUs."""
        return sum(p.gpus for p in self.pools)

    @property
    def price_per_hour(self) -> float:
        """Total assumed price in USD per hour: sum of GPUs x price per GPU-hour."""
        return sum(p.gpus * p.price_per_gpu_hour for p in self.pools)

    def colocated(self) -> ClusterSpec:
        """The same GPUs with every pool serving both stages (the colocated baseline)."""
        pools = tuple(replace(p, stage=Stage.BOTH) for p in self.pools)
        return replace(self, name=f"{self.name}-colocated", pools=pools)

    def kv_format(self, pool: PoolSpec) -> KvFormat:
        """The pool's KV format descriptor for this cluster's model."""
        return self.model.kv_format(
            dtype=pool.kv_dtype,
            layout=pool.kv_layout,
            block_size_tokens=pool.block_size,
            tp_size=pool.tp,
        )

    def worker_views(self) -> list[WorkerView]:
        """Static worker views (no load report), one per worker, ids ``<pool>-<n>``; the
        simulator fills in load and KV figures per decision."""
        views: list[WorkerView] = []
        # a model or GPU the tables do not know reaches the planner as an agent's
        # registration carries it: the model's size as labels, the GPU's figures in the spec
        model_labels: dict[str, str] = {}
        if not _known_model(self.model):
            model_labels = {
                "model-params": str(round(self.model.params_b * 1e9)),
                "model-attention-width": str(self.model.hidden_size),
            }
        for pool in self.pools:
            fmt = self.kv_format(pool)
            declared = not _known_gpu(pool.gpu)
            kv_tokens = perfmodel.max_kv_tokens(
                self.model, pool.gpu, pool.tp, pool.memory_fraction, pool.kv_dtype
            )
            kv_total = kv_tokens * fmt.bytes_per_token()
            for i in range(pool.count):
                views.append(
                    WorkerView(
                        WorkerSpec(
                            worker_id=f"{pool.pool_id}-{i}",
                            pool_id=pool.pool_id,
                            endpoint=f"sim://{pool.pool_id}/{i}",
                            stages=declared_stages(pool.stage),
                            model_id=self.model.name,
                            model_revision=self.model.name,
                            engine="sim",
                            gpu_type=pool.gpu.name,
                            gpu_count=pool.tp,
                            tp_size=pool.tp,
                            kv_memory_total_bytes=kv_total,
                            max_batch_size=pool.max_batch_size,
                            kv_format=fmt,
                            network=NetworkLocation(
                                zone=pool.zone,
                                rack=pool.rack,
                                host=f"{pool.pool_id}-{i}",
                                nic_gbps=pool.nic_gbps,
                            ),
                            labels=tuple(sorted({**pool.labels, **model_labels}.items())),
                            peak_tflops=pool.gpu.peak_tflops_bf16 if declared else 0.0,
                            hbm_gbps=pool.gpu.hbm_gbps if declared else 0.0,
                        ),
                        kv_available_bytes=kv_total,
                    )
                )
        return views

    def pipe_key(self, src: WorkerView, dst: WorkerView) -> tuple[str, ...]:
        """Which pipe a transfer from ``src`` to ``dst`` uses (module docstring)."""
        if (src.pool_id, dst.pool_id) in self.links.pool_overrides:
            return ("pools", src.pool_id, dst.pool_id)
        loc = locality(src, dst)
        if loc is Locality.SAME_HOST:
            return ("host", src.network.host)
        return (str(loc.value), src.network.zone, dst.network.zone)


def default_cluster_path() -> Path:
    """``data/clusters/default.yaml`` of the source tree (found from this file's location,
    then from the working directory)."""
    rel = Path("data") / "clusters" / "default.yaml"
    for parent in Path(__file__).resolve().parents:
        candidate = parent / rel
        if candidate.is_file():
            return candidate
    return Path.cwd() / rel


def _num(value: Any, key: str, lo: float, hi: float | None = None, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClusterError(key, f"must be a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise ClusterError(key, f"must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ClusterError(key, f"must be {bound}, got {value!r}")
    return value


_POOL_KEYS = {
    "id",
    "gpu",
    "count",
    "tp",
    "stage",
    "zone",
    "rack",
    "kv",
    "nic_gbps",
    "max_batch_size",
    "memory_fraction",
    "price_per_gpu_hour",
    "kv_connector",
    "actual",
    "prefill_batch_tokens",
}
_ACTUAL_KEYS = (
    "prefill_scale",
    "prefill_fixed_ms",
    "decode_scale",
    "decode_seq_ms",
    "prefill_queue_share",
)
_TOP_KEYS = {"name", "model", "efficiency", "defaults", "pools", "links", "description"}


def _pool(raw: Any, key: str, defaults: Mapping[str, Any], seen: set[str]) -> PoolSpec:
    if not isinstance(raw, Mapping):
        raise ClusterError(key, "must be a mapping")
    for k in raw:
        if k not in _POOL_KEYS:
            raise ClusterError(f"{key}.{k}", f"unknown key; known: {sorted(_POOL_KEYS)}")
    pid = raw.get("id")
    if not isinstance(pid, str) or not pid:
        raise ClusterError(f"{key}.id", "must be a non-empty string")
    if pid in seen:
        raise ClusterError(f"{key}.id", f"duplicate pool id {pid!r}")
    seen.add(pid)
    gpu = _gpu(raw.get("gpu", ""), f"{key}.gpu")
    try:
        stage = Stage(str(raw.get("stage", "")))
    except ValueError:
        raise ClusterError(f"{key}.stage", "must be prefill, decode or both") from None
    kv = raw.get("kv", {}) or {}
    if not isinstance(kv, Mapping):
        raise ClusterError(f"{key}.kv", "must be a mapping")
    try:
        dtype = KvDtype(str(kv.get("dtype", "bf16")))
    except ValueError:
        raise ClusterError(f"{key}.kv.dtype", f"one of {[d.value for d in KvDtype]}") from None
    try:
        layout = KvLayout(str(kv.get("layout", "paged_nhd")))
    except ValueError:
        raise ClusterError(f"{key}.kv.layout", f"one of {[v.value for v in KvLayout]}") from None

    def get(name: str, fallback: Any) -> Any:
        return raw.get(name, defaults.get(name, fallback))

    price = raw.get("price_per_gpu_hour", gpu.price_per_hour_usd)
    actual = raw.get("actual", {}) or {}
    if not isinstance(actual, Mapping):
        raise ClusterError(f"{key}.actual", "must be a mapping")
    _only(actual, _ACTUAL_KEYS, f"{key}.actual")
    return PoolSpec(
        pool_id=pid,
        gpu=gpu,
        count=_num(raw.get("count", 1), f"{key}.count", 1, integer=True),
        tp=_num(raw.get("tp", 1), f"{key}.tp", 1, integer=True),
        stage=stage,
        zone=str(raw.get("zone", "")),
        rack=str(raw.get("rack", "")),
        kv_dtype=dtype,
        kv_layout=layout,
        block_size=_num(kv.get("block_size", 16), f"{key}.kv.block_size", 1, integer=True),
        nic_gbps=float(_num(get("nic_gbps", 200.0), f"{key}.nic_gbps", 1e-9)),
        max_batch_size=_num(get("max_batch_size", 256), f"{key}.max_batch_size", 1, integer=True),
        memory_fraction=float(_num(get("memory_fraction", 0.9), f"{key}.memory_fraction", 0.01, 1)),
        price_per_gpu_hour=float(_num(price, f"{key}.price_per_gpu_hour", 0.0)),
        kv_connector=_flag(raw.get("kv_connector", True), f"{key}.kv_connector"),
        prefill_scale=float(_num(actual.get("prefill_scale", 1.0), f"{key}.actual", 1e-6)),
        prefill_fixed_ms=float(_num(actual.get("prefill_fixed_ms", 0.0), f"{key}.actual", 0.0)),
        decode_scale=float(_num(actual.get("decode_scale", 1.0), f"{key}.actual", 1e-6)),
        decode_seq_ms=float(_num(actual.get("decode_seq_ms", 0.0), f"{key}.actual", 0.0)),
        prefill_queue_share=float(
            _num(actual.get("prefill_queue_share", 1.0), f"{key}.actual", 0.0, 1.0)
        ),
        prefill_batch_tokens=_num(
            raw.get("prefill_batch_tokens", 0), f"{key}.prefill_batch_tokens", 0, integer=True
        ),
    )


_MODEL_KEYS = ("name", "params_b", "num_layers", "num_kv_heads", "head_dim", "hidden_size")
_GPU_KEYS = ("name", "peak_tflops", "hbm_gbps", "hbm_gib", "price_per_hour")


def _only(raw: Mapping[str, Any], known: tuple[str, ...], key: str) -> None:
    """A mapping holds only ``known`` keys (ClusterError names the first other)."""
    for k in raw:
        if k not in known:
            raise ClusterError(f"{key}.{k}", f"unknown key; known: {list(known)}")


def _model(raw: Any) -> perfmodel.ModelSpec:
    """A model of the table by name, or one described by its architecture numbers (a
    mapping of ``_MODEL_KEYS``: a model the table does not know, as an agent reads it from
    the model's ``config.json``)."""
    if isinstance(raw, Mapping):
        _only(raw, _MODEL_KEYS, "model")
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise ClusterError("model.name", "must be a non-empty string")
        try:
            return perfmodel.ModelSpec(
                name,
                float(_num(raw.get("params_b"), "model.params_b", 1e-9)),
                num_layers=_num(raw.get("num_layers"), "model.num_layers", 1, integer=True),
                num_kv_heads=_num(raw.get("num_kv_heads"), "model.num_kv_heads", 1, integer=True),
                head_dim=_num(raw.get("head_dim"), "model.head_dim", 1, integer=True),
                hidden_size=_num(raw.get("hidden_size"), "model.hidden_size", 1, integer=True),
            )
        except ValueError as exc:
            raise ClusterError("model", str(exc)) from None
    try:
        return perfmodel.model_spec(str(raw))
    except perfmodel.UnknownModelError as exc:
        raise ClusterError("model", str(exc)) from None


def _gpu(raw: Any, key: str) -> GpuProfile:
    """A GPU of the table by name, or one described by its figures (a mapping of
    ``_GPU_KEYS``: what an agent declares with ``--peak-tflops`` / ``--hbm-gbps``)."""
    if isinstance(raw, Mapping):
        _only(raw, _GPU_KEYS, key)
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise ClusterError(f"{key}.name", "must be a non-empty string")
        return GpuProfile(
            name,
            float(_num(raw.get("peak_tflops"), f"{key}.peak_tflops", 1e-9)),
            0.0,
            float(_num(raw.get("hbm_gib"), f"{key}.hbm_gib", 1e-9)),
            float(_num(raw.get("hbm_gbps"), f"{key}.hbm_gbps", 1e-9)),
            0.0,
            float(_num(raw.get("price_per_hour", 0.0), f"{key}.price_per_hour", 0.0)),
        )
    try:
        return gpu_profile(str(raw))
    except UnknownGpuError as exc:
        raise ClusterError(key, str(exc)) from None


def _known_gpu(gpu: GpuProfile) -> bool:
    try:
        gpu_profile(gpu.name)
    except UnknownGpuError:
        return False
    return True


def _known_model(model: perfmodel.ModelSpec) -> bool:
    try:
        perfmodel.model_spec(model.name)
    except perfmodel.UnknownModelError:
        return False
    return True


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ClusterError(key, f"must be true or false, got {value!r}")
    return value


def parse_cluster(doc: Any) -> ClusterSpec:
    """Validate a cluster document (module docstring); :class:`ClusterError` names the key."""
    if not isinstance(doc, Mapping):
        raise ClusterError("<root>", "must be a mapping")
    for k in doc:
        if k not in _TOP_KEYS:
            raise ClusterError(str(k), f"unknown key; known: {sorted(_TOP_KEYS)}")
    model = _model(doc.get("model", ""))
    eff_raw = doc.get("efficiency", {}) or {}
    if not isinstance(eff_raw, Mapping):
        raise ClusterError("efficiency", "must be a mapping")
    try:
        eff = perfmodel.Efficiency(**{str(k): float(v) for k, v in eff_raw.items()})
    except (TypeError, ValueError) as exc:
        raise ClusterError("efficiency", str(exc)) from None
    defaults = doc.get("defaults", {}) or {}
    if not isinstance(defaults, Mapping):
        raise ClusterError("defaults", "must be a mapping")
    raw_pools = doc.get("pools")
    if not isinstance(raw_pools, list) or not raw_pools:
        raise ClusterError("pools", "must be a non-empty list")
    seen: set[str] = set()
    pools = tuple(_pool(p, f"pools[{i}]", defaults, seen) for i, p in enumerate(raw_pools))
    for i, pool in enumerate(pools):
        if perfmodel.max_kv_tokens(model, pool.gpu, pool.tp, pool.memory_fraction) <= 0:
            raise ClusterError(f"pools[{i}].tp", f"{model.name} does not fit on {pool.gpu.name}")
    links_raw = doc.get("links", {}) or {}
    if not isinstance(links_raw, Mapping):
        raise ClusterError("links", "must be a mapping")
    try:
        links = LinkModel.from_dict(links_raw)
    except ValueError as exc:
        raise ClusterError(getattr(exc, "field", "links"), str(exc)) from None
    for src, dst in links.pool_overrides:
        for end, pid in (("src", src), ("dst", dst)):
            if pid not in seen:
                raise ClusterError(f"links.pools.{end}", f"unknown pool {pid!r}")
    return ClusterSpec(
        name=str(doc.get("name", "cluster")),
        model=model,
        pools=pools,
        links=links,
        efficiency=eff,
    )


def load_cluster(path: str | Path | None = None) -> ClusterSpec:
    """Load a cluster YAML file (the repository's default cluster when ``path`` is None)."""
    p = Path(path) if path is not None else default_cluster_path()
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ClusterError("<yaml>", str(exc)) from None
    return parse_cluster(doc)
